"""Recovery in the control plane, over real HTTP and a real database (SQLite and PostgreSQL), with a fake
cluster: lost drivers and Ray jobs are resubmitted from their checkpoint within the failure budget, the
job's own failures are not, worker-group restarts are counted from the trainers' telemetry, a stuck
submission is requeued, and a submission whose answer was lost is checked with Ray first."""

from __future__ import annotations

import time
from typing import Any

from service.cluster import RayJobStatus
from service.contract.protocol import error_line
from service.store import repository
from tests.integration.conftest import Service
from tests.integration.test_scheduler import run_to_running

# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "job",
    "max_steps": 100,
    "max_failures": 2,
}


def post(service: Service, job_id: int, batch: dict[str, Any]) -> dict[str, Any]:
    response = service.report(job_id, batch)
    assert response.status_code == 202, response.text
    return dict(response.json())


def points(steps: range, *, loss: float, ranks: tuple[int, ...] = (0, 1)) -> list[dict[str, Any]]:
    return [
        {"step": step, "rank": rank, "time": time.time(), "values": {"loss": loss}}
        for step in steps
        for rank in ranks
    ]


def reasons(service: Service, job_id: int) -> list[str]:
    return [event["reason"] for event in service.http.get(f"/jobs/{job_id}/events").json()["data"]]


def test_a_dead_driver_is_recovered_from_the_checkpoint_until_the_budget_is_spent(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    post(
        service,
        job_id,
        {
            "attempt": 1,
            "points": [],
            "checkpoint": {"step": 40, "uri": service.checkpoint_uri(job_id, "c40")},
        },
    )
    for failure in (1, 2):
        submission = service.job(job_id)["ray_submission_id"]
        # A SIGKILLed driver: Ray says FAILED, and the log has no apiary-error line.
        service.backend.statuses[submission] = RayJobStatus.FAILED
        service.backend.logs[submission] = "step 57 ...\n"
        service.tick()
        job = service.job(job_id)
        assert (job["state"], job["attempt"], job["failures"]) == ("recovering", 1 + failure, failure)
        launch = service.backend.submitted[-1][1]
        assert launch.attempt == 1 + failure and launch.failures_left == 2 - failure
        # A rank of the given-up attempt that still posts is told to exit; the new attempt's are not.
        given_up = service.report(job_id, {"attempt": failure, "points": []})
        assert (given_up.status_code, given_up.json()["error"]) == (403, "AttemptSuperseded")
        assert post(service, job_id, {"attempt": failure + 1, "points": []})["superseded"] is False
        assert any(
            f"its newest complete checkpoint (step 40 when last reported) (failure {failure} of at most 2)"
            in r
            for r in reasons(service, job_id)
        )
        service.backend.statuses[launch.submission_id or ""] = RayJobStatus.RUNNING
        service.tick()
        assert service.job(job_id)["state"] == "running"
    submission = service.job(job_id)["ray_submission_id"]
    service.backend.statuses[submission] = RayJobStatus.FAILED
    service.tick()
    job = service.job(job_id)
    assert job["state"] == "failed" and "failure budget is spent (max_failures 2" in job["message"]
    assert len(service.backend.submitted) == 3


def test_a_job_that_fails_by_its_own_code_is_not_recovered(service: Service, spec: dict[str, Any]) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    submission = service.job(job_id)["ray_submission_id"]
    service.backend.statuses[submission] = RayJobStatus.FAILED
    service.backend.logs[submission] = error_line("training failed on rank 0: KeyError: 'x'") + "\n"
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["failures"], job["message"]) == (
        "failed",
        0,
        "training failed on rank 0: KeyError: 'x'",
    )
    assert len(service.backend.submitted) == 1


def test_a_running_job_that_ray_forgot_is_resubmitted_and_a_retryable_error_line_too(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    del service.backend.statuses[service.job(job_id)["ray_submission_id"]]  # a restarted cluster
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["attempt"]) == ("recovering", 2)
    assert any(
        "Ray has no record of the running job" in r and "checkpoint (none reported yet)" in r
        for r in reasons(service, job_id)
    )
    submission = job["ray_submission_id"]
    service.backend.statuses[submission] = RayJobStatus.FAILED
    service.backend.logs[submission] = error_line("cannot reach storage", retryable=True)
    service.tick()
    assert (service.job(job_id)["state"], service.job(job_id)["attempt"]) == ("recovering", 3)


