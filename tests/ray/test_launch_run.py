"""End to end on a real local Ray cluster: `trainers.launch.run()` and `python -m trainers.launch`.

Each `run()` pays the Train controller's and workers' start-up, so the jobs are tiny and each test
checks as much as one run can show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from api.demo import write_shards
from service.contract.errors import DatasetError
from service.contract.protocol import error_line
from tests.support.datasets import write_classes, write_tokens
from tests.support.jobs import launch_environment, make_request, make_spec
from tests.support.telemetry import TelemetryServer, trained
from trainers.checkpoint import (
    auto_cadence,
    build_model_from_checkpoint,
    checkpoint_dir_name,
    load_checkpoint,
)
from trainers.launch import run
from trainers.loop import STEP_METRICS
from trainers.models import GPT

pytestmark = [pytest.mark.timeout(300)]

GPT_CONFIG = {"vocab_size": 32, "d_model": 32, "n_layers": 2, "n_heads": 4, "warmup_steps": 5, "lr": 3e-3}


def test_gpt_trains_checkpoints_sends_telemetry_and_resumes(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    data = write_tokens(tmp_path / "tokens", rows=256, seq_len=17, vocab_size=32, shards=3)
    storage = tmp_path / "storage"

    def request(max_steps: int) -> Any:
        spec = make_spec(
            trainer="gpt",
            dataset=data,
            config=GPT_CONFIG,
            max_steps=max_steps,
            checkpoint={"every_steps": 10},
        )
        return make_request(spec, storage=storage, run_name="gpt-run", telemetry_url=telemetry_server.url)

    # First submission stops at step 20; the second, under the same run name, resumes there.
    first = run(request(20))
    assert first.step == 20
    second = run(request(30))
    assert second.step == 30
    run_dir = storage / "gpt-run"
    assert second.checkpoint_uri == (run_dir / checkpoint_dir_name(30)).as_uri()

    for step in (10, 20, 30):
        state = load_checkpoint(run_dir / checkpoint_dir_name(step))
        assert state["step"] == step
        assert state["world_size"] == 2 and len(state["rng"]) == 2
        assert state["samples_consumed"] == step * 2 * 16
    model = build_model_from_checkpoint(run_dir / checkpoint_dir_name(30))
    assert isinstance(model, GPT) and model.block_size == 16
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 32)

    points = telemetry_server.points()
    assert {p["rank"] for p in points} == {0, 1}
    for rank in (0, 1):
        steps = [p["step"] for p in points if p["rank"] == rank]
        # Each step once per rank: the resumed run started at 21, not at 1.
        assert sorted(steps) == list(range(1, 31))
    assert all(set(trained(p)) == set(STEP_METRICS) for p in points)
    # Every rank's posts carried what its process uses (trainers.system).
    for rank in (0, 1):
        figures = [b["status"]["system"] for b in telemetry_server.batches if b["status"]["rank"] == rank]
        assert figures and all(f["rss_bytes"] > 0 for f in figures), figures[:1]
        assert max(f["data_read_bytes"] for f in figures) > 0
        assert any(f["cpu_percent"] for f in figures)
    loss = {p["step"]: p["values"]["loss"] for p in points if p["rank"] == 0}
    assert loss[30] < loss[1] - 0.5, loss
    # The second run reports the checkpoint it resumed from too (the control plane may have missed it).
    assert [c["step"] for c in telemetry_server.checkpoints()] == [10, 20, 20, 30]
    assert telemetry_server.checkpoints()[-1]["uri"] == second.checkpoint_uri


def test_mlp_learns_with_the_automatic_checkpoint_cadence(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    """`checkpoint: {auto: true}` on real workers: the first save, after step 1, measures the save time;
    rank 0 then takes Daly's interval for it and the MTBF the service handed over, and says so."""
    data = write_classes(tmp_path / "cls", rows=512, num_features=8, num_classes=3)
    spec = make_spec(
        trainer="mlp",
        dataset=data,
        config={"num_classes": 3, "lr": 1e-2},
        max_steps=40,
        checkpoint={"auto": True},
    )
    request = make_request(
        spec,
        storage=tmp_path / "storage",
        run_name="mlp-run",
        telemetry_url=telemetry_server.url,
        mtbf_s=600.0,
        mtbf_basis="observed: 3 failure(s) in 0.5 job-hours",
    )
    result = run(request)

    assert result.step == 40
    assert result.metrics["loss"] < 0.3  # from ~ln(3) = 1.1 at the start
    assert set(STEP_METRICS) <= set(result.metrics)
    assert result.checkpoint_path is not None
    model = build_model_from_checkpoint(result.checkpoint_path)
    assert model(torch.zeros(2, 8)).shape == (2, 3)

    steps = [c["step"] for c in telemetry_server.checkpoints()]
    assert steps[0] == 1 and steps[-1] == 40, steps  # the measuring save, and the final one
    # One event for the first measured save, another whenever a later save moves it by over a quarter.
    cadence = next(e for e in telemetry_server.events() if e["kind"] == "checkpoint_cadence")
    assert cadence["step"] == 1 and cadence["rank"] == 0
    # Daly for a save of well under a second and a 10-minute MTBF: seconds, not the default MTBF's
    # hours. The event's save_s is rounded to the millisecond: the interval lies between Daly's for
    # the two ends of that rounding (a save of a few ms moves by percents within it).
    low, high = (
        auto_cadence(
            save_s=max(cadence["data"]["save_s"] + half_ms, 1e-6),
            mtbf_s=600.0,
            mtbf_basis="observed",
            async_=True,
        )
        for half_ms in (-0.0005, 0.0005)
    )
    assert low.interval_s <= cadence["data"]["interval_s"] <= high.interval_s
    assert cadence["data"]["mtbf_s"] == 600.0
    assert 0.5 < cadence["data"]["interval_s"] < 60.0
    assert cadence["message"].startswith("checkpoint every ")
    assert "observed: 3 failure(s) in 0.5 job-hours" in cadence["message"]


