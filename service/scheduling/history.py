"""What the service knows of the jobs that ran and ended, read from its database: for the live
scheduler's estimates, and for `apiary simulate --from-db` (what-if on the operator's own history).

- `EndedJob`: one job as its rows and its transitions say: when it was submitted and first admitted,
  how long it ran (every second it was `running`, over all its attempts: a resumed attempt's replay of
  the steps since its checkpoint counts too) and how long it waited (every second `queued`, after
  preemptions too). Built from rows only: nothing here is measured again.
- `LiveHistory`: the scheduler's `service.scheduling.estimates.History`. It reads the last `LOAD_JOBS`
  jobs that succeeded or failed (jobs cancelled or pruned were stopped by someone's choice, not by
  their own end) when this replica takes the scheduler lease, and then each job that ends while it
  schedules: a bounded query when it starts scheduling, a primary-key lookup of the few jobs that
  ended per pass. Nothing is stored: every replica that takes the lease reads the same rows.

`service.scheduling.replay` turns the jobs of a window into a trace for `apiary simulate --from-db`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.scheduling.estimates import History, job_size, size_class
from service.store import repository

# The jobs the live history reads when a replica takes the scheduler lease (History keeps the last
# HISTORY_KEEP of each kind: this covers dozens of kinds).
LOAD_JOBS = 2000
# The live history's jobs: those that ended by themselves.
LEARNED_STATES = (JobState.SUCCEEDED, JobState.FAILED)


def to_time(value: datetime | None) -> float | None:
    """Unix seconds of a stored time (SQLite gives them back without their UTC zone)."""
    if value is None:
        return None
    return (value if value.tzinfo is not None else value.replace(tzinfo=UTC)).timestamp()


@dataclass(frozen=True, kw_only=True)
class EndedJob:
    job_id: int
    name: str
    owner: str
    queue: str
    priority: int
    state: JobState
    spec: JobSpec
    submitted_at: float
    first_admitted_at: float | None
    ran_s: float  # every second `running`, all attempts
    queued_s: float  # every second `queued`, after preemptions too
    preemptions: int
    seconds_per_step: float | None

    @property
    def size(self) -> float:
        return job_size(self.spec.resources_per_worker, self.spec.min_workers)


def ended_job(row: Any, changes: Iterable[tuple[datetime, JobState]]) -> EndedJob:
    """A row of `repository.ended_runs` and its transitions (`repository.state_changes`: time, new state)."""
    submitted_at = to_time(row.created_at) or 0.0
    ran_s = queued_s = 0.0
    first_admitted_at: float | None = None
    running_since: float | None = None
    queued_since: float | None = submitted_at
    for at, state in changes:
        now = to_time(at) or submitted_at
        if queued_since is not None and state is not JobState.QUEUED:
            queued_s += max(0.0, now - queued_since)
            queued_since = None
        if running_since is not None and state is not JobState.RUNNING:
            ran_s += max(0.0, now - running_since)
            running_since = None
        if state is JobState.ADMITTED and first_admitted_at is None:
            first_admitted_at = now
        elif state is JobState.RUNNING and running_since is None:
            running_since = now
        elif state is JobState.QUEUED and queued_since is None:
            queued_since = now
    return EndedJob(
        job_id=row.id,
        name=row.name,
        owner=row.owner,
        queue=row.queue,
        priority=row.priority,
        state=row.state,
        spec=JobSpec.model_validate(row.spec),
        submitted_at=submitted_at,
        first_admitted_at=first_admitted_at,
        ran_s=ran_s,
        queued_s=queued_s,
        preemptions=row.preemptions or 0,
        seconds_per_step=row.seconds_per_step,
    )


def ended_jobs(session: Session, rows: Sequence[Any]) -> list[EndedJob]:
    """`rows` of `repository.ended_runs` with their transitions, oldest first."""
    changes: dict[int, list[tuple[datetime, JobState]]] = {}
    for job_id, at, state in repository.state_changes(session, [row.id for row in rows]):
        changes.setdefault(job_id, []).append((at, state))
    return [ended_job(row, changes.get(row.id, ())) for row in sorted(rows, key=lambda row: row.id)]


class LiveHistory:
    """The live scheduler's history of finished jobs (module docstring); `version` changes with it."""

    def __init__(self, *, load_jobs: int = LOAD_JOBS) -> None:
        self.load_jobs = load_jobs
        self.history = History()
        self.version = 0
        self.loaded = False
        self._estimates: dict[tuple[str, str, str, float | None], float | None] = {}

    def load(self, session: Session) -> None:
        """Start again from the last `load_jobs` jobs that ended by themselves."""
        self.history = History()
        self._estimates.clear()
        rows = repository.ended_runs(session, states=LEARNED_STATES, limit=self.load_jobs)
        self.record(ended_jobs(session, rows))
        self.loaded = True

    def learn(self, session: Session, job_ids: Sequence[int]) -> None:
        """Record those of `job_ids` that ran and ended by themselves (the others are left out)."""
        rows = repository.ended_runs(session, states=LEARNED_STATES, job_ids=job_ids) if job_ids else []
        self.record(ended_jobs(session, rows))

    def estimate(self, *, owner: str, name: str, size: float, declared_s: float | None) -> float | None:
        # Many queued jobs are of one kind: each kind is estimated once per version of the history.
        key = (owner, name, size_class(size), declared_s)
        if key not in self._estimates:
            estimate = self.history.estimate(owner=owner, name=name, size=size, declared_s=declared_s)
            self._estimates[key] = estimate
        return self._estimates[key]

    def record(self, jobs: Sequence[EndedJob]) -> None:
        for job in jobs:
            self.history.record(owner=job.owner, name=job.name, size=job.size, duration_s=job.ran_s)
        if jobs:
            self.version += 1
            self._estimates.clear()
