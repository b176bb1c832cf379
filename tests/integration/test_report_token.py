"""Job-scoped report tokens (service.contract.handoff): the telemetry route takes a job's reports only from
its
current attempt, with that attempt's token, and checkpoints only under the job's own storage prefix.
A forged report is refused and changes nothing."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy import select

from service.cluster import RayJobStatus
from service.contract.handoff import token_hash
from service.contract.protocol import LAUNCH_ENV_VAR
from service.jobs import FINAL_REPORT_GRACE_S
from service.store.models import Job
from tests.integration.conftest import Service

# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "token-test",
    "max_failures": 2,
}


def running_job(service: Service, spec: dict[str, Any]) -> tuple[int, str, str]:
    """A job whose attempt 1 runs: its id, its submission and the attempt's report token."""
    job_id = int(service.submit(spec)["id"])
    service.tick()
    submission_id = service.backend.submission_of(job_id)
    service.backend.statuses[submission_id] = RayJobStatus.RUNNING
    service.tick()
    return job_id, submission_id, service.backend.tokens[submission_id]


def batch(*, attempt: int = 1, step: int = 10, checkpoint: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "attempt": attempt,
        "points": [{"step": step, "rank": 0, "time": 1.0, "values": {"loss": 0.5}}],
    }
    if checkpoint is not None:
        body["checkpoint"] = {"step": step, "uri": checkpoint}
    return body