def test_bad_dataset_fails_before_training_with_a_clear_reason(ray_cluster: str, tmp_path: Path) -> None:
    data = write_classes(tmp_path / "cls", rows=64)
    spec = make_spec(trainer="gpt", dataset=data, config=GPT_CONFIG)
    request = make_request(spec, storage=tmp_path / "storage", run_name="bad")
    expected = f"dataset {data.as_uri()} has no column 'tokens' (columns: id, features, label)"

    with pytest.raises(DatasetError) as raised:
        run(request)
    assert str(raised.value) == expected

    # The same through the real entrypoint, as the service runs it: exit 1, reason on the last line.
    env = {**os.environ, **launch_environment(request), "RAY_ADDRESS": ray_cluster}
    process = subprocess.run(
        [sys.executable, "-m", "trainers.launch"], env=env, capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 1, process.stderr
    assert process.stderr.rstrip("\n").splitlines()[-1] == error_line(expected)


def test_a_ray_function_gets_its_config_and_the_dataset(ray_cluster: str, tmp_path: Path) -> None:
    """A function trainer is a Ray Train function (docs/jobs.md): called with the spec's `config`, it
    reads the whole epoch through `get_dataset_shard("train")`."""
    tokens = [[row % 32, (row + 1) % 32] for row in range(96)]
    table = pa.table({"id": range(96), "tokens": pa.array(tokens, pa.list_(pa.int64()))})
    data = tmp_path / "tokens"
    write_shards(table, data.as_uri(), num_shards=3)
    out = tmp_path / "seen"
    out.mkdir()
    spec = make_spec(
        trainer="tests.support.custom_trainer:train",
        name="custom",
        dataset=data,
        config={"out": str(out)},
        max_steps=4,
        batch_size=8,
    )
    run(make_request(spec, storage=tmp_path / "storage", run_name="custom"))
    seen = [json.loads((out / f"custom-rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert sum(rank["shard_rows"] for rank in seen) == 96
