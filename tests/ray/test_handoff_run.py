"""One attempt as the service launches it, on a real local Ray cluster: the scheduler writes the
attempt's handoff (launch request and report token) to storage, `python -m trainers.launch` starts with
only the pointer in its environment, reads the spec from the handoff, trains, and its ranks' reports
carry the attempt's token, which the real API (on SQLite, over HTTP) accepts.

Ray's job submission is the one thing played by hand: the fake backend takes the submission, and the
test runs its entrypoint with its environment, as Ray would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.server import BackgroundServer
from service.cluster import RayJobStatus, free_port
from service.contract.protocol import LAUNCH_ENV_VAR
from service.runtime import Runtime
from service.settings import Settings
from tests.support.datasets import write_classes
from tests.support.fakes import FakeBackend

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[httpx.Client, Runtime, FakeBackend]]:
    port = free_port()
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path / 'apiary.db'}",
        port=port,
        data_roots=str(tmp_path),
    )
    backend = FakeBackend()
    runtime = Runtime(settings, backend=backend, run_scheduler=False)
    server = BackgroundServer(create_app(runtime=runtime), host="127.0.0.1", port=port)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            yield http, runtime, backend
    finally:
        server.stop()


def test_the_trainer_reads_its_spec_from_the_handoff_and_its_reports_are_accepted(
    ray_cluster: str, tmp_path: Path, served: tuple[httpx.Client, Runtime, FakeBackend]
) -> None:
    http, runtime, backend = served
    data = write_classes(tmp_path / "cls", rows=64)
    spec = {
        "name": "handoff-run",
        "trainer": "mlp",
        "num_workers": 1,
        "dataset": {"uri": data.as_uri()},
        "max_steps": 1,
        "batch_size": 8,
        "checkpoint": {"every_steps": 1},
        "config": {"task": "classification", "num_classes": 3},
    }
    response = http.post("/jobs", json=spec)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    runtime.scheduler.tick()
    submission_id = backend.submission_of(job_id)
    env = backend.environments[submission_id]
    assert "dataset" not in env[LAUNCH_ENV_VAR] and backend.tokens[submission_id] not in env[LAUNCH_ENV_VAR]
    backend.statuses[submission_id] = RayJobStatus.RUNNING
    runtime.scheduler.tick()

    process = subprocess.run(
        [sys.executable, "-m", "trainers.launch"],
        env={**os.environ, **env, "RAY_ADDRESS": ray_cluster},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    assert "refused a telemetry batch" not in process.stderr

    job = http.get(f"/jobs/{job_id}").json()
    assert job["latest_checkpoint_step"] == 1
    assert job["latest_checkpoint"].startswith(
        (Path(runtime.settings.resolved_storage_uri) / f"job-{job_id}").as_uri() + "/"
    )
    points = http.get(f"/jobs/{job_id}/metrics").json()
    assert points["count"] >= 1
    assert {(point["rank"], point["attempt"]) for point in points["data"]} == {(0, 1)}
    events = [event["reason"] for event in http.get(f"/jobs/{job_id}/events").json()["data"]]
    assert any("[group_started]" in reason for reason in events), events