def test_an_attempt_that_never_starts_is_requeued_after_the_start_timeout(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    service.tick()
    submission = service.job(job_id)["ray_submission_id"]
    service.tick(time.time() + 60)  # pending, within the timeout (300 s)
    assert service.job(job_id)["state"] == "admitted" and service.backend.stopped == []
    service.runtime.scheduler.schedule = lambda now: None  # type: ignore[method-assign,assignment,return-value]
    service.tick(time.time() + 301)
    job = service.job(job_id)
    assert job["state"] == "queued" and service.backend.stopped == [submission]
    assert any("Ray did not start attempt 1 within 300 s" in r for r in reasons(service, job_id))


def test_a_submission_whose_answer_was_lost_is_checked_with_ray_first(
    service: Service, spec: dict[str, Any]
) -> None:
    backend = service.backend
    real_submit = backend.submit

    def submit_then_lose_the_answer(**kwargs: Any) -> None:
        real_submit(**kwargs)
        raise ConnectionError("connection reset while reading the response")

    backend.submit = submit_then_lose_the_answer  # type: ignore[method-assign]
    job_id = service.submit(spec)["id"]
    service.tick()
    job = service.job(job_id)
    assert job["state"] == "admitted"  # Ray has it: tracked, not failed
    backend.statuses[job["ray_submission_id"]] = RayJobStatus.RUNNING
    service.tick()
    assert service.job(job_id)["state"] == "running"

    def refuse(**kwargs: Any) -> None:
        raise RuntimeError("Request failed with status code 400: bad runtime_env.")

    backend.submit = refuse  # type: ignore[method-assign]
    refused = service.submit({**spec, "name": "refused"})["id"]
    service.tick()
    job = service.job(refused)
    assert job["state"] == "failed" and "Ray refused the submission" in job["message"]


def test_a_worker_group_restart_is_counted_and_both_curves_are_kept(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    started = {
        "kind": "group_started",
        "rank": 0,
        "time": time.time(),
        "message": "worker group of 2 started",
    }
    post(
        service,
        job_id,
        {
            "attempt": 1,
            "segment": 1000,
            "events": [{**started, "step": 0}],
            "points": points(range(1, 8), loss=1.0),
        },
    )
    post(
        service,
        job_id,
        {"attempt": 1, "points": [], "checkpoint": {"step": 5, "uri": service.checkpoint_uri(job_id, "c5")}},
    )
    # Ray Train restarted the group from step 5: steps 6 and 7 are trained again, in a new segment.
    post(
        service,
        job_id,
        {
            "attempt": 1,
            "segment": 2000,
            "events": [{**started, "step": 5}],
            "points": points(range(6, 9), loss=0.5),
        },
    )
    # A late post of the old group changes nothing but its own points.
    post(
        service, job_id, {"attempt": 1, "segment": 1000, "points": points(range(8, 9), loss=9.0, ranks=(1,))}
    )
    job = service.job(job_id)
    assert (job["restarts"], job["failures"], job["latest_step"]) == (1, 1, 8)
    assert any("resumed from step 5, 2 step(s) to train again" in r for r in reasons(service, job_id))
    counted = service.http.get(f"/jobs/{job_id}/metrics", params={"rank": 0}).json()["data"]
    assert [(p["step"], p["values"]["loss"]) for p in counted] == [(s, 1.0) for s in range(1, 6)] + [
        (s, 0.5) for s in range(6, 9)
    ]
    every = service.http.get(f"/jobs/{job_id}/metrics", params={"rank": 0, "segments": "all"}).json()["data"]
    assert [(p["step"], p["segment"]) for p in every if p["step"] in (6, 7)] == [
        (6, 1000),
        (6, 2000),
        (7, 1000),
        (7, 2000),
    ]
    assert service.http.get(f"/jobs/{job_id}/metrics", params={"segments": "some"}).status_code == 422


def status(rank: int, *, step: int, step_at: float | None, phase: str) -> dict[str, Any]:
    return {
        "rank": rank,
        "step": step,
        "step_at": step_at,
        "phase": phase,
        "phase_since": step_at or time.time(),
        "node": f"10.0.0.{rank + 1} (node{rank})",
        "pid": 100 + rank,
    }


def test_a_job_whose_ranks_make_no_step_is_restarted_from_its_checkpoint_naming_the_rank(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    post(
        service,
        job_id,
        {
            "attempt": 1,
            "points": [],
            "checkpoint": {"step": 40, "uri": service.checkpoint_uri(job_id, "c40")},
        },
    )
    long_ago = time.time() - 120
    post(service, job_id, {"attempt": 1, "status": status(0, step=57, step_at=long_ago, phase="sync")})
    post(service, job_id, {"attempt": 1, "status": status(1, step=57, step_at=long_ago, phase="data")})
    old = service.job(job_id)["ray_submission_id"]
    assert service.job(job_id)["ranks"]["1"]["phase"] == "data"
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["attempt"], job["failures"]) == ("recovering", 2, 1)
    assert old in service.backend.stopped
    hung = next(r for r in reasons(service, job_id) if "no rank completed a step" in r)
    assert "rank 1 on node 10.0.0.2 (node1) has been in data for" in hung, hung
    assert "resuming from its newest complete checkpoint (step 40 when last reported)" in hung


def test_a_worker_group_that_ray_train_restarts_is_not_a_hang_until_the_start_timeout(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    long_ago = time.time() - 120  # past the hang timeout (60 s)
    old_group = {"attempt": 1, "segment": 1000}
    post(service, job_id, {**old_group, "status": status(0, step=57, step_at=long_ago, phase="sync")})
    # Ray Train's failure policy (trainers.launch) says it restarts the group; a rank of the failed
    # group posts once more while it is torn down.
    failed = {"kind": "worker_failed", "step": 0, "rank": 0, "time": time.time(), "message": "group failed"}
    post(service, job_id, {"attempt": 1, "events": [failed]})
    post(service, job_id, {**old_group, "status": status(0, step=57, step_at=long_ago, phase="sync")})
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["attempt"], job["ranks"]) == ("running", 1, None)
    # The new group reports: the restart is over, and the hang timeout runs again on its steps.
    started = {"kind": "group_started", "step": 40, "rank": 0, "time": time.time(), "message": "started"}
    post(
        service,
        job_id,
        {
            "attempt": 1,
            "segment": 2000,
            "events": [started],
            "points": points(range(41, 43), loss=1.0, ranks=(0,)),
            "status": status(0, step=42, step_at=long_ago, phase="sync"),
        },
    )
    assert service.job(job_id)["restarts"] == 1
    service.tick()
    assert service.job(job_id)["state"] == "recovering"  # its own steps are 120 s old

    # A group that failed before it ever reported: the first group that reports ends the restart.
    early = service.submit({**spec, "name": "early"})["id"]
    run_to_running(service, [early])
    post(service, early, {"attempt": 1, "events": [failed]})
    post(
        service,
        early,
        {
            "attempt": 1,
            "segment": 3000,
            "events": [{**started, "step": 0}],
            "points": points(range(1, 3), loss=1.0, ranks=(0,)),
            "status": status(0, step=2, step_at=long_ago, phase="sync"),
        },
    )
    service.tick()
    assert service.job(early)["state"] == "recovering"  # the hang timeout runs on its steps

    # A restart that never reports is given up after the start timeout (300 s).
    second = service.submit({**spec, "name": "second"})["id"]
    run_to_running(service, [second])
    post(service, second, {**old_group, "status": status(0, step=9, step_at=long_ago, phase="sync")})
    post(service, second, {"attempt": 1, "events": [failed]})
    service.tick(time.time() + 290)
    assert service.job(second)["state"] == "running"
    service.tick(time.time() + 310)
    job = service.job(second)
    assert (job["state"], job["attempt"]) == ("recovering", 2)
    assert any("the worker group that Ray Train restarted" in r for r in reasons(service, second))


def test_a_rank_that_stops_reporting_is_blamed_for_the_hang(service: Service, spec: dict[str, Any]) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    recent = time.time() - 5
    post(service, job_id, {"attempt": 1, "status": status(0, step=9, step_at=recent, phase="sync")})
    post(service, job_id, {"attempt": 1, "status": status(1, step=9, step_at=recent, phase="compute")})
    service.tick()
    assert service.job(job_id)["state"] == "running"  # within the hang timeout (60 s)
    # 70 s later rank 0 still reports (waiting in the step's collective); rank 1 went silent at once.
    # Counted from when the service saw rank 1 (not from now: a loaded machine takes seconds to get here).
    with service.runtime.db.session() as session:  # type: ignore[union-attr]
        job = repository.get_job(session, job_id, for_update=True)
        later = job.ranks["1"]["seen"] + 70
        job.ranks = {**job.ranks, "0": {**job.ranks["0"], "seen": later}}
    service.tick(later)
    hung = next(r for r in reasons(service, job_id) if "no rank completed a step" in r)
    assert "rank 1 on node 10.0.0.2 (node1) stopped reporting 70 s ago (after step 9, in compute)" in hung, (
        hung
    )


def test_a_rank_slower_than_the_others_is_recorded_as_a_straggler(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    for post_number in range(4):
        for rank, forward_s in ((0, 0.010), (1, 0.030)):
            steps = range(post_number * 10 + 1, post_number * 10 + 11)
            batch = [
                {
                    "step": s,
                    "rank": rank,
                    "time": time.time(),
                    "values": {"loss": 1.0, "data_wait_s": 0.001, "forward_s": forward_s},
                }
                for s in steps
            ]
            post(
                service,
                job_id,
                {
                    "attempt": 1,
                    "points": batch,
                    "status": status(rank, step=steps[-1], step_at=time.time(), phase="data"),
                },
            )
    ranks = service.job(job_id)["ranks"]
    assert ranks["1"]["straggler"] is True and not ranks["0"].get("straggler")
    said = [r for r in reasons(service, job_id) if "straggler" in r]
    expected = (
        "rank 1 on node 10.0.0.2 (node1) is a straggler: its own work (data wait + forward) takes "
        "31.0 ms a step against 11.0 ms for the other ranks (2.8x) at step 30"
    )
    assert said == [expected], said


def test_a_rank_that_reports_a_long_checkpoint_write_is_not_a_hang(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    long_ago = time.time() - 120  # past the hang timeout (60 s), within 10 of them
    post(service, job_id, {"attempt": 1, "status": status(0, step=50, step_at=long_ago, phase="checkpoint")})
    post(service, job_id, {"attempt": 1, "status": status(1, step=50, step_at=long_ago, phase="sync")})
    service.tick()
    assert service.job(job_id)["state"] == "running"
    service.tick(time.time() + 600)  # 720 s without a step, the last heartbeat 600 s old: hung
    assert service.job(job_id)["state"] == "recovering"
