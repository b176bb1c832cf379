"""How a run fails on a real local Ray (`trainers.launch.run`): the job's own error is not retried by Ray
Train, whatever `max_failures` allows (`trainers.ray_private.ApiaryFailurePolicy` with
`trainers.launch.is_own_failure`), and reaches the caller with its message (here a data error that
only the workers' batches can tell); a dead worker is, and each restart is posted as a `worker_failed`
event."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.datasets import write_classes
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.launch import TrainingFailed, run

pytestmark = [pytest.mark.timeout(300)]


def test_the_jobs_own_error_fails_at_once_without_restarts(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    # Labels go up to 2 but the spec says two classes: only the workers' batches can tell (the data
    # error reaches the caller as the run's failure).
    data = write_classes(tmp_path / "classes", num_classes=3)
    spec = make_spec(
        trainer="mlp",
        dataset=data.as_uri(),
        config={"task": "classification", "num_classes": 2},  # the data has label 2
        max_steps=20,
        max_failures=3,
        num_workers=2,
    )
    request = make_request(
        spec, storage=tmp_path / "storage", run_name="own-error", telemetry_url=telemetry_server.url
    )
    with pytest.raises(TrainingFailed, match=r"label 2 is outside \[0, num_classes=2\)") as failed:
        run(request)
    assert not failed.value.retryable
    starts = [event for event in telemetry_server.events() if event["kind"] == "group_started"]
    assert len(starts) == 1, [e["message"] for e in telemetry_server.events()]
    assert not [event for event in telemetry_server.events() if event["kind"] == "worker_failed"]


def test_a_dead_worker_restarts_the_group_and_the_restart_is_posted(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    data = write_classes(tmp_path / "classes", num_classes=3)
    out = tmp_path / "out"
    out.mkdir()
    spec = make_spec(
        trainer="tests.support.custom_trainer:exit_once",
        name="exit-once",
        dataset=data.as_uri(),
        config={"out": str(out)},
        max_failures=1,
        num_workers=2,
    )
    request = make_request(
        spec, storage=tmp_path / "storage", run_name="dead-worker", telemetry_url=telemetry_server.url
    )
    run(request)
    assert (out / "rank-1-exited").exists()
    failed = [event for event in telemetry_server.events() if event["kind"] == "worker_failed"]
    assert len(failed) == 1, [e["message"] for e in telemetry_server.events()]
    assert failed[0]["message"].startswith("worker group failed (rank 1: "), failed[0]["message"]
