"""What the service learns from its ended jobs, on SQLite and PostgreSQL: the queue's ETAs use history's
estimates (service.scheduling.history)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from service.contract.spec import JobSpec
from service.contract.states import JobState
from tests.integration.conftest import Service
from tests.support.history import add_ended_job

SPEC_FIELDS = {"name": "quick", "num_workers": 6}  # 6 workers + 1 data CPU: 7 of the node's 8 CPUs


def _ran(seconds: float, *, waited_s: float = 5) -> list[tuple[JobState, float]]:
    return [
        (JobState.ADMITTED, waited_s),
        (JobState.RUNNING, waited_s + 1),
        (JobState.SUCCEEDED, waited_s + 1 + seconds),
    ]


def _eta(service: Service, job_id: int) -> float:
    (research,) = [
        queue for queue in service.http.get("/queues").json()["data"] if queue["name"] == "research"
    ]
    (job,) = [job for job in research["jobs"] if job["id"] == job_id]
    return datetime.fromisoformat(job["eta_at"]).timestamp()


def test_a_30_second_job_shows_an_eta_from_its_history_not_an_hour_away(
    service: Service, spec: dict[str, Any]
) -> None:
    db = service.runtime.db
    assert db is not None
    past = datetime.now(UTC) - timedelta(hours=2)
    for i in range(3):  # three earlier runs of the same job took 30 s each
        add_ended_job(
            db,
            spec=JobSpec.model_validate(spec),
            owner="ada",
            submitted_at=past + timedelta(minutes=i),
            timeline=_ran(30),
        )
    running, head, behind = (service.submit(spec)["id"] for _ in range(3))
    now = datetime.now(UTC).timestamp()
    service.tick(now)
    assert service.job(running)["state"] == "admitted"
    # The head starts when the running job ends (30 s), the next one 30 s later: not at the research
    # queue's default max_runtime_s (1 h) each.
    assert now + 25 <= _eta(service, head) <= now + 60
    assert _eta(service, behind) - _eta(service, head) == pytest.approx(30, abs=1)
    assert service.job(behind)["spec"]["max_runtime_s"] == 3600
