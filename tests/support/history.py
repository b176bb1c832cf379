"""Jobs that ran and ended in the past, written as the service writes them (the repository's transitions
and their event rows), then dated: the history `service.scheduling.history` reads."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.store import repository
from service.store.db import Database
from service.store.models import JobEvent
from tests.support.jobs import make_spec


def job_spec(**fields: Any) -> JobSpec:
    """An mlp job of 2 workers of 1 CPU, unless `fields` say otherwise (`tests.support.jobs.make_spec`)."""
    values: dict[str, Any] = {"name": "job", "max_steps": 5, "batch_size": 2, **fields}
    return make_spec(trainer="mlp", dataset="file:///data", config={"num_classes": 3}, **values)


def add_ended_job(
    db: Database,
    *,
    spec: JobSpec,
    owner: str,
    submitted_at: datetime,
    timeline: Sequence[tuple[JobState, float]],
) -> int:
    """A job submitted at `submitted_at` that went through `timeline` (each new state and its seconds
    after the submission); a transition to preempting counts a preemption. Returns its id."""
    with db.session() as session:
        job = repository.create_job(session, spec=spec, owner=owner)
        for state, _ in timeline:
            repository.transition(session, job, state, actor="test", reason="history")
            if state is JobState.PREEMPTING:
                job.preemptions += 1
        times = [submitted_at, *(submitted_at + timedelta(seconds=after) for _, after in timeline)]
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id))
        for event, at in zip(events, times, strict=True):
            event.at = at
        job.created_at = submitted_at
        dated = zip(timeline, times[1:], strict=True)
        started = [at for (state, _), at in dated if state is JobState.RUNNING]
        job.started_at = started[0] if started else None
        job.finished_at = times[-1]
        return job.id
