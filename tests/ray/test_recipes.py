"""A recipe Apiary did not write (`tests.support.recipes`), on a real local Ray cluster: the same path as
the built-ins, with its metrics and its own state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.contract.spec import JobSpec
from tests.support.datasets import write_tokens
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.checkpoint import checkpoint_dir_name, load_checkpoint
from trainers.launch import run
from trainers.loop import STEP_METRICS

pytestmark = [pytest.mark.timeout(300)]

RECIPE = "tests.support.recipes:CountingLM"


def recipe_spec(data: Path, *, max_steps: int, **fields: Any) -> JobSpec:
    return make_spec(
        trainer=RECIPE,
        name="counting-lm",
        dataset=data,
        config={"vocab_size": 32},
        max_steps=max_steps,
        checkpoint={"every_steps": 6},
        **fields,
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
    assert all(set(p["values"]) == {*STEP_METRICS, "accuracy", "batches_seen"} for p in points)
    for rank in (0, 1):
        seen = {p["step"]: p["values"]["batches_seen"] for p in points if p["rank"] == rank}
        assert seen == {step: float(step) for step in range(1, 13)}
    assert result.metrics["batches_seen"] == 12.0  # the checkpoint's metrics carry the recipe's too
