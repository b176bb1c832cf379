"""The one module that talks to the database. Functions take a Session and never commit:
the caller's unit of work (`Database.session()`) does, so a transition and its event
row land together or not at all."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.errors import InvalidTransition, JobNotFound
from service.models import Job, JobEvent, Metric, utcnow
from service.protocol import MetricPoint
from service.spec import JobSpec
from service.states import ACTIVE_STATES, JobState, can_transition

logger = logging.getLogger(__name__)


def create_job(session: Session, *, spec: JobSpec, owner: str, actor: str = "api") -> Job:
    job = Job(
        name=spec.name,
        queue=spec.queue.value,
        priority=spec.priority,
        owner=owner,
        state=JobState.QUEUED,
        spec=spec.model_dump(mode="json"),
        attempt=0,
    )
    session.add(job)
    session.flush()
    session.add(
        JobEvent(
            job_id=job.id,
            from_state=None,
            to_state=JobState.QUEUED,
            actor=actor,
            reason=f"submitted by {owner} to queue {spec.queue.value}",
        )
    )
    logger.info("job queued", extra={"action": "job_queued", "job": {"id": job.id, "name": job.name}})
    return job


def get_job(session: Session, job_id: int, *, for_update: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    if for_update:
        query = query.with_for_update()
    job = session.scalars(query).one_or_none()
    if job is None:
        raise JobNotFound(f"job {job_id} does not exist")
    return job


def list_jobs(
    session: Session,
    *,
    states: Sequence[JobState] = (),
    queue: str | None = None,
    offset: int = 0,
    limit: int = 100,
) -> tuple[list[Job], int]:
    query = select(Job)
    if states:
        query = query.where(Job.state.in_(states))
    if queue:
        query = query.where(Job.queue == queue)
    count = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    jobs = list(session.scalars(query.order_by(Job.id.desc()).offset(offset).limit(limit)))
    return jobs, count


def queued_jobs(session: Session) -> list[Job]:
    """Queued jobs in admission order: priority (higher first), then age."""
    query = select(Job).where(Job.state == JobState.QUEUED).order_by(Job.priority.desc(), Job.id.asc())
    return list(session.scalars(query))


def active_jobs(session: Session) -> list[Job]:
    """Jobs whose gang holds (or is about to hold) cluster resources."""
    return list(session.scalars(select(Job).where(Job.state.in_(ACTIVE_STATES)).order_by(Job.id)))


def transition(
    session: Session,
    job: Job,
    target: JobState,
    *,
    actor: str,
    reason: str,
    **fields: Any,
) -> Job:
    """Move `job` to `target`, set `fields`, and write the event row, in the caller's transaction."""
    current = job.state
    if not can_transition(current, target):
        raise InvalidTransition(f"job {job.id} is {current.value}; it cannot become {target.value}")
    now = utcnow()
    job.state = target
    for name, value in fields.items():
        setattr(job, name, value)
    if target is JobState.ADMITTED:
        job.admitted_at = now
    elif target is JobState.RUNNING:
        job.started_at = job.started_at or now
    if target.is_terminal:
        job.finished_at = now
    if target in (JobState.FAILED, JobState.CANCELLED):
        job.message = reason
    session.add(JobEvent(job_id=job.id, from_state=current, to_state=target, actor=actor, reason=reason))
    session.flush()
    level = logging.WARNING if target is JobState.FAILED else logging.INFO
    logger.log(
        level,
        "job %s: %s -> %s (%s)",
        job.id,
        current.value,
        target.value,
        reason,
        extra={"action": f"job_{target.value}", "job": {"id": job.id, "actor": actor}},
    )
    return job


def record_event(session: Session, job: Job, *, actor: str, reason: str) -> None:
    """A notable fact that is not a transition (e.g. a new checkpoint)."""
    session.add(JobEvent(job_id=job.id, from_state=job.state, to_state=job.state, actor=actor, reason=reason))


def list_events(session: Session, job_id: int) -> list[JobEvent]:
    get_job(session, job_id)
    return list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


def add_metrics(session: Session, job: Job, *, attempt: int, points: Sequence[MetricPoint]) -> int:
    """Store points; a point already stored (same attempt, rank, step) is skipped. Returns rows given."""
    if not points:
        return 0
    rows = [
        {
            "job_id": job.id,
            "attempt": attempt,
            "step": p.step,
            "rank": p.rank,
            "time": p.time,
            "values": p.values,
        }
        for p in points
    ]
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(Metric).on_conflict_do_nothing(index_elements=["job_id", "attempt", "rank", "step"])
    session.execute(statement, rows)
    return len(rows)


def list_metrics(
    session: Session,
    job_id: int,
    *,
    rank: int | None = None,
    min_step: int | None = None,
    max_step: int | None = None,
    attempt: int | None = None,
    limit: int = 10_000,
) -> list[Metric]:
    get_job(session, job_id)
    query = select(Metric).where(Metric.job_id == job_id)
    if rank is not None:
        query = query.where(Metric.rank == rank)
    if min_step is not None:
        query = query.where(Metric.step >= min_step)
    if max_step is not None:
        query = query.where(Metric.step <= max_step)
    if attempt is not None:
        query = query.where(Metric.attempt == attempt)
    query = query.order_by(Metric.step, Metric.rank, Metric.attempt).limit(limit)
    return list(session.scalars(query))


def set_checkpoint(session: Session, job: Job, *, step: int, uri: str) -> bool:
    """Record a newer checkpoint; an older or repeated one is ignored. Returns whether it was newer."""
    if job.latest_checkpoint_step is not None and step <= job.latest_checkpoint_step:
        return False
    job.latest_checkpoint = uri
    job.latest_checkpoint_step = step
    record_event(session, job, actor="trainer", reason=f"checkpoint at step {step}: {uri}")
    return True
