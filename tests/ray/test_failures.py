"""How a run fails on a real local Ray (`trainers.launch.run`): the job's own error is not retried by Ray
Train, whatever `max_failures` allows (`ApiaryFailurePolicy`), and reaches the caller with its message
(here a data error that only the workers' batches can tell)."""

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
