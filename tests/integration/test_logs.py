"""GET /jobs/{id}/logs over real HTTP, on SQLite and PostgreSQL, with a fake cluster whose Ray jobs
have logs (tests/e2e/test_training.py reads a real Ray job's log through the same route)."""

from __future__ import annotations

import threading
import time
from typing import Any

from service.cluster import RayJobStatus
from tests.integration.conftest import Service

# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "logs-test",
    "num_workers": 2,
}


def start(service: Service, spec: dict[str, Any]) -> tuple[int, str]:
    """A job admitted and running on the fake cluster: its id and its Ray submission id."""
    job = service.submit(spec)
    service.tick()
    submission_id = service.job(job["id"])["ray_submission_id"]
    service.backend.statuses[submission_id] = RayJobStatus.RUNNING
    service.tick()
    return job["id"], submission_id


def test_the_log_of_the_latest_attempt_and_its_tail(service: Service, spec: dict[str, Any]) -> None:
    job_id, submission_id = start(service, spec)
    service.backend.logs[submission_id] = "driver up\n(RayTrainWorker pid=7) rank 0 step 1\nlast line\n"

    response = service.http.get(f"/jobs/{job_id}/logs")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    assert response.headers["x-apiary-attempt"] == "1"
    assert response.text == service.backend.logs[submission_id]
    tail = service.http.get(f"/jobs/{job_id}/logs", params={"tail": 2}).text
    assert tail == "(RayTrainWorker pid=7) rank 0 step 1\nlast line\n"
    assert service.http.get(f"/jobs/{job_id}/logs", params={"tail": 0}).text == ""


def test_unknown_jobs_jobs_that_never_started_and_bad_parameters_are_refused(
    service: Service, spec: dict[str, Any]
) -> None:
    missing = service.http.get("/jobs/999/logs")
    assert (missing.status_code, missing.json()["message"]) == (404, "job 999 does not exist")

    queued = service.submit(spec)
    never = service.http.get(f"/jobs/{queued['id']}/logs")
    assert never.status_code == 409
    assert (
        never.json()["message"] == f"job {queued['id']} has not started yet (it is queued): there are no logs"
    )

    bad = service.http.get(f"/jobs/{queued['id']}/logs", params={"tail": -1})
    assert bad.status_code == 422 and bad.json()["message"].startswith("tail:")


def test_each_attempt_keeps_its_log_and_a_forgotten_one_is_a_404(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id, first = start(service, spec)
    service.backend.logs[first] = "attempt one\n"
    assert service.http.post(f"/jobs/{job_id}/preempt").json()["state"] == "preempting"
    service.backend.statuses[first] = RayJobStatus.SUCCEEDED  # it checkpointed and stopped
    service.tick()  # requeued in its place, and admitted again at once (the cluster is free)
    second = service.job(job_id)["ray_submission_id"]
    assert second != first and service.job(job_id)["attempt"] == 2
    service.backend.logs[second] = "attempt two\n"
    latest = service.http.get(f"/jobs/{job_id}/logs")
    assert (latest.text, latest.headers["x-apiary-attempt"]) == ("attempt two\n", "2")
    assert service.http.get(f"/jobs/{job_id}/logs", params={"attempt": 1}).text == "attempt one\n"

    beyond = service.http.get(f"/jobs/{job_id}/logs", params={"attempt": 3})
    assert beyond.status_code == 404
    assert beyond.json()["message"] == f"job {job_id} has attempts 1 to 2: there is no attempt 3"

    del service.backend.statuses[first]  # a restarted Ray cluster forgets its jobs
    forgotten = service.http.get(f"/jobs/{job_id}/logs", params={"attempt": 1})
    assert forgotten.status_code == 404 and "Ray has no logs of attempt 1" in forgotten.json()["message"]


def test_follow_streams_new_lines_until_the_ray_job_ends(service: Service, spec: dict[str, Any]) -> None:
    job_id, submission_id = start(service, spec)
    logs = service.backend.logs
    logs[submission_id] = "old 1\nold 2\n"

    def train() -> None:
        for step in range(1, 4):
            time.sleep(0.4)
            logs[submission_id] += f"step {step}\n"
        service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED

    writer = threading.Thread(target=train)
    chunks: list[str] = []
    started = time.monotonic()
    with service.http.stream(
        "GET", f"/jobs/{job_id}/logs", params={"follow": "true", "tail": 1}, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        writer.start()
        chunks.extend(response.iter_text())
    writer.join()
    assert "".join(chunks) == "old 2\nstep 1\nstep 2\nstep 3\n"
    assert len(chunks) >= 2  # it arrived as it was written, not at the end in one piece
    assert time.monotonic() - started < 10


def test_terminal_escapes_are_stripped_unless_raw(service: Service, spec: dict[str, Any]) -> None:
    job_id, submission_id = start(service, spec)
    service.backend.logs[submission_id] = "\x1b[36m(RayTrainWorker pid=7)\x1b[0m step 1\n"

    assert service.http.get(f"/jobs/{job_id}/logs").text == "(RayTrainWorker pid=7) step 1\n"
    raw = service.http.get(f"/jobs/{job_id}/logs", params={"raw": "true"}).text
    assert raw == service.backend.logs[submission_id]
    service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
    followed = service.http.get(f"/jobs/{job_id}/logs", params={"follow": "true"}).text
    assert followed == "(RayTrainWorker pid=7) step 1\n"
