"""Node drains through the service (service.drains), on SQLite and PostgreSQL with a fake cluster:
`POST /admin/nodes/{id}/drain`, Ray's own drains, and what the scheduler does with the jobs there."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from service.cluster import RayJobStatus
from service.drains import STOP_MARGIN_S
from tests.integration.conftest import Service
from tests.support.fakes import fake_node_id

SPEC_FIELDS = {"name": "spread", "num_workers": 2, "placement": "strict_spread", "max_steps": 1000}
# Two nodes of one worker and the data CPU each: a strict_spread gang of two needs both.
NODES = [{"CPU": 2.0}, {"CPU": 2.0}]


def start(start_service: Callable[..., Service]) -> Service:
    return start_service(nodes=[dict(node) for node in NODES], shared_filesystem=True)


def run_on_both_nodes(service: Service, spec: dict[str, Any], *, step: int = 30) -> int:
    """A running job, one rank on each node, past `step` (0.1 s a step), with a checkpoint at step 20
    that took 0.5 s to write: it can checkpoint if it hears of a drain 1 + 2 x (0.1 + 0.5) + 5 = 7.2 s
    before the deadline."""
    job_id, _ = service.start(spec)
    now = time.time()
    for rank in (0, 1):
        points = [
            {
                "step": s,
                "rank": rank,
                "time": now - (step - s) * 0.1,
                "values": {"loss": 1.0, "step_time_s": 0.1},
            }
            for s in range(1, step + 1)
        ]
        body: dict[str, Any] = {
            "attempt": service.job(job_id)["attempt"],
            "points": points,
            "status": status(rank, step),
        }
        if rank == 0:
            body["checkpoint"] = {
                "step": 20,
                "uri": service.checkpoint_uri(job_id, "checkpoint_00000020"),
                "write_s": 0.5,
            }
        assert service.report(job_id, body).status_code == 202
    return job_id


def status(rank: int, step: int) -> dict[str, Any]:
    node = service_node(rank)
    return {
        "rank": rank,
        "step": step,
        "step_at": time.time(),
        "phase": "compute",
        "phase_since": time.time(),
        "node": f"10.0.0.{rank + 1} ({node[:8]})",
        "pid": 100 + rank,
    }


def service_node(index: int) -> str:
    return fake_node_id(index)


def events(service: Service, job_id: int) -> list[str]:
    return [event["reason"] for event in service.http.get(f"/jobs/{job_id}/events").json()["data"]]


def test_an_admin_drains_a_node_and_bad_requests_say_what_is_wrong(
    start_service: Callable[..., Service],
) -> None:
    service = start(start_service)
    admin = service.as_user(service.token("root", admin=True))
    user = service.as_user(service.token("bob"))
    node = fake_node_id(1)

    refused = user.post(f"/admin/nodes/{node}/drain", json={"deadline_s": 60})
    assert refused.status_code == 403, refused.text
    for body, field in [
        ({}, "deadline_s"),
        ({"deadline_s": 0}, "deadline_s"),
        ({"deadline_s": "soon"}, "deadline_s"),
        ({"deadline_s": 60, "grace": 1}, "grace"),
    ]:
        answer = admin.post(f"/admin/nodes/{node}/drain", json=body)
        assert answer.status_code == 422 and field in answer.text, (body, answer.text)
    malformed = admin.post("/admin/nodes/node-1/drain", json={"deadline_s": 60})
    assert malformed.status_code == 422 and "node_id" in malformed.text, malformed.text
    unknown = admin.post(f"/admin/nodes/{fake_node_id(7)}/drain", json={"deadline_s": 60})
    assert unknown.status_code == 404 and "no alive node" in unknown.text, unknown.text
    assert service.backend.draining == {}

    before = time.time()
    answer = admin.post(f"/admin/nodes/{node}/drain", json={"deadline_s": 60, "reason": "spot notice"})
    assert answer.status_code == 202, answer.text
    drain = answer.json()
    assert (drain["node_id"], drain["requested_by"], drain["ray_drain"]) == (node, "root", "accepted")
    # Ray was asked too, with the same deadline.
    assert service.backend.draining[node] == pytest.approx(before + 60, abs=2)
    # Told again with a later deadline: the earlier one stands.
    again = admin.post(f"/admin/nodes/{node}/drain", json={"deadline_s": 600}).json()
    assert again["deadline_at"] == drain["deadline_at"]

    # Ray cannot be reached: whether the node exists is not known, and the answer says so.
    service.backend.available = False
    down = admin.post(f"/admin/nodes/{fake_node_id(0)}/drain", json={"deadline_s": 60})
    assert down.status_code == 503 and "fake cluster is down" in down.text, down.text


def test_jobs_on_a_draining_node_checkpoint_at_their_next_step_and_resume_elsewhere(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start(start_service)
    job_id = run_on_both_nodes(service, spec)
    first = service.job(job_id)["ray_submission_id"]
    drained = fake_node_id(1)
    assert service.http.post(f"/admin/nodes/{drained}/drain", json={"deadline_s": 60}).status_code == 202

    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["stop_requested"]) == ("preempting", "drained")
    said = events(service, job_id)[-1]
    assert f"node {drained[:8]} drains (deadline " in said and ", from ada)" in said, said
    assert "in 60 s" in said or "in 59 s" in said, said
    assert "checkpoint at the next step boundary (after step 30)" in said, said
    assert service.backend.stopped == []  # not stopped: it checkpoints first
    # Its ranks hear it in their next reply, checkpoint at step 31 and exit; Ray reports the job done.
    reply = service.report(
        job_id,
        {
            "attempt": 1,
            "points": [{"step": 31, "rank": 0, "time": time.time(), "values": {"loss": 1.0}}],
            "checkpoint": {
                "step": 31,
                "uri": service.checkpoint_uri(job_id, "checkpoint_00000031"),
                "write_s": 0.4,
            },
        },
    ).json()
    assert reply["stop"] is True
    service.backend.statuses[first] = RayJobStatus.SUCCEEDED
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["preemptions"], job["stop_requested"]) == ("queued", 0, None)
    assert events(service, job_id)[-1] == (
        "its node drains; requeued in its place, resumes from its checkpoint at step 31; checkpointed and "
        "stopped, 0 step(s) lost"
    )
    # The draining node's capacity does not count: the gang of two spread workers waits.
    service.tick()
    assert service.job(job_id)["state"] == "queued"
    # A new node joins (the drained one still alive): the job starts on the head and the new node.
    service.backend.nodes.append({"CPU": 2.0})
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["attempt"]) == ("admitted", 2)
    assert service.backend.submitted[-1][1].attempt == 2


def test_a_job_that_cannot_checkpoint_before_the_deadline_is_stopped_at_once(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start(start_service)
    job_id = run_on_both_nodes(service, spec)
    submission = service.job(job_id)["ray_submission_id"]
    # Ray's own drain (the autoscaler, a cloud's notice through KubeRay), 4 s away: too soon.
    service.backend.draining[fake_node_id(0)] = time.time() + 4
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["stop_requested"]) == ("preempting", "drained")
    assert service.backend.stopped == [submission]
    said = events(service, job_id)[-1]
    assert "from ray): too soon to checkpoint first (that needs 7.2 s)" in said, said
    service.tick()  # Ray says STOPPED: requeued, with the steps since its checkpoint lost
    job = service.job(job_id)
    assert job["state"] == "queued"
    assert events(service, job_id)[-1] == (
        "its node drains; requeued in its place, resumes from its checkpoint at step 20; stopped before its "
        "node's drain deadline, 10 step(s) lost"
    )


def test_a_job_told_to_checkpoint_that_is_still_running_near_the_deadline_is_stopped(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start(start_service)
    job_id = run_on_both_nodes(service, spec)
    submission = service.job(job_id)["ray_submission_id"]
    deadline = time.time() + 60
    service.backend.draining[fake_node_id(1)] = deadline
    service.tick()
    assert service.job(job_id)["state"] == "preempting"
    service.tick(deadline - STOP_MARGIN_S - 1)
    assert service.backend.stopped == []
    service.tick(deadline - STOP_MARGIN_S + 0.5)
    assert service.backend.stopped == [submission]
    service.tick(deadline - STOP_MARGIN_S + 1)
    assert service.backend.stopped == [submission]  # once
    said = events(service, job_id)
    assert (
        "not stopped 5 s before the deadline: it loses the steps since its last checkpoint; stopping it"
        in said[-2]
    ), said
    assert said[-1].endswith("stopped before its node's drain deadline, 10 step(s) lost"), said
