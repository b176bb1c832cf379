"""Cheaper hours through the API on the fake cluster (issue 31 point 3): a deferrable job waits for the
price signal's cheapest window, saying so, and starts there or at its last start time; every job's cost
is counted by the signal, shown on the job, by `apiary show` and per owner in GET /queues."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from api.cli import app
from service.cluster import RayJobStatus
from service.scheduling.deferral import clock_text
from tests.integration.conftest import Service

H = 3600.0
QUEUES = {
    "research": {"share": 0.5, "min_runtime_s": 0, "default_max_runtime_s": None, "max_runtime_s": None},
    "full-scale": {"share": 0.5, "min_runtime_s": 0},
}
SPEC_FIELDS = {"name": "job", "max_steps": 100}  # one worker + 1 data CPU: 2 CPU a job


def clock(at: float, *, now: float) -> str:
    """As a waiting reason writes a time seen at `now` (its date too on another day)."""
    return clock_text(at, now=now)


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat()


def started(service: Service, job_id: int) -> bool:
    job = service.job(job_id)
    if job["state"] != "admitted":
        return False
    service.backend.statuses[job["ray_submission_id"]] = RayJobStatus.RUNNING
    return True


def test_a_deferred_job_waits_for_the_cheap_window_or_its_last_start_and_costs_are_counted(
    start_service: Callable[..., Service], spec: dict[str, Any], tmp_path: Path
) -> None:
    now = float(int(time.time()))
    # Dear until now + 2 h, cheap for two hours, dear again (one row in ISO 8601, the others in seconds).
    signal = tmp_path / "prices.csv"
    signal.write_text(
        "start,end,value\n"
        f"{now - H:.0f},{iso(now + 2 * H)},10\n"
        f"{now + 2 * H},{now + 4 * H},1\n"
        f"{now + 4 * H},{now + 24 * H},10\n"
    )
    service = start_service(
        queues=QUEUES, nodes=[{"CPU": 16.0}], price_signal=str(signal), start_timeout_s=1e6
    )
    within = service.submit({**spec, "name": "within", "max_runtime_s": H, "deferrable": {"within_h": 8}})
    by = service.submit(
        {**spec, "name": "by", "max_runtime_s": H, "deferrable": {"finish_by": iso(now + 2.5 * H)}}
    )
    plain = service.submit({**spec, "name": "plain"})

    service.tick(now)
    assert started(service, plain["id"])
    waiting = service.job(within["id"])
    assert waiting["state"] == "queued"
    last_start = datetime.fromisoformat(within["created_at"]).timestamp() + 7 * H - 1
    assert waiting["waiting_reason"] == (
        f"waits for the cheaper window {clock(now + 2 * H, now=now)}-{clock(now + 3 * H, now=now + 2 * H)} "
        f"UTC; must start by {clock(last_start, now=now)} UTC"
    )
    assert datetime.fromisoformat(waiting["eta_at"]).timestamp() == pytest.approx(now + 2 * H, abs=1)
    # Its last start comes before the cheap hours: it waits for that, the cheapest it can still make.
    last = now + 1.5 * H - 1  # a tick's margin (scheduler_interval_s)
    assert service.job(by["id"])["waiting_reason"].endswith(f"must start by {clock(last, now=now)} UTC")

    service.tick(last - 60)
    assert service.job(by["id"])["state"] == "queued"
    service.tick(last)
    assert started(service, by["id"])  # at its last start, like any other job
    service.tick(now + 2 * H - 60)
    assert service.job(within["id"])["state"] == "queued"
    service.tick(now + 2 * H)
    assert started(service, within["id"])  # at its window
    for job, why in ((by, "its last start has come"), (within, "its cheaper window has come")):
        events = service.http.get(f"/jobs/{job['id']}/events").json()["data"]
        [admission] = [event for event in events if event["to_state"] == "admitted"]
        assert admission["reason"].endswith(f"submitting attempt 1; deferrable: {why}"), admission

    # The plain job has held 2 CPU (1 worker, 1 for data) from `now` on: 2 h at 10, 1 h at 1.
    service.tick(now + 3 * H)
    job = service.job(plain["id"])
    assert job["resource_hours"] == pytest.approx(6, abs=0.01)
    assert job["priced_hours"] == pytest.approx(job["resource_hours"])
    assert job["cost"] == pytest.approx(2 * (2 * 10 + 1 * 1), abs=0.1)
    assert job["cost_unit"] == "price"
    research = next(q for q in service.http.get("/queues").json()["data"] if q["name"] == "research")
    [owner] = research["costs"]["by_owner"]
    assert owner["owner"] == "ada" and owner["cost"] >= job["cost"]
    assert research["costs"]["total"] == [{**owner, "owner": None}]

    shown = CliRunner().invoke(
        app,
        ["show", str(plain["id"])],
        env={"APIARY_URL": str(service.http.base_url), "APIARY_CONFIG": str(tmp_path / "none.toml")},
    )
    assert shown.exit_code == 0, shown.output
    shown_cost = re.compile(r"6\.00 CPU-h, cost (41\.9\d|42)\b")
    assert shown_cost.search(shown.output), shown.output
    page = service.http.get(f"/jobs/{plain['id']}", headers={"Accept": "text/html"}).text
    assert shown_cost.search(page)


def test_an_unreadable_signal_defers_nothing_and_says_so(
    start_service: Callable[..., Service], spec: dict[str, Any], tmp_path: Path
) -> None:
    signal = tmp_path / "prices.csv"
    signal.write_text("start,end,value\n")
    service = start_service(queues=QUEUES, nodes=[{"CPU": 2.0}], price_signal=str(signal))
    blocker = service.submit({**spec, "name": "blocker"})
    deferrable = service.submit({**spec, "name": "late", "max_runtime_s": H, "deferrable": {"within_h": 8}})
    signal.write_text("start,end\n")  # rewritten badly while the service runs
    service.tick()
    assert started(service, blocker["id"])
    reason = service.job(deferrable["id"])["waiting_reason"]
    assert reason.endswith(
        f"not deferred: price signal {signal}: the header is 'start,end'; it must be start,end,value"
    )


def test_deferrable_is_validated_at_submission(service: Service, spec: dict[str, Any]) -> None:
    for deferrable, field in (
        ({"finish_by": iso(time.time() - 60)}, "deferrable.finish_by"),  # in the past
        ({"within_h": 1, "finish_by": iso(time.time() + H)}, "deferrable"),
        ({"finish_by": "next friday"}, "deferrable.finish_by"),
    ):
        response = service.http.post("/jobs", json={**spec, "deferrable": deferrable})
        assert response.status_code == 422, response.text
        fields = [".".join(map(str, d["loc"][1:])) for d in response.json()["detail"]]
        assert field in fields, response.text


def test_a_queues_recent_waits_are_read_back_after_a_restart_without_deferred_jobs_waits(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    """The expected wait that moves a deferred job's last start earlier (service.scheduling.deferral)
    survives a restart or a change of leader: a new scheduler reads each queue's recent admissions."""
    from sqlalchemy import select, update

    from service.scheduling.scheduler import Scheduler
    from service.store import repository
    from service.store.models import JobEvent

    service = start_service(queues=QUEUES, nodes=[{"CPU": 2.0}])  # one job at a time
    first, second, third = (service.submit({**spec, "name": name}) for name in ("first", "second", "third"))
    for job in (first, second, third):
        service.tick()
        admitted = service.job(job["id"])
        assert admitted["state"] == "admitted", admitted
        service.backend.statuses[admitted["ray_submission_id"]] = RayJobStatus.SUCCEEDED
        service.tick()
    db = service.runtime.db
    assert db is not None
    with db.session() as session:
        # The second waited an hour in the line; the third was held for a cheaper window (its wait is
        # not the line's).
        [second_queued] = session.scalars(
            select(JobEvent).where(JobEvent.job_id == second["id"], JobEvent.to_state == "queued")
        )
        second_queued.at = second_queued.at - timedelta(hours=1)
        session.execute(
            update(JobEvent)
            .where(JobEvent.job_id == third["id"], JobEvent.to_state == "admitted")
            .values(reason=JobEvent.reason + "; deferrable: its cheaper window has come")
        )
    with db.session() as session:
        waits = repository.recent_admission_waits(session, "research", limit=20)
        assert repository.recent_admission_waits(session, "full-scale", limit=20) == []
    assert len(waits) == 2 and waits[0] < 60 and waits[1] == pytest.approx(H, abs=60)

    restarted = Scheduler(db=db, backend=service.backend, settings=service.runtime.settings)
    restarted.schedule(time.time())  # its first pass reads them, with the history
    assert restarted.waits.expected() == {"research": pytest.approx(H, abs=60)}
