"""A Ray Train function run by Apiary (`trainers.ray_function`, examples/ray_function) on a real local
Ray: preempted mid-run, it stops at a report with its checkpoint recorded, and the next attempt (the
same run) hands the function that checkpoint; every report's metrics reach telemetry, every checkpoint
is recorded, and the service's retention (`keep_last`) deletes what the run no longer needs without
breaking its resume."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from service.contract.spec import JobSpec
from service.contract.storage import resolve_uri
from service.scheduling.retention import TOMBSTONE, Retention, StoredCheckpoint, to_delete
from tests.support.jobs import make_request
from tests.support.telemetry import TelemetryServer
from trainers.launch import run

pytestmark = [pytest.mark.timeout(300)]

EPOCHS = 24


def example_spec(**fields: Any) -> JobSpec:
    """examples/ray_function/job.yaml, smaller: no dataset, no max_steps, keep_last 2."""
    return JobSpec.model_validate(
        {
            "name": "ray-function",
            "trainer": "examples.ray_function.train:train_func",
            "num_workers": 2,
            "checkpoint": {"keep_last": 2},
            "config": {"epochs": EPOCHS, "steps_per_epoch": 2, "batch_size": 8, "hidden": 8},
            **fields,
        }
    )


def rank_points(server: TelemetryServer, rank: int) -> list[dict[str, Any]]:
    return sorted((p for p in server.points() if p["rank"] == rank), key=lambda p: p["step"])


def test_a_preempted_ray_function_resumes_from_its_checkpoint(ray_cluster: str, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    spec = example_spec()

    # Attempt 1: the control plane asks it to stop from the start (a preemption); it stops at a report.
    first = TelemetryServer()
    first.stop = True
    try:
        run(make_request(spec, storage=storage, run_name="ray-fn", telemetry_url=first.url))
    finally:
        first.close()
    points = rank_points(first, 0)
    stopped_at = points[-1]["step"]
    assert 1 <= stopped_at < EPOCHS, "it stopped at a report before its end"
    # Progress counted in reports: steps 1..k, with the function's own metrics, on both ranks.
    assert [p["step"] for p in points] == list(range(1, stopped_at + 1))
    assert [p["values"]["epoch"] for p in points] == list(range(stopped_at))
    assert all("loss" in p["values"] for p in points)
    assert [p["step"] for p in rank_points(first, 1)] == list(range(1, stopped_at + 1))
    # Each checkpoint (rank 0's) is recorded once, named by its step, under the run's folder.
    recorded = first.checkpoints()
    assert [c["step"] for c in recorded] == list(range(1, stopped_at + 1))
    assert recorded[-1]["uri"] == (storage / "ray-fn" / f"checkpoint_{stopped_at:08d}").as_uri()
    starts = [e for e in first.events() if e["kind"] == "group_started"]
    assert [e["step"] for e in starts] == [0]

    # The service's retention with keep_last 2 empties the older folders (tombstones stay for Ray).
    stored = [
        StoredCheckpoint(id=i, step=c["step"], uri=c["uri"], metrics={}) for i, c in enumerate(recorded)
    ]
    doomed = to_delete(stored, latest_uri=recorded[-1]["uri"], latest_step=stopped_at, keep_last=2)
    assert [c.step for c in doomed] == list(range(1, stopped_at - 1))
    retention = Retention(
        db=None, fenced=lambda session: True, run_uri=lambda job_id: str(storage / "ray-fn")
    )  # type: ignore[arg-type]
    for checkpoint in doomed:
        assert retention._delete(checkpoint.uri, job_id=1, now=datetime.now(UTC)) is None
        assert [path.name for path in Path(resolve_uri(checkpoint.uri)[0]).iterdir()] == [TOMBSTONE]

    # Attempt 2, the same run: the function gets its latest checkpoint and goes on to its end.
    second = TelemetryServer()
    try:
        run(make_request(spec, storage=storage, run_name="ray-fn", telemetry_url=second.url))
    finally:
        second.close()
    points = rank_points(second, 0)
    assert [p["step"] for p in points] == list(range(stopped_at + 1, EPOCHS + 1))
    # The function itself resumed: its first epoch is the one after the checkpoint's.
    assert points[0]["values"]["epoch"] == stopped_at
    starts = [e for e in second.events() if e["kind"] == "group_started"]
    assert [e["step"] for e in starts] == [stopped_at]
    # The checkpoint it resumed from (recorded again at the group's start, in case the attempt that
    # wrote it died before recording it), then each new one.
    assert [c["step"] for c in second.checkpoints()] == list(range(stopped_at, EPOCHS + 1))
