"""A recipe Apiary did not write (`tests.support.recipes`), on a real local Ray cluster: the same path as
the built-ins, with its metrics and its own state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from service.contract.spec import JobSpec
from tests.support.datasets import write_tokens
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer, trained
from trainers.checkpoint import build_model_from_checkpoint, checkpoint_dir_name, load_checkpoint
from trainers.data import inspect_dataset, iter_batches_for_rank
from trainers.launch import run
from trainers.loop import STEP_METRICS
from trainers.recipe import recipe_for, split_loss

pytestmark = [pytest.mark.timeout(300)]

RECIPE = "tests.support.recipes:CountingLM"


def recipe_spec(data: Path, *, max_steps: int, **fields: Any) -> JobSpec:
    return make_spec(
        trainer=RECIPE,
        name="counting-lm",
        dataset=data,
        config={"vocab_size": 32},
        max_steps=max_steps,
        **{"checkpoint": {"every_steps": 6}, **fields},
    )


def test_a_recipe_reports_its_metrics_and_resumes_its_own_state(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    data = write_tokens(tmp_path / "tokens", rows=128, seq_len=9, vocab_size=32, shards=2)
    storage = tmp_path / "storage"

    def request(max_steps: int) -> Any:
        spec = recipe_spec(data, max_steps=max_steps)
        return make_request(spec, storage=storage, run_name="recipe-run", telemetry_url=telemetry_server.url)

    assert run(request(6)).step == 6
    # Resubmitted under the same run name: it resumes at step 6, its own count too.
    result = run(request(12))
    assert result.step == 12

    state = load_checkpoint(storage / "recipe-run" / checkpoint_dir_name(12))
    assert state["recipe_state"] == {"batches_seen": 12}
    assert state["trainer"] == RECIPE
    points = telemetry_server.points()
    assert all(set(trained(p)) == {*STEP_METRICS, "accuracy", "batches_seen"} for p in points)
    for rank in (0, 1):
        seen = {p["step"]: p["values"]["batches_seen"] for p in points if p["rank"] == rank}
        assert seen == {step: float(step) for step in range(1, 13)}
    assert result.metrics["batches_seen"] == 12.0  # the checkpoint's metrics carry the recipe's too


def test_evaluation_records_the_same_batches_at_its_steps_and_at_checkpoints_it_ranks(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    data = write_tokens(tmp_path / "tokens", rows=128, seq_len=9, vocab_size=32, shards=2)
    held_out = write_tokens(tmp_path / "held-out", rows=64, seq_len=9, vocab_size=32, shards=1)
    spec = recipe_spec(
        data,
        max_steps=10,
        checkpoint={"every_steps": 6, "keep_best": {"metric": "eval_loss", "mode": "min"}},
        eval={"dataset": {"uri": held_out.as_uri()}, "every_steps": 4, "max_batches": 2},
    )
    result = run(
        make_request(
            spec, storage=tmp_path / "storage", run_name="eval-run", telemetry_url=telemetry_server.url
        )
    )

    points = telemetry_server.points()
    evals = {p["step"]: p["values"] for p in points if p["rank"] == 0 and "eval_loss" in p["values"]}
    # Every 4 steps, at the checkpoint of step 6 (keep_best ranks by eval_loss) and at the end.
    assert sorted(evals) == [4, 6, 8, 10]
    assert not any(key.startswith("eval_") for p in points if p["rank"] == 1 for key in p["values"])
    assert {key for values in evals.values() for key in values if key.startswith("eval_")} == {
        "eval_loss", "eval_accuracy", "eval_batches_seen", "eval_token_sum",
    }  # fmt: skip
    assert len({values["eval_token_sum"] for values in evals.values()}) == 1  # the same batches each time
    assert evals[10]["eval_loss"] < evals[4]["eval_loss"]
    assert result.metrics["eval_loss"] == evals[10]["eval_loss"]  # the final checkpoint's metrics


def test_evaluation_under_fsdp_is_the_mean_over_both_ranks_batches(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    """The built-in gpt, sharded: the eval at the end equals the final model's loss on the eval batches
    of both ranks, computed here in one process."""
    data = write_tokens(tmp_path / "tokens", rows=128, seq_len=9, vocab_size=32, shards=2)
    held_out = write_tokens(tmp_path / "held-out", rows=80, seq_len=9, vocab_size=32, shards=1, max_stride=3)
    spec = make_spec(
        trainer="gpt",
        dataset=data,
        config={"vocab_size": 32, "d_model": 16, "n_layers": 1, "n_heads": 2},
        max_steps=6,
        batch_size=8,
        strategy="fsdp",
        eval={"dataset": {"uri": held_out.as_uri()}, "every_steps": 3, "max_batches": 2},
    )
    request = make_request(
        spec, storage=tmp_path / "storage", run_name="fsdp-eval", telemetry_url=telemetry_server.url
    )
    result = run(request)
    assert result.checkpoint_path is not None

    evals = {
        p["step"]: p["values"]["eval_loss"] for p in telemetry_server.points() if "eval_loss" in p["values"]
    }
    assert sorted(evals) == [3, 6]
    model = build_model_from_checkpoint(result.checkpoint_path)
    recipe = recipe_for(spec)
    eval_spec = spec.model_copy(update={"dataset": spec.eval.dataset}) if spec.eval else spec
    info = inspect_dataset(eval_spec, recipe=recipe)
    losses = []
    for rank in (0, 1):
        stream = iter_batches_for_rank(
            request.model_copy(update={"spec": eval_spec}),
            info,
            rank=rank,
            world_size=2,
            collate_fn=recipe.build_collate(info.row_shape, uri=info.uri),
        )
        with stream, torch.no_grad():
            losses += [split_loss(recipe.loss(model, next(stream)[1]))[0].item() for _ in range(2)]
    assert evals[6] == pytest.approx(sum(losses) / len(losses), rel=1e-4)
