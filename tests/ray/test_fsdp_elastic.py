"""FSDP, bf16 and elastic workers through `trainers.launch.run()` on a real local Ray cluster.

One test, two runs: a 2-worker FSDP bf16 job checkpoints at step 10; the same
run resumed with `num_workers: {min: 1, max: 3}` (elastic; the cluster has room for 3) re-shards
that checkpoint onto 3 workers and continues from step 11.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.datasets import write_tokens
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.checkpoint import (
    SHARDED_DIR,
    build_model_from_checkpoint,
    checkpoint_dir_name,
    load_checkpoint,
)
from trainers.launch import run
from trainers.models import GPT

pytestmark = [pytest.mark.timeout(600)]

GPT_CONFIG = {"vocab_size": 32, "d_model": 32, "n_layers": 2, "n_heads": 4, "warmup_steps": 5, "lr": 3e-3}


def test_fsdp_bf16_checkpoint_resumes_on_an_elastic_group_of_another_size(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    data = write_tokens(tmp_path / "tokens", rows=256, seq_len=17, vocab_size=32, shards=3)
    storage = tmp_path / "storage"

    def request(max_steps: int, num_workers: Any) -> Any:
        spec = make_spec(
            trainer="gpt",
            dataset=data,
            config=GPT_CONFIG,
            strategy="fsdp",
            precision="bf16",
            num_workers=num_workers,
            resources_per_worker={"CPU": 0.5},
            max_steps=max_steps,
            batch_size=8,
            checkpoint={"every_steps": 10},
        )
        return make_request(spec, storage=storage, run_name="fsdp-run", telemetry_url=telemetry_server.url)

    first = run(request(10, 2))
    assert first.step == 10
    first_dir = storage / "fsdp-run" / checkpoint_dir_name(10)
    state = load_checkpoint(first_dir)
    assert state["model_format"] == "sharded" and state["world_size"] == 2
    # Ray Train merged both ranks' shards into the one checkpoint folder.
    assert {p.name for p in (first_dir / SHARDED_DIR).iterdir()} >= {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    }
    weights_at_10 = build_model_from_checkpoint(first_dir).state_dict()

    second = run(request(16, {"min": 1, "max": 3}))
    assert second.step == 16
    state = load_checkpoint(storage / "fsdp-run" / checkpoint_dir_name(16))
    assert state["step"] == 16 and state["world_size"] == 3

    points = telemetry_server.points()
    steps_by_rank: dict[int, list[int]] = {}
    for point in points:
        steps_by_rank.setdefault(point["rank"], []).append(point["step"])
    assert sorted(steps_by_rank[0]) == list(range(1, 17))  # the resumed run went on at step 11
    assert sorted(steps_by_rank[2]) == list(range(11, 17))  # a third rank joined for the resumed run
    loss = {p["step"]: p["values"]["loss"] for p in points if p["rank"] == 0}
    assert loss[16] < loss[1] - 0.3, loss

    model = build_model_from_checkpoint(second.checkpoint_path or "")
    assert isinstance(model, GPT)
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 32)
    assert any(not torch.equal(value, weights_at_10[key]) for key, value in model.state_dict().items())
