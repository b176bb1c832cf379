"""The scheduler loop around the policy, over real HTTP and a real database, with a fake cluster:
preemption from decision to requeue, max runtime, the stop grace, manual preemption, GET /queues,
and one scheduling replica at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

import pytest

from service.cluster import RayJobStatus
from service.contract.protocol import code_modules
from service.scheduling.scheduler import WAKE_GAP_S, Scheduler
from service.store import repository
from tests.integration.conftest import Service
from tests.support.wait import wait_until

# Two equal shares of one 8-CPU node; nothing protected by a minimum runtime.
EVEN = {
    "research": {"share": 0.5, "min_runtime_s": 0, "default_max_runtime_s": None, "max_runtime_s": None},
    "full-scale": {"share": 0.5, "min_runtime_s": 0},
    "preempt_grace_s": 60,
}


# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "job",
    "max_steps": 100,  # one worker + 1 data CPU: 2 CPU a job
}


def run_to_running(service: Service, job_ids: list[int]) -> None:
    service.tick()
    for job_id in job_ids:
        service.backend.statuses[service.backend.submission_of(job_id)] = RayJobStatus.RUNNING
    service.tick()
    assert all(service.job(job_id)["state"] == "running" for job_id in job_ids)


def test_full_scale_takes_its_share_back_and_the_preempted_job_resumes_in_its_place(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(queues=EVEN)
    # Research borrows: three 2-CPU jobs on 8 CPU, its share is 4.
    research = [service.submit({**spec, "name": f"r{i}"})["id"] for i in range(3)]
    run_to_running(service, research)
    big = service.submit({**spec, "name": "fs", "queue": "full-scale", "num_workers": 3})  # 4 CPU, its share
    service.tick()
    states = {job_id: service.job(job_id)["state"] for job_id in research}
    victims = [job_id for job_id, state in states.items() if state == "preempting"]
    assert len(victims) == 1
    victim = service.job(victims[0])
    assert victim["stop_requested"] == "preempted"
    assert service.job(big["id"])["state"] == "queued"
    assert "preempting job(s)" in service.job(big["id"])["waiting_reason"]

    # The victim's trainers hear it in their next telemetry reply...
    reply = service.report(
        victim["id"],
        {
            "attempt": 1,
            "points": [],
            "checkpoint": {"step": 40, "uri": service.checkpoint_uri(victim["id"], "checkpoint_00000040")},
        },
    ).json()
    assert reply["stop"] is True
    # ... checkpoint and exit; Ray reports the job done.
    service.backend.statuses[victim["ray_submission_id"]] = RayJobStatus.SUCCEEDED
    service.tick()  # the victim is back in the queue; the full-scale job starts on its CPUs
    requeued = service.job(victim["id"])
    assert (requeued["state"], requeued["preemptions"], requeued["stop_requested"]) == ("queued", 1, None)
    assert requeued["created_at"] == victim["created_at"]  # it keeps its place
    events = service.http.get(f"/jobs/{victim['id']}/events").json()["data"]
    assert "resumes from its checkpoint at step 40" in events[-1]["reason"]
    assert service.job(big["id"])["state"] == "admitted"


def test_a_job_that_runs_out_of_max_runtime_is_stopped_with_a_checkpoint_and_fails(
    service: Service, spec: dict[str, Any]
) -> None:
    job = service.submit({**spec, "max_runtime_s": 30})
    run_to_running(service, [job["id"]])
    service.tick(time.time() + 31)
    job = service.job(job["id"])
    assert (job["state"], job["stop_requested"]) == ("preempting", "max_runtime")
    service.backend.statuses[job["ray_submission_id"]] = RayJobStatus.SUCCEEDED
    service.tick()
    job = service.job(job["id"])
    assert job["state"] == "failed" and "ran out of max_runtime_s (30 s)" in job["message"]


def test_a_research_job_gets_its_queues_default_runtime(service: Service, spec: dict[str, Any]) -> None:
    assert service.submit(spec)["spec"]["max_runtime_s"] == 3600
    assert service.submit({**spec, "queue": "full-scale"})["spec"]["max_runtime_s"] is None


def test_a_jobs_ray_train_controller_polls_its_workers_at_the_configured_interval(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(train_poll_interval_s=0.5)
    job_id = service.submit(spec)["id"]
    service.tick()
    environment = service.backend.environments[service.backend.submission_of(job_id)]
    assert environment["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5"


def test_a_job_that_does_not_stop_within_the_grace_is_stopped_and_requeued(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(queues=EVEN)
    job = service.submit(spec)
    run_to_running(service, [job["id"]])
    assert service.http.post(f"/jobs/{job['id']}/preempt").json()["state"] == "preempting"
    submission = service.job(job["id"])["ray_submission_id"]
    service.tick()
    assert service.backend.stopped == []  # within the grace
    service.tick(time.time() + 61)
    assert service.backend.stopped == [submission]  # the fake's stop makes Ray say STOPPED
    service.tick()
    job = service.job(job["id"])
    assert job["state"] in ("queued", "admitted") and job["preemptions"] == 1
    events = service.http.get(f"/jobs/{job['id']}/events").json()["data"]
    reasons = [event["reason"] for event in events]
    assert "preempted by ada" in reasons
    assert any("stopped after 60 s without checkpointing: no checkpoint" in reason for reason in reasons)


def test_only_a_running_job_can_be_preempted(service: Service, spec: dict[str, Any]) -> None:
    job = service.submit(spec)
    response = service.http.post(f"/jobs/{job['id']}/preempt")
    assert response.status_code == 409 and "only a running job can be preempted" in response.json()["message"]
    assert service.http.post("/jobs/999/preempt").status_code == 404


def test_queues_show_configuration_use_borrowing_and_the_ordered_line(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(queues=EVEN)
    running = [service.submit({**spec, "name": f"r{i}"})["id"] for i in range(3)]  # 6 CPU: 2 borrowed
    run_to_running(service, running)
    waiting = [service.submit({**spec, "name": f"w{i}", "num_workers": 3})["id"] for i in range(2)]
    service.tick()
    queues = {queue["name"]: queue for queue in service.http.get("/queues").json()["data"]}
    research = queues["research"]
    assert research["config"]["share"] == 0.5
    assert research["share"] == {"CPU": 4.0} and research["in_use"] == {"CPU": 6.0}
    assert research["borrowed"] == {"CPU": 2.0}
    assert research["counts"] == {"running": 3, "queued": 2}
    assert [job["id"] for job in research["jobs"]] == waiting
    assert [job["position"] for job in research["jobs"]] == [1, 2]
    assert research["jobs"][0]["reason"].startswith("needs 3 worker(s) x 1 CPU + 1 CPU; free now 2 CPU")
    assert queues["full-scale"]["counts"] == {} and queues["full-scale"]["jobs"] == []


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the loop's timing: any database
def test_a_burst_of_wakes_is_served_by_spaced_passes_and_a_lone_wake_at_once(service: Service) -> None:
    settings = service.runtime.settings.model_copy(update={"scheduler_interval_s": 5.0})
    scheduler = Scheduler(db=service.runtime.scheduler.db, backend=service.backend, settings=settings)
    passes: list[tuple[float, float]] = []  # (start, end) of each pass
    tick = scheduler.tick

    def recorded(now: float | None = None) -> None:
        started = time.monotonic()
        tick(now)
        passes.append((started, time.monotonic()))

    scheduler.tick = recorded  # type: ignore[method-assign]
    scheduler.start()
    try:
        wait_until(lambda: len(passes) == 1, timeout_s=4, interval_s=0.01)
        first_start, first_end = passes[0]
        time.sleep(scheduler._wake_gap_s(first_end - first_start) + 0.1)  # quiet since the last pass
        woken = time.monotonic()
        scheduler.wake()  # after a quiet while: a pass at once, not after the 5 s interval
        wait_until(lambda: len(passes) == 2, timeout_s=4, interval_s=0.01)
        assert passes[1][0] - woken < 1.0
        burst_started = time.monotonic()
        for _ in range(20):  # a burst of submissions, each waking the loop
            scheduler.wake()
            time.sleep(0.02)
        last_wake = time.monotonic()
        wait_until(lambda: passes[-1][0] > last_wake, timeout_s=4, interval_s=0.01)  # the last wake is served
        during = [start for start, _ in passes[2:] if start >= burst_started]
        assert len(during) <= (last_wake - burst_started) / WAKE_GAP_S + 2, passes
        for (_, previous_end), (start, _) in pairwise(passes):
            assert start - previous_end >= WAKE_GAP_S - 0.01, passes
    finally:
        scheduler.stop()


def test_one_replica_schedules_at_a_time_and_another_takes_over_when_its_lease_runs_out(
    service: Service, spec: dict[str, Any]
) -> None:
    leader = service.runtime.scheduler
    other = Scheduler(db=leader.db, backend=service.backend, settings=leader.settings, holder="other")
    first = service.submit(spec)
    leader.tick()
    other.tick()
    assert leader.is_leader and not other.is_leader
    assert len(service.backend.submitted) == 1 and service.job(first["id"])["attempt"] == 1
    second = service.submit({**spec, "name": "second"})
    other.tick()  # not the leader: admits nothing
    assert service.job(second["id"])["state"] == "queued"
    # The leader stops renewing (it died): once its lease has run out, the other one schedules.
    other.tick(time.time() + leader.settings.scheduler_lease_s + 1)
    assert other.is_leader
    assert service.job(second["id"])["state"] == "admitted"
    assert [launch.job_id for _, launch in service.backend.submitted] == [first["id"], second["id"]]


def test_max_runtime_counts_from_the_current_attempt_not_the_first_start(
    service: Service, spec: dict[str, Any]
) -> None:
    job = service.submit({**spec, "max_runtime_s": 600})
    run_to_running(service, [job["id"]])
    with service.runtime.scheduler.db.session() as session:  # its first attempt started long ago
        repository.get_job(session, job["id"]).started_at = datetime.now(UTC) - timedelta(hours=2)
    service.tick()
    assert service.job(job["id"])["state"] == "running"
    service.tick(time.time() + 601)
    assert service.job(job["id"])["state"] == "preempting"


def test_a_submission_that_lands_after_another_replica_requeued_the_job_is_stopped(
    service: Service, spec: dict[str, Any]
) -> None:
    leader = service.runtime.scheduler
    other = Scheduler(db=leader.db, backend=service.backend, settings=leader.settings, holder="other")
    job = service.submit(spec)
    submit = service.backend.submit

    def stalled_submit(**kwargs: Any) -> None:
        # The leader stalls between admitting and submitting; its lease runs out, the other replica
        # takes over, finds no Ray job for the admission, requeues the job and submits attempt 2.
        service.backend.submit = submit
        other.tick(time.time() + leader.settings.scheduler_lease_s + 1)
        submit(**kwargs)  # then the stalled submission reaches Ray after all

    service.backend.submit = stalled_submit  # type: ignore[method-assign]
    leader.tick()
    (readmitted, _), (late, _) = service.backend.submitted  # attempt 2 reached Ray first
    assert service.backend.stopped == [late]  # the leader stopped its own late submission
    job = service.job(job["id"])
    assert (job["state"], job["attempt"], job["ray_submission_id"]) == ("admitted", 2, readmitted)


# Two nodes, each with one `slot`: a 2-worker gang that asks for a slot per worker spans both.
TWO_NODES = [{"CPU": 4.0, "slot": 1.0}, {"CPU": 4.0, "slot": 1.0}]


def test_a_running_gang_that_lost_a_node_is_requeued_and_resumes_when_a_node_joins(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(
        nodes=[dict(node) for node in TWO_NODES], shared_filesystem=True, capacity_loss_grace_s=20
    )
    job = service.submit({**spec, "num_workers": 2, "resources_per_worker": {"CPU": 1, "slot": 1}})
    run_to_running(service, [job["id"]])
    # The job ships Apiary's code with it: the nodes need no copy of the service.
    assert service.backend.py_modules == code_modules()
    first = service.job(job["id"])["ray_submission_id"]

    service.backend.nodes.pop()  # the second node dies
    service.tick()
    assert service.job(job["id"])["state"] == "running"  # within capacity_loss_grace_s
    assert service.backend.stopped == []
    service.tick(time.time() + 21)
    job = service.job(job["id"])
    assert (job["state"], job["stop_requested"]) == ("preempting", "lost_capacity")
    assert service.backend.stopped == [first]  # at once: its gang is broken, it cannot checkpoint
    service.tick()  # Ray says STOPPED: back to the queue, not counted as a preemption
    job = service.job(job["id"])
    assert (job["state"], job["preemptions"], job["stop_requested"]) == ("queued", 0, None)
    events = service.http.get(f"/jobs/{job['id']}/events").json()["data"]
    assert "capacity lost: its gang no longer fits the cluster's 1 node(s)" in events[-2]["reason"]
    assert events[-1]["reason"].startswith("capacity lost; requeued in its place, resumes from its")
    service.tick()
    assert service.job(job["id"])["state"] == "queued"  # capacity follows the nodes: it does not fit
    assert "slot" in service.job(job["id"])["waiting_reason"]

    service.backend.nodes.append(dict(TWO_NODES[1]))  # a node joins
    service.tick()
    job = service.job(job["id"])
    assert (job["state"], job["attempt"]) == ("admitted", 2)
    assert service.backend.submitted[-1][1].attempt == 2


def test_a_gang_that_still_fits_after_a_node_left_keeps_running(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(nodes=[dict(node) for node in TWO_NODES], shared_filesystem=True)
    job = service.submit(spec)  # 1 worker + 1 data CPU: fits either node
    run_to_running(service, [job["id"]])
    service.backend.nodes.pop()
    service.tick()
    service.tick(time.time() + 600)  # well past capacity_loss_grace_s
    assert service.job(job["id"])["state"] == "running"
    assert service.backend.stopped == []


def test_a_local_dataset_is_refused_on_a_cluster_of_more_than_one_node(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(nodes=[dict(node) for node in TWO_NODES])
    response = service.http.post("/jobs", json=spec)
    assert response.status_code == 422
    body = response.json()
    assert "is a local path and the cluster has 2 nodes" in body["message"]
    assert any(".".join(map(str, d["loc"][1:])) == "dataset.uri" for d in body["detail"]), body
    assert service.count() == 0


def test_local_checkpoint_storage_holds_every_job_once_a_second_node_joins(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(nodes=[{"CPU": 8.0}], queues=EVEN)
    job = service.submit(spec)  # one node: a local dataset and local storage are fine
    service.backend.nodes.append({"CPU": 8.0})
    service.tick()
    job = service.job(job["id"])
    assert job["state"] == "queued"
    assert "is a local path and the cluster has 2 nodes" in job["waiting_reason"]
    assert "APIARY_STORAGE_URI" in job["waiting_reason"]
    service.backend.nodes.pop()
    service.tick()
    assert service.job(job["id"])["state"] == "admitted"


def test_an_admitted_gang_that_lost_a_node_before_it_ran_goes_back_to_the_queue(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(nodes=[dict(node) for node in TWO_NODES], shared_filesystem=True)
    job = service.submit({**spec, "num_workers": 2, "placement": "strict_spread"})
    service.tick()
    submission = service.job(job["id"])["ray_submission_id"]
    assert service.job(job["id"])["state"] == "admitted"  # Ray has not started it yet
    service.backend.nodes.pop()
    service.tick()
    service.tick(time.time() + 31)  # past the default capacity_loss_grace_s
    job = service.job(job["id"])
    assert (job["state"], job["ray_submission_id"]) == ("queued", None)
    assert service.backend.stopped == [submission]
    reason = service.http.get(f"/jobs/{job['id']}/events").json()["data"][-1]["reason"]
    assert reason.startswith("capacity lost: its gang no longer fits") and "requeued in its place" in reason


def test_a_ray_function_stopped_at_a_report_without_a_checkpoint_counts_the_steps_it_lost(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    """A Ray Train function stops at its next report after the request, which may carry no checkpoint:
    requeued, with the steps after its latest checkpoint recorded as lost. It has no max_steps."""
    service = start_service(queues=EVEN)
    function = {
        key: value for key, value in spec.items() if key not in ("dataset", "max_steps", "batch_size")
    }
    job = service.submit({**function, "trainer": "tests.support.custom_trainer:train"})
    run_to_running(service, [job["id"]])
    points = [
        {"step": step, "rank": 0, "time": time.time(), "values": {"loss": 1.0 / step}} for step in (1, 2, 3)
    ]
    checkpoint = {"step": 2, "uri": service.checkpoint_uri(job["id"], "checkpoint_00000002")}
    assert service.report(job["id"], {"attempt": 1, "points": points, "checkpoint": checkpoint}).is_success
    assert service.http.post(f"/jobs/{job['id']}/preempt").json()["state"] == "preempting"
    service.backend.statuses[service.backend.submission_of(job["id"])] = RayJobStatus.SUCCEEDED
    service.tick()
    job = service.job(job["id"])
    assert job["state"] in ("queued", "admitted") and job["preemptions"] == 1
    reasons = [event["reason"] for event in service.http.get(f"/jobs/{job['id']}/events").json()["data"]]
    assert any(
        "requeued in its place, resumes from its checkpoint at step 2, 1 step(s) after it lost" in reason
        for reason in reasons
    ), reasons