def post(service: Service, job_id: int, body: dict[str, Any], token: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    return service.http.post(f"/internal/jobs/{job_id}/telemetry", json=body, headers=headers)


def what_reports_change(service: Service, job_id: int) -> tuple[Any, ...]:
    job = service.job(job_id)
    metrics = service.http.get(f"/jobs/{job_id}/metrics", params={"segments": "all"}).json()
    events = service.http.get(f"/jobs/{job_id}/events").json()
    checkpoints = service.http.get(f"/jobs/{job_id}/checkpoints").json()
    return (
        job["latest_checkpoint"],
        job["latest_checkpoint_step"],
        job["latest_step"],
        metrics["count"],
        len(events["data"]),
        checkpoints,
    )


def test_forged_reports_are_refused_and_change_nothing(service: Service, spec: dict[str, Any]) -> None:
    job_id, _, token = running_job(service, spec)
    own = service.checkpoint_uri(job_id, "checkpoint_00000010")
    assert post(service, job_id, batch(checkpoint=own), token).status_code == 202
    before = what_reports_change(service, job_id)
    assert before[:4] == (own, 10, 10, 1)

    stranger = service.checkpoint_uri(job_id, "checkpoint_00000099").replace(f"job-{job_id}/", "job-999/")
    refused = {
        "no token": post(service, job_id, batch(step=99, checkpoint=stranger), None),
        "a wrong token": post(service, job_id, batch(step=99, checkpoint=stranger), "guessed"),
        "not a bearer": service.http.post(
            f"/internal/jobs/{job_id}/telemetry",
            json=batch(step=99),
            headers={"authorization": f"Basic {token}"},
        ),
        "another attempt's number": post(service, job_id, batch(attempt=2, step=99), token),
    }
    for why, response in refused.items():
        assert response.status_code == 401, (why, response.text)
        assert response.json()["error"] == "ReportRefused"

    # The right token cannot point the job's checkpoint anywhere but under the job's own prefix.
    for foreign in (
        stranger,
        "file:///etc/passwd",
        service.checkpoint_uri(job_id, "../job-999/checkpoint_00000099"),
        service.checkpoint_uri(job_id, "_apiary/attempt-1"),
    ):
        response = post(service, job_id, batch(step=99, checkpoint=foreign), token)
        assert response.status_code == 422, (foreign, response.text)
        assert response.json()["detail"][0]["loc"] == ["body", "checkpoint", "uri"]
    # Another job's token does not work here either.
    _, _, other_token = running_job(service, spec)
    assert post(service, job_id, batch(step=99), other_token).status_code == 401

    assert what_reports_change(service, job_id) == before


def test_an_old_attempt_is_told_it_was_superseded_and_keeps_only_its_points(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id, first, old_token = running_job(service, spec)
    # The driver dies outside the job's code: the job is resubmitted as attempt 2, with a new token.
    service.backend.statuses[first] = RayJobStatus.MISSING
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["attempt"]) == ("recovering", 2)
    second = job["ray_submission_id"]
    new_token = service.backend.tokens[second]
    assert new_token != old_token
    before = what_reports_change(service, job_id)

    # Attempt 2 with attempt 1's token, or attempt 1's number with attempt 2's token or none: refused.
    assert post(service, job_id, batch(attempt=2), old_token).status_code == 401
    refused = post(service, job_id, batch(attempt=1), new_token)
    assert refused.status_code == 403 and refused.json()["error"] == "AttemptSuperseded"
    assert post(service, job_id, batch(attempt=1), None).status_code == 401  # before its body is read
    assert what_reports_change(service, job_id) == before

    # With its own token, a rank of the given-up attempt keeps the points of the steps it trained (the
    # next attempt may resume from a checkpoint it wrote after it was given up, and never train them
    # again), and nothing else: not its checkpoint. It is told to exit.
    late = post(
        service, job_id, batch(attempt=1, step=11, checkpoint=service.checkpoint_uri(job_id, "x")), old_token
    )
    assert late.status_code == 202 and late.json()["superseded"] is True and late.json()["stored"] == 1
    latest_checkpoint, latest_checkpoint_step, latest_step, count, events, checkpoints = before
    assert what_reports_change(service, job_id) == (
        latest_checkpoint,
        latest_checkpoint_step,
        latest_step,
        count + 1,
        events,
        checkpoints,
    )

    assert post(service, job_id, batch(attempt=2, step=12), new_token).status_code == 202
    assert service.job(job_id)["latest_step"] == 12


def test_the_token_is_neither_in_the_environment_nor_in_the_database(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id, submission_id, token = running_job(service, spec)
    env = service.backend.environments[submission_id]
    assert token not in json.dumps(env)
    # Only the pointer travels in the environment: the spec is read from storage.
    assert "dataset" not in env[LAUNCH_ENV_VAR]
    with service.runtime.db.session() as session:
        stored = session.scalars(select(Job.report_token_hash).where(Job.id == job_id)).one()
    assert stored == token_hash(token) and token not in (stored or "")


def test_a_finished_jobs_report_token_is_dead(service: Service, spec: dict[str, Any]) -> None:
    job_id, submission_id, token = running_job(service, spec)
    own = service.checkpoint_uri(job_id, "checkpoint_00000010")
    assert post(service, job_id, batch(checkpoint=own), token).status_code == 202
    service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
    service.tick()
    assert service.job(job_id)["state"] == "succeeded"
    before = what_reports_change(service, job_id)
    late = {
        **batch(step=20, checkpoint=service.checkpoint_uri(job_id, "checkpoint_00000020")),
        "events": [{"rank": 0, "step": 20, "time": 1.0, "kind": "late", "message": "after the end"}],
    }

    # Within FINAL_REPORT_GRACE_S of the end, a post of the final attempt with its token is taken as a
    # retry of its final report (the first copy arrived before the job ended): answered 202 and told
    # to exit, and nothing of it is stored.
    retry = post(service, job_id, late, token)
    assert retry.status_code == 202, retry.text
    assert retry.json() == {"stored": 0, "stop": False, "superseded": True}
    assert what_reports_change(service, job_id) == before

    # After the window, and at any time for anything else (a wrong token, another attempt's number),
    # it is refused, before its body is read.
    assert post(service, job_id, batch(attempt=2), token).status_code == 401
    assert post(service, job_id, late, "apiary_wrong").status_code == 401
    with service.runtime.db.session() as session:
        row = session.get(Job, job_id)
        assert row is not None and row.finished_at is not None
        row.finished_at -= timedelta(seconds=FINAL_REPORT_GRACE_S + 1)
    refused = post(service, job_id, late, token)
    assert refused.status_code == 403 and refused.json()["error"] == "AttemptSuperseded", refused.text
    assert "ended" in refused.json()["message"]
    assert what_reports_change(service, job_id) == before


def test_a_given_up_attempt_writes_nothing_once_the_job_ended(service: Service, spec: dict[str, Any]) -> None:
    job_id, first, old_token = running_job(service, spec)
    service.backend.statuses[first] = RayJobStatus.MISSING
    service.tick()  # attempt 1 given up: attempt 2 runs
    assert service.http.post(f"/jobs/{job_id}/cancel").status_code == 200
    before = what_reports_change(service, job_id)
    refused = post(service, job_id, batch(attempt=1, step=11), old_token)
    assert refused.status_code == 403 and refused.json()["error"] == "AttemptSuperseded", refused.text
    assert what_reports_change(service, job_id) == before
