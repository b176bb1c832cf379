"""The one module that talks to the database. Functions take a Session and never commit:
the caller's unit of work (`Database.session()`) does, so a transition and its event
row land together or not at all."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, aliased

from service.contract.errors import (
    InvalidTransition,
    JobNotFound,
    LastAdminToken,
    SweepNotFound,
    TokenNotFound,
)
from service.contract.protocol import MetricPoint, RankStatus
from service.contract.spec import MAX_INT, JobSpec
from service.contract.states import ACTIVE_STATES, JobState, StopReason, can_transition
from service.contract.system import SYSTEM_FIGURES, show_figure, system_outliers
from service.store.models import (
    ApiToken,
    AuthState,
    Checkpoint,
    CheckpointState,
    CodePackage,
    IdempotencyKey,
    Job,
    JobEvent,
    Metric,
    NodeDrain,
    OwnerUsage,
    SchedulerLease,
    SpotNode,
    Sweep,
    WebSession,
    utcnow,
)

logger = logging.getLogger(__name__)


def create_job(
    session: Session,
    *,
    spec: JobSpec,
    owner: str,
    actor: str = "api",
    sweep_id: int | None = None,
    trial: int | None = None,
    trial_params: dict[str, Any] | None = None,
) -> Job:
    """A queued job; a sweep's trial says its sweep, number and point (unique per sweep: a second
    trial with the same number fails to commit)."""
    job = Job(
        name=spec.name,
        queue=spec.queue.value,
        priority=spec.priority,
        owner=owner,
        state=JobState.QUEUED,
        spec=spec.model_dump(mode="json"),
        attempt=0,
        sweep_id=sweep_id,
        trial=trial,
        trial_params=trial_params,
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


# -- code packages (service.code): who uploaded which ----------------------------------------------------


def add_code_package(session: Session, *, sha256: str, owner: str, size_bytes: int, files: int) -> bool:
    """Record that `owner` uploaded the package; False when they had already (nothing changes)."""
    if session.get(CodePackage, (sha256, owner)) is not None:
        return False
    session.add(CodePackage(sha256=sha256, owner=owner, size_bytes=size_bytes, files=files))
    session.flush()
    return True


def find_code_package(session: Session, *, sha256: str, owner: str | None) -> CodePackage | None:
    """`owner`'s upload of the package; with `owner` None, anyone's (an admin may run any package)."""
    query = select(CodePackage).where(CodePackage.sha256 == sha256)
    if owner is not None:
        query = query.where(CodePackage.owner == owner)
    return session.scalars(query.limit(1)).first()


# -- idempotency keys (service.jobs: JobService.submit_idempotent) ------------------------------------


def find_idempotency_key(
    session: Session, *, owner: str, key: str, since: datetime | None
) -> IdempotencyKey | None:
    """`owner`'s `key`, if it was stored at or after `since` (an older one no longer matches); with
    `since` None, whatever its age."""
    query = select(IdempotencyKey).where(IdempotencyKey.owner == owner, IdempotencyKey.key == key)
    if since is not None:
        query = query.where(IdempotencyKey.created_at >= since)
    return session.scalars(query).one_or_none()


def is_live(found: IdempotencyKey, *, since: datetime) -> bool:
    """Whether a key found with `since=None` was stored at or after `since` (it still matches)."""
    return _aware(found.created_at) >= since


def add_idempotency_key(
    session: Session,
    *,
    owner: str,
    key: str,
    request_hash: str,
    job_id: int,
    expired_before: datetime | None,
) -> None:
    """Store `key` for the job just created in this transaction. With `expired_before` (the caller saw
    an expired row of the key), that row is replaced; a live one (a concurrent request that won) makes
    the flush raise IntegrityError, which rolls the whole transaction back, the job with it."""
    if expired_before is not None:
        session.execute(
            delete(IdempotencyKey).where(
                IdempotencyKey.owner == owner,
                IdempotencyKey.key == key,
                IdempotencyKey.created_at < expired_before,
            )
        )
    session.add(
        IdempotencyKey(owner=owner, key=key, request_hash=request_hash, job_id=job_id, created_at=utcnow())
    )
    session.flush()


def prune_idempotency_keys(session: Session, *, before: datetime) -> int:
    """Delete the keys stored before `before` (expired); returns how many."""
    result = session.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at < before))
    return int(getattr(result, "rowcount", 0) or 0)


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


def active_jobs(session: Session) -> list[Job]:
    """Jobs whose gang holds (or is about to hold) cluster resources."""
    return list(session.scalars(select(Job).where(Job.state.in_(ACTIVE_STATES)).order_by(Job.id)))


def unfinished_jobs(session: Session) -> list[Job]:
    """Queued and active jobs, whole."""
    states = (JobState.QUEUED, *ACTIVE_STATES)
    return list(session.scalars(select(Job).where(Job.state.in_(states)).order_by(Job.id)))


# What the scheduler reads of every unfinished job at each tick: everything but the spec, which never
# changes and is read once per job (`specs`); an admin may change the queue and priority (update_job).
SCHEDULING_COLUMNS = (
    Job.id,
    Job.state,
    Job.queue,
    Job.priority,
    Job.owner,
    Job.created_at,
    Job.admitted_at,
    Job.last_checkpoint_at,
    Job.latest_step,
    Job.seconds_per_step,
    Job.ray_submission_id,
    Job.stop_requested,
    Job.stop_requested_at,
    Job.checkpoint_write_s,
    Job.queue_position,
    Job.waiting_reason,
    Job.eta_at,
    Job.ranks,
    Job.restarting_since,
    Job.resource_hours,
    Job.priced_hours,
    Job.cost,
    Job.cost_at,
)


def scheduling_rows(session: Session) -> list[Any]:
    """Queued and active jobs (`SCHEDULING_COLUMNS`), in one query."""
    states = (JobState.QUEUED, *ACTIVE_STATES)
    query = select(*SCHEDULING_COLUMNS).where(Job.state.in_(states)).order_by(Job.id)
    return list(session.execute(query))


def specs(session: Session, job_ids: Sequence[int], *, chunk: int = 5000) -> list[Any]:
    """(id, spec, owner, created_at) of `job_ids`: what never changes about a job, in a few queries."""
    found: list[Any] = []
    for start in range(0, len(job_ids), chunk):
        ids = job_ids[start : start + chunk]
        found += session.execute(select(Job.id, Job.spec, Job.owner, Job.created_at).where(Job.id.in_(ids)))
    return found


def ended_runs(
    session: Session,
    *,
    states: Sequence[JobState],
    submitted_since: datetime | None = None,
    job_ids: Sequence[int] | None = None,
    limit: int | None = None,
) -> list[Any]:
    """Jobs in `states` that ran (they have a first start), newest first (by id), as (id, name, owner,
    queue, priority, state, spec, created_at, finished_at, seconds_per_step, preemptions): those
    submitted since `submitted_since`, or those of `job_ids`, at most `limit` of them."""
    columns = (
        Job.id,
        Job.name,
        Job.owner,
        Job.queue,
        Job.priority,
        Job.state,
        Job.spec,
        Job.created_at,
        Job.finished_at,
        Job.seconds_per_step,
        Job.preemptions,
    )
    query = select(*columns).where(Job.state.in_(states), Job.started_at.is_not(None)).order_by(Job.id.desc())
    if submitted_since is not None:
        query = query.where(Job.created_at >= submitted_since)
    if job_ids is None:
        return list(session.execute(query.limit(limit)))
    found: list[Any] = []
    for start in range(0, len(job_ids), 5000):
        found += session.execute(query.where(Job.id.in_(job_ids[start : start + 5000])))
    return sorted(found, key=lambda row: -row.id)[:limit]


def state_changes(session: Session, job_ids: Sequence[int], *, chunk: int = 5000) -> list[Any]:
    """(job_id, at, to_state) of every transition of `job_ids` (notes that keep the state left out),
    by job, each job's in order."""
    found: list[Any] = []
    for start in range(0, len(job_ids), chunk):
        query = (
            select(JobEvent.job_id, JobEvent.at, JobEvent.to_state)
            .where(
                JobEvent.job_id.in_(job_ids[start : start + chunk]),
                JobEvent.to_state.is_not(None),
                or_(JobEvent.from_state.is_(None), JobEvent.from_state != JobEvent.to_state),
            )
            .order_by(JobEvent.job_id, JobEvent.id)
        )
        found += session.execute(query)
    return found


def count_unfinished(session: Session) -> dict[tuple[str, JobState], int]:
    """(queue, state) -> how many jobs, for queued and active jobs."""
    states = (JobState.QUEUED, *ACTIVE_STATES)
    query = (
        select(Job.queue, Job.state, func.count()).where(Job.state.in_(states)).group_by(Job.queue, Job.state)
    )
    return {(queue, state): count for queue, state, count in session.execute(query)}


def count_jobs(session: Session) -> dict[tuple[str, JobState], int]:
    """(queue, state) -> how many jobs, for every state (one grouped count on the state index)."""
    query = select(Job.queue, Job.state, func.count()).group_by(Job.queue, Job.state)
    return {(queue, state): count for queue, state, count in session.execute(query)}


def queued_since(session: Session, job_id: int) -> datetime | None:
    """When the job last entered the queue: its submission, or its latest requeue (preempted, not
    started in time, ...)."""
    query = select(func.max(JobEvent.at)).where(
        JobEvent.job_id == job_id,
        JobEvent.to_state == JobState.QUEUED,
        or_(JobEvent.from_state.is_(None), JobEvent.from_state != JobState.QUEUED),
    )
    return session.scalar(query)


def recent_admission_waits(session: Session, queue: str, *, limit: int) -> list[float]:
    """The waits of `queue`'s last `limit` admissions, oldest first, each from the job's entry into the
    queue before it (its submission or requeue) to the admission. Admissions of deferrable jobs are left
    out (their wait includes the hours they were held for a cheaper window, which the database does not
    keep)."""
    admitted, queued = aliased(JobEvent), aliased(JobEvent)
    joined = (
        select(func.max(queued.at))
        .where(
            queued.job_id == admitted.job_id,
            queued.id < admitted.id,
            queued.to_state == JobState.QUEUED,
            or_(queued.from_state.is_(None), queued.from_state != JobState.QUEUED),
        )
        .correlate(admitted)
        .scalar_subquery()
    )
    rows = session.execute(
        select(admitted.at, joined)
        .join(Job, Job.id == admitted.job_id)
        .where(
            Job.queue == queue,
            admitted.to_state == JobState.ADMITTED,
            admitted.reason.not_like("%deferrable:%"),
        )
        .order_by(admitted.id.desc())
        .limit(limit)
    ).all()
    return [(_aware(at) - _aware(since)).total_seconds() for at, since in reversed(rows) if since is not None]


def waiting_line(session: Session, queue: str, *, limit: int, offset: int = 0) -> list[Job]:
    """`limit` queued jobs of `queue` from `offset`, in the order the scheduler last gave them."""
    query = (
        select(Job)
        .where(Job.state == JobState.QUEUED, Job.queue == queue)
        .order_by(Job.queue_position.is_(None), Job.queue_position, Job.id)
        .offset(offset)
        .limit(limit)
    )
    return list(session.scalars(query))


def ledgers(session: Session, job_ids: Sequence[int]) -> list[Any]:
    """(id, state, admitted_at, finished_at, resource_hours, priced_hours, cost, cost_at) of `job_ids`."""
    if not job_ids:
        return []
    columns = (
        Job.id,
        Job.state,
        Job.admitted_at,
        Job.finished_at,
        Job.resource_hours,
        Job.priced_hours,
        Job.cost,
        Job.cost_at,
    )
    return list(session.execute(select(*columns).where(Job.id.in_(job_ids))))


def set_ledgers(session: Session, changes: Iterable[Mapping[str, Any]]) -> None:
    """Store many jobs' cost ledgers in one statement (rows of id, resource_hours, priced_hours, cost,
    cost_unit, cost_at)."""
    _update_by_id(session, changes)


def costs_by_owner(session: Session) -> list[Any]:
    """(queue, owner, cost_unit, resource_hours, priced_hours, cost) summed over every job that held
    resources, by queue, owner and unit."""
    query = (
        select(
            Job.queue,
            Job.owner,
            Job.cost_unit,
            func.sum(Job.resource_hours),
            func.sum(Job.priced_hours),
            func.sum(Job.cost),
        )
        .where(Job.resource_hours > 0)
        .group_by(Job.queue, Job.owner, Job.cost_unit)
        .order_by(Job.queue, Job.owner, Job.cost_unit)
    )
    return list(session.execute(query))


def set_waiting(session: Session, changes: Iterable[Mapping[str, Any]]) -> None:
    """Store many queued jobs' position, reason and ETA in one statement (rows of id and the three)."""
    _update_by_id(session, changes)


def _update_by_id(session: Session, changes: Iterable[Mapping[str, Any]]) -> None:
    rows = [dict(row) for row in changes]
    if rows:
        session.execute(update(Job), rows)


def hold_lease(session: Session, *, name: str, holder: str, now: datetime, ttl_s: float) -> bool:
    """Take or renew the lease `name` for `holder` (free when expired); True while `holder` has it."""
    expires_at = now + timedelta(seconds=ttl_s)
    renewed = session.scalar(
        update(SchedulerLease)
        .where(
            SchedulerLease.name == name,
            or_(SchedulerLease.holder == holder, SchedulerLease.expires_at < now),
        )
        .values(holder=holder, expires_at=expires_at)
        .returning(SchedulerLease.name)
    )
    if renewed is not None:
        return True
    insert = _insert(session)(SchedulerLease).values(name=name, holder=holder, expires_at=expires_at)
    created = session.scalar(
        insert.on_conflict_do_nothing(index_elements=["name"]).returning(SchedulerLease.name)
    )
    return created is not None


def owns_lease(session: Session, *, name: str, holder: str, now: datetime) -> bool:
    """Whether `holder` still holds `name`; locks the lease row for the rest of the transaction, so a
    replica cannot take it over while this one writes a decision."""
    query = (
        select(SchedulerLease.name)
        .where(SchedulerLease.name == name, SchedulerLease.holder == holder, SchedulerLease.expires_at > now)
        .with_for_update()
    )
    return session.scalar(query) is not None


def owner_usage(session: Session) -> dict[str, tuple[float, datetime]]:
    """Each owner's stored usage and when it was last brought up to date."""
    return {row.owner: (row.usage, row.updated_at) for row in session.scalars(select(OwnerUsage))}


def set_owner_usage(session: Session, usage: Mapping[str, float], *, now: datetime) -> None:
    if not usage:
        return
    rows = [{"owner": owner, "usage": value, "updated_at": now} for owner, value in usage.items()]
    insert = _insert(session)(OwnerUsage)
    statement = insert.on_conflict_do_update(
        index_elements=["owner"],
        set_={"usage": insert.excluded.usage, "updated_at": insert.excluded.updated_at},
    )
    session.execute(statement, rows)


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
    if target in (JobState.ADMITTED, JobState.RECOVERING):
        job.admitted_at = now  # when this attempt was submitted
        job.ranks = None
        job.restarting_since = None
    elif target is JobState.RUNNING:
        job.started_at = job.started_at or now
    if target.is_terminal:
        job.finished_at = now
    if target in (JobState.FAILED, JobState.CANCELLED, JobState.PRUNED):
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


def request_stop(session: Session, job: Job, *, why: StopReason, actor: str, reason: str) -> Job:
    """running -> preempting: the job's trainers checkpoint at their next step and exit
    (service.contract.states)."""
    return transition(
        session,
        job,
        JobState.PREEMPTING,
        actor=actor,
        reason=reason,
        stop_requested=why.value,
        stop_requested_at=utcnow(),
    )


def add_node_drain(
    session: Session, *, node_id: str, deadline_at: datetime, reason: str, requested_by: str
) -> NodeDrain:
    """Record that a node goes by `deadline_at`; told again, the earlier deadline stands."""
    drain = session.get(NodeDrain, node_id, with_for_update=True)
    if drain is None:
        drain = NodeDrain(node_id=node_id, deadline_at=deadline_at, reason=reason, requested_by=requested_by)
        session.add(drain)
    elif deadline_at < _aware(drain.deadline_at):
        drain.deadline_at, drain.reason, drain.requested_by = deadline_at, reason, requested_by
    session.flush()
    return drain


def node_drains(session: Session) -> list[NodeDrain]:
    return list(session.scalars(select(NodeDrain).order_by(NodeDrain.node_id)))


def forget_node_drains(session: Session, node_ids: Iterable[str]) -> None:
    """Drop the drains of nodes that are gone (a Ray node id is never reused)."""
    ids = list(node_ids)
    if ids:
        session.execute(delete(NodeDrain).where(NodeDrain.node_id.in_(ids)))


def update_job(
    session: Session, job: Job, *, queue: str | None, priority: int | None, spec: JobSpec, actor: str
) -> Job:
    """Move a job to another queue or give it another priority (its stored spec says the same), with an
    event that says who did and what changed."""
    changes = []
    if queue is not None and queue != job.queue:
        changes.append(f"queue {job.queue} -> {queue}")
        job.queue = queue
    if priority is not None and priority != job.priority:
        changes.append(f"priority {job.priority} -> {priority}")
        job.priority = priority
    if changes:
        job.spec = spec.model_dump(mode="json")
        record_event(session, job, actor=actor, reason=f"{', '.join(changes)} by {actor}")
        logger.info("job updated", extra={"action": "job_updated", "job": {"id": job.id, "changes": changes}})
    return job


def record_event(session: Session, job: Job, *, actor: str, reason: str) -> None:
    """A notable fact that is not a transition (e.g. a new checkpoint)."""
    session.add(JobEvent(job_id=job.id, from_state=job.state, to_state=job.state, actor=actor, reason=reason))


def list_events(session: Session, job_id: int) -> list[JobEvent]:
    get_job(session, job_id)
    return list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


def note_segment(session: Session, job: Job, *, segment: int, resumed_from: int | None) -> None:
    """Take note of the worker-group start (`segment`) of the job's current attempt that posted telemetry.

    The first one of an attempt is remembered; a later one is a restart of the group inside Ray
    Train (from its latest checkpoint, at `resumed_from`): it counts as a restart and a failure,
    and its event says how many steps the restart replays. An older one (a late post) changes nothing.
    """
    if segment == 0 or (job.segment is not None and segment <= job.segment):
        return
    if job.segment is None:
        # The attempt's first group to report (one that Ray Train restarted before any post included).
        job.segment = segment
        job.ranks = None
        job.restarting_since = None
        return
    if resumed_from is None:
        return  # a post with neither points nor its start event: the next one says where it resumed
    lost = max(0, (job.latest_step or 0) - resumed_from)
    job.segment = segment
    job.ranks = None
    job.restarting_since = None
    job.restarts += 1
    job.failures += 1
    job.latest_step = resumed_from
    record_event(
        session,
        job,
        actor="ray-train",
        reason=f"worker group restarted by Ray Train (restart {job.restarts} of the job, failure "
        f"{job.failures}): resumed from step {resumed_from}, {lost} step(s) to train again",
    )
    logger.warning(
        "job %s: worker group restarted, resumed from step %s (%s steps lost)",
        job.id,
        resumed_from,
        lost,
        extra={"action": "job_restarted", "job": {"id": job.id, "restarts": job.restarts}},
    )


def note_group_failed(session: Session, job: Job) -> None:
    """Ray Train is restarting the current worker group from its latest checkpoint (its failure policy
    posted `worker_failed`): forget the failed group's ranks, so that the hang timeout waits for the new
    group (`note_segment` ends the restart when it first reports)."""
    job.restarting_since = utcnow()
    job.ranks = None


# A rank is a straggler after this many posts in a row slower than the others (and no longer one after
# as many in a row that are not).
STRAGGLER_POSTS = 3
# ... and by at least this much a step: millisecond steps vary by multiples with the machine's load.
STRAGGLER_MIN_S = 0.01


def _next_streak(streak: int, out: bool) -> int:
    """Posts in a row that found a rank out of line (positive), or in line (negative)."""
    return (max(streak, 0) + 1) if out else (min(streak, 0) - 1)


def _turns(was: bool, streak: int) -> bool:
    """Whether a rank marked `was` (a straggler, an outlier) turns after STRAGGLER_POSTS posts in a row."""
    return (not was and streak >= STRAGGLER_POSTS) or (was and streak <= -STRAGGLER_POSTS)


def _note_system_outliers(
    session: Session, job: Job, entry: dict[str, Any], others: list[dict[str, Any]]
) -> None:
    """Mark (and unmark) the system figures in which the rank of `entry` stands out, with an event."""
    mine = entry.get("system")
    if not mine:  # this post had no sample (it could not be read): nothing to judge it by
        entry.pop("outliers", None)
        entry.pop("outlier_streaks", None)
        return
    streaks = dict(entry.get("outlier_streaks") or {})
    marked = set(entry.get("outliers") or ())
    peers = [other["system"] for other in others if other.get("system")]
    for name, (out, median) in system_outliers(mine, peers).items():
        streak = streaks[name] = _next_streak(streaks.get(name, 0), out)
        was = name in marked
        if not _turns(was, streak):
            continue
        figure = SYSTEM_FIGURES[name]
        value = mine[name]
        said = (
            f"{show_figure(value, figure.unit)} against {show_figure(median, figure.unit)} "
            "for the other ranks"
        )
        if not was:
            marked.add(name)
            reason = (
                f"rank {entry['rank']} on node {entry['node']} stands out in {figure.label}: {said} "
                f"at step {entry['step']}"
            )
        else:
            marked.discard(name)
            reason = (
                f"rank {entry['rank']} on node {entry['node']} no longer stands out in {figure.label} "
                f"({said})"
            )
        record_event(session, job, actor="service", reason=reason)
        logger.warning(
            reason, extra={"action": "system_outlier", "job": {"id": job.id, "rank": entry["rank"]}}
        )
    entry["outlier_streaks"] = streaks
    entry["outliers"] = sorted(marked)


def note_rank_status(
    session: Session,
    job: Job,
    status: RankStatus,
    *,
    points: Sequence[MetricPoint],
    now: float,
    straggler_factor: float,
) -> None:
    """Keep what a rank of the current worker group says it is doing (`Job.ranks`), and record a rank
    that turns into a straggler (or stops being one), or whose system figures turn to stand out from
    the others' (`system_outliers`), as an event."""
    ranks = {key: dict(value) for key, value in (job.ranks or {}).items()}
    key = str(status.rank)
    entry = {**ranks.get(key, {}), **status.model_dump(), "seen": now}
    own = sorted(
        p.values.get("data_wait_s", 0.0) + p.values["forward_s"] for p in points if "forward_s" in p.values
    )
    if own:
        entry["own_s"] = own[len(own) // 2]
    ranks[key] = entry
    others = sorted(other["own_s"] for name, other in ranks.items() if name != key and "own_s" in other)
    if own and others:
        median = others[len(others) // 2]
        slow = entry["own_s"] > straggler_factor * median and entry["own_s"] - median >= STRAGGLER_MIN_S
        streak = entry["streak"] = _next_streak(entry.get("streak", 0), slow)
        was = bool(entry.get("straggler"))
        if _turns(was, streak):
            entry["straggler"] = not was
            reason = (
                f"rank {status.rank} on node {status.node} is a straggler: its own work (data wait + "
                f"forward) takes {entry['own_s'] * 1000:.1f} ms a step against {median * 1000:.1f} ms for "
                f"the other ranks ({entry['own_s'] / median:.1f}x) at step {status.step}"
                if not was
                else f"rank {status.rank} on node {status.node} is no longer a straggler "
                f"({entry['own_s'] * 1000:.1f} ms a step against {median * 1000:.1f} ms)"
            )
            record_event(session, job, actor="service", reason=reason)
            logger.warning(reason, extra={"action": "straggler", "job": {"id": job.id, "rank": status.rank}})
    _note_system_outliers(session, job, entry, [other for name, other in ranks.items() if name != key])
    job.ranks = ranks


def add_metrics(
    session: Session,
    job: Job,
    *,
    attempt: int,
    points: Sequence[MetricPoint],
    segment: int = 0,
    current: bool = True,
) -> int:
    """Store points; a point already stored (same attempt, segment, rank, step) is skipped. Returns rows
    given. Only points of the job's `current` attempt and segment move its progress."""
    if not points:
        return 0
    rows = [
        {
            "job_id": job.id,
            "attempt": attempt,
            "segment": segment,
            "step": p.step,
            "rank": p.rank,
            "time": p.time,
            "values": p.values,
        }
        for p in points
    ]
    statement = _insert(session)(Metric).on_conflict_do_nothing(
        index_elements=["job_id", "attempt", "segment", "rank", "step"]
    )
    session.execute(statement, rows)
    if not current:
        return len(rows)
    latest = max(point.step for point in points)
    if job.latest_step is None or latest > job.latest_step:
        job.latest_step = latest
    step_times = sorted(p.values["step_time_s"] for p in points if p.values.get("step_time_s", 0) > 0)
    if step_times:
        # The pace of the run (the scheduler's estimate of when it ends), smoothed over posts.
        median = step_times[len(step_times) // 2]
        job.seconds_per_step = (
            median if job.seconds_per_step is None else 0.8 * job.seconds_per_step + 0.2 * median
        )
    return len(rows)


def _insert(session: Session) -> Any:
    """The dialect's INSERT, which has ON CONFLICT (SQLite and PostgreSQL alike)."""
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


class MetricsQuery(BaseModel):
    """Which of a job's metric points to read: the one place its filters are spelled (the route takes
    it as its query parameters, `JobService.list_metrics` passes it through, `list_metrics` reads it)."""

    model_config = ConfigDict(frozen=True)

    rank: int | None = Field(default=None, ge=0, le=MAX_INT)
    min_step: int | None = Field(default=None, ge=0, le=MAX_INT)
    max_step: int | None = Field(default=None, ge=0, le=MAX_INT)
    attempt: int | None = Field(default=None, ge=1, le=MAX_INT)
    limit: int = Field(default=10_000, ge=1, le=100_000)
    segments: Literal["counted", "all"] = Field(
        default="counted",
        description="counted: for each step and rank, the point of the run that counted (the last "
        "attempt and worker-group start that trained it); all: also the steps that a restart, a "
        "recovery or a preemption abandoned and trained again.",
    )
    every: int | None = Field(
        default=None, ge=1, le=MAX_INT, description="Keep only the steps that are multiples of N."
    )
    points: int | None = Field(
        default=None,
        ge=2,
        le=100_000,
        description="Keep about K steps, evenly spaced between the first and the last (kept too).",
    )


def list_metrics(session: Session, job_id: int, query: MetricsQuery = MetricsQuery()) -> list[Metric]:
    """A job's points by step, rank, attempt and segment. `segments="counted"`: for each (step, rank),
    only the point of the latest (attempt, segment) that trained it: the curve of the run that counted,
    without the steps a restart, recovery or preemption trained again.

    Downsampling, in the query (a million-step run is never read whole): `every` keeps the steps that
    are multiples of it; `points` picks the stride that leaves about that many steps between the
    first and the last step in range (read from the index), and keeps the last step too."""
    get_job(session, job_id)
    conditions = [Metric.job_id == job_id]
    if query.rank is not None:
        conditions.append(Metric.rank == query.rank)
    if query.min_step is not None:
        conditions.append(Metric.step >= query.min_step)
    if query.max_step is not None:
        conditions.append(Metric.step <= query.max_step)
    if query.attempt is not None:
        conditions.append(Metric.attempt == query.attempt)
    if query.every is not None and query.every > 1:
        conditions.append(Metric.step % query.every == 0)
    if query.points is not None:
        first, last = session.execute(
            select(func.min(Metric.step), func.max(Metric.step)).where(*conditions)
        ).one()
        if first is not None and last - first + 1 > query.points:
            stride = -(-(last - first + 1) // query.points)  # ceil: at most `points` steps
            conditions.append(or_((Metric.step - first) % stride == 0, Metric.step == last))
    selected = select(Metric).where(*conditions)
    if query.segments == "counted":
        newest = (
            select(
                Metric.id,
                func.row_number()
                .over(
                    partition_by=(Metric.step, Metric.rank),
                    order_by=(Metric.attempt.desc(), Metric.segment.desc()),
                )
                .label("newest"),
            )
            .where(*conditions)
            .subquery()
        )
        selected = select(Metric).join(newest, Metric.id == newest.c.id).where(newest.c.newest == 1)
    selected = selected.order_by(Metric.step, Metric.rank, Metric.attempt, Metric.segment).limit(query.limit)
    return list(session.scalars(selected))


def set_checkpoint(session: Session, job: Job, *, step: int, uri: str, attempt: int | None = None) -> bool:
    """Record a reported checkpoint (a `checkpoints` row, for retention) and, when it is newer than the
    job's latest, make it the one the job resumes from. Returns whether it was newer."""
    add_checkpoint(session, job, step=step, uri=uri, attempt=job.attempt if attempt is None else attempt)
    if job.latest_checkpoint_step is not None and step <= job.latest_checkpoint_step:
        return False
    job.latest_checkpoint = uri
    job.latest_checkpoint_step = step
    job.last_checkpoint_at = utcnow()
    record_event(session, job, actor="trainer", reason=f"checkpoint at step {step}: {uri}")
    return True


# -- checkpoints and their retention (service.scheduling.retention)
# ---------------------------------------------


def add_checkpoint(session: Session, job: Job, *, step: int, uri: str, attempt: int) -> None:
    """The row of a reported checkpoint, with rank 0's metrics at its step (stored before it in the
    same telemetry post). Reported again, it stays one row; a folder written again after its
    deletion (same uri) is kept again."""
    existing = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.uri == uri)
    ).one_or_none()
    if existing is not None:
        if existing.state is CheckpointState.DELETED:
            existing.state = CheckpointState.KEPT
            existing.retention_due = True
            existing.deleted_at = None
            existing.step, existing.attempt = step, attempt
            existing.metrics = step_metrics(session, job.id, step) or {}
        return
    values = {
        "job_id": job.id,
        "attempt": attempt,
        "step": step,
        "uri": uri,
        "metrics": step_metrics(session, job.id, step) or {},
        "created_at": utcnow(),
        "state": CheckpointState.KEPT,
        "retention_due": True,
        "delete_attempts": 0,
    }
    session.execute(
        _insert(session)(Checkpoint).values(**values).on_conflict_do_nothing(index_elements=["job_id", "uri"])
    )


def step_metrics(session: Session, job_id: int, step: int) -> dict[str, float] | None:
    """Rank 0's values at `step`, from the latest (attempt, segment) that trained it; None if not stored."""
    query = (
        select(Metric.values)
        .where(Metric.job_id == job_id, Metric.step == step, Metric.rank == 0)
        .order_by(Metric.attempt.desc(), Metric.segment.desc())
        .limit(1)
    )
    values = session.scalar(query)
    return dict(values) if values is not None else None


def list_checkpoints(session: Session, job_id: int) -> list[Checkpoint]:
    """A job's checkpoints by step (all of them: kept, being deleted and deleted)."""
    get_job(session, job_id)
    query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step, Checkpoint.id)
    return list(session.scalars(query))


def retention_due(session: Session, *, now: datetime, limit: int) -> list[int]:
    """Jobs whose checkpoints a retention pass has work with: new ones to judge, or deletions to retry
    (once their `retry_at` has passed). One query on an index: settled rows are not read."""
    query = (
        select(Checkpoint.job_id)
        .where(
            Checkpoint.retention_due.is_(True),
            or_(Checkpoint.retry_at.is_(None), Checkpoint.retry_at <= now),
        )
        .group_by(Checkpoint.job_id)
        .order_by(Checkpoint.job_id)
        .limit(limit)
    )
    return list(session.scalars(query))


def live_checkpoints(session: Session, job_id: int) -> list[Checkpoint]:
    """A job's checkpoints that are still in storage, wholly or partly (kept or deleting)."""
    query = (
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.state != CheckpointState.DELETED)
        .order_by(Checkpoint.step, Checkpoint.id)
    )
    return list(session.scalars(query))


def checkpoint_deleted(session: Session, checkpoint_id: int, *, now: datetime) -> bool:
    """deleting -> deleted, now that its folder is gone from storage; False if it was not deleting."""
    done = session.execute(
        update(Checkpoint)
        .where(Checkpoint.id == checkpoint_id, Checkpoint.state == CheckpointState.DELETING)
        .values(
            state=CheckpointState.DELETED,
            retention_due=False,
            delete_attempts=Checkpoint.delete_attempts + 1,
            last_error=None,
            retry_at=None,
            deleted_at=now,
        )
        .returning(Checkpoint.id)
    ).first()
    return done is not None


def checkpoint_delete_failed(session: Session, checkpoint_id: int, *, error: str, retry_at: datetime) -> None:
    """A deletion that failed stays `deleting`, to be tried again from `retry_at`."""
    session.execute(
        update(Checkpoint)
        .where(Checkpoint.id == checkpoint_id, Checkpoint.state == CheckpointState.DELETING)
        .values(delete_attempts=Checkpoint.delete_attempts + 1, last_error=error, retry_at=retry_at)
    )


# -- what the streams (api.routes.streams) read: rows added after a cursor, by row id ------------------
# Row ids of one job's events and metrics grow in commit order: every writer of them holds the job's
# row lock (`get_job(for_update=True)`) or SQLite's single writer, so reading `id > cursor` misses none.


def events_after(session: Session, job_id: int, *, after_id: int, limit: int) -> list[JobEvent]:
    query = (
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.id > after_id)
        .order_by(JobEvent.id)
        .limit(limit)
    )
    return list(session.scalars(query))


def metrics_after(
    session: Session, job_id: int, *, after_id: int, limit: int, rank: int | None = None
) -> tuple[list[Metric], int]:
    """Up to `limit` points stored after row `after_id` (of one `rank`, or all), those that count (no
    newer attempt or segment trained their step and rank yet), by step then rank; and the last row id
    read (the new cursor)."""
    ranks = [Metric.rank == rank] if rank is not None else []
    ids = list(
        session.scalars(
            select(Metric.id)
            .where(Metric.job_id == job_id, Metric.id > after_id, *ranks)
            .order_by(Metric.id)
            .limit(limit)
        )
    )
    if not ids:
        return [], after_id
    newer = aliased(Metric)
    superseded = (
        select(newer.id)
        .where(
            newer.job_id == Metric.job_id,
            newer.step == Metric.step,
            newer.rank == Metric.rank,
            or_(
                newer.attempt > Metric.attempt,
                and_(newer.attempt == Metric.attempt, newer.segment > Metric.segment),
            ),
        )
        .exists()
    )
    query = (
        select(Metric)
        .where(Metric.job_id == job_id, Metric.id >= ids[0], Metric.id <= ids[-1], ~superseded, *ranks)
        .order_by(Metric.step, Metric.rank, Metric.attempt, Metric.segment)
    )
    return list(session.scalars(query)), ids[-1]


def count_metrics_after(session: Session, job_id: int, *, after_id: int, rank: int) -> tuple[int, int]:
    """How many points of `rank` are stored after row `after_id`, and the last one's row id."""
    count, last = session.execute(
        select(func.count(), func.max(Metric.id)).where(
            Metric.job_id == job_id, Metric.id > after_id, Metric.rank == rank
        )
    ).one()
    return int(count), int(last) if last is not None else after_id


def jobs_to_export(session: Session, *, ended_after: datetime) -> list[Job]:
    """The jobs whose metrics may still change: those that started and did not end, and those that
    ended after `ended_after`."""
    query = select(Job).where(
        Job.attempt > 0,
        or_(Job.state.in_(ACTIVE_STATES), Job.finished_at > ended_after),
    )
    return list(session.scalars(query.order_by(Job.id)))


def stream_cursor(session: Session, job_id: int) -> tuple[int, int]:
    """The newest event row and metric row of a job (0 without any): a stream resumed from here sends
    only what is stored later."""
    event_id = session.scalar(select(func.max(JobEvent.id)).where(JobEvent.job_id == job_id))
    metric_id = session.scalar(select(func.max(Metric.id)).where(Metric.job_id == job_id))
    return event_id or 0, metric_id or 0


def failure_history(session: Session, *, now: datetime, limit: int = 1000) -> tuple[int, float]:
    """Failures of the `limit` most recent jobs that ran, and the seconds they ran (first start to end,
    or to `now`): the cluster's observed failure rate, for the planner's MTBF (service.planning.measured)."""
    rows = session.execute(
        select(Job.failures, Job.started_at, Job.finished_at)
        .where(Job.started_at.is_not(None))
        .order_by(Job.id.desc())
        .limit(limit)
    ).all()
    failures, running_s = 0, 0.0
    for count, started_at, finished_at in rows:
        end = finished_at or now
        failures += count or 0
        assert started_at is not None  # the query asks for it
        running_s += max(0.0, (_aware(end) - _aware(started_at)).total_seconds())
    return failures, running_s


def observe_spot_nodes(
    session: Session,
    *,
    alive: Collection[str],
    departed: Mapping[str, str],
    idle: Collection[str],
    now: datetime,
) -> list[SpotNode]:
    """Note that the spot nodes `alive` are seen at `now`, and mark those seen before that are gone as
    left: an interruption, unless it is one of the nodes Ray retired as `idle` (an autoscaler's
    scale-down). `departed`: Ray's message on each dead node. Returns the nodes that left now."""
    if alive:
        rows = [{"node_id": node_id, "first_seen_at": now, "last_seen_at": now} for node_id in alive]
        insert = _insert(session)(SpotNode)
        session.execute(
            insert.on_conflict_do_update(
                index_elements=["node_id"], set_={"last_seen_at": insert.excluded.last_seen_at}
            ),
            rows,
        )
    gone = list(
        session.scalars(
            select(SpotNode).where(SpotNode.left_at.is_(None), SpotNode.node_id.not_in(list(alive)))
        )
    )
    for node in gone:
        said = departed.get(node.node_id, "")
        node.left_at = now
        node.interrupted = node.node_id not in idle
        node.reason = said or "it left the cluster (Ray reports it no more)"
    return gone


def spot_history(session: Session, *, limit: int = 1000) -> tuple[int, float]:
    """Interruptions of the `limit` spot nodes seen last, and the seconds they were seen for: the
    observed interruption rate per node (service.planning.measured)."""
    interrupted, seen_s = 0, 0.0
    rows = session.execute(
        select(SpotNode.interrupted, SpotNode.first_seen_at, SpotNode.last_seen_at)
        .order_by(SpotNode.last_seen_at.desc())
        .limit(limit)
    )
    for was_interrupted, first, last in rows:
        interrupted += bool(was_interrupted)
        seen_s += max(0.0, (_aware(last) - _aware(first)).total_seconds())
    return interrupted, seen_s


def _aware(value: datetime) -> datetime:
    # SQLite gives back naive datetimes (stored as UTC).
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


# -- API tokens (service.auth): only hashes are stored -------------------------------------------------


def auth_required(session: Session) -> bool:
    return bool(session.scalar(select(AuthState.required).where(AuthState.id == 1)))


def require_auth(session: Session, *, reason: str) -> None:
    """From now on every request needs a token (service.auth); nothing in the service unsets it."""
    state = session.get(AuthState, 1, with_for_update=True)
    if state is None:  # a database made without the migrations' row
        state = AuthState(id=1, required=False)
        session.add(state)
    if not state.required:
        state.required, state.required_since, state.reason = True, utcnow(), reason
        logger.warning(
            "authentication is required from now on (%s)", reason, extra={"action": "auth_required"}
        )


def add_token(session: Session, *, user_name: str, admin: bool, token_hash: str) -> ApiToken:
    token = ApiToken(user_name=user_name, admin=admin, token_hash=token_hash)
    session.add(token)
    session.flush()
    require_auth(session, reason="an API token was created")
    logger.info(
        "API token created",
        extra={"action": "token_created", "token": {"id": token.id, "user": user_name, "admin": admin}},
    )
    return token


def find_active_token(session: Session, *, token_hash: str) -> ApiToken | None:
    return session.scalars(
        select(ApiToken).where(ApiToken.token_hash == token_hash, ApiToken.revoked_at.is_(None))
    ).one_or_none()


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


def revoke_token(session: Session, token_id: int) -> ApiToken:
    token = session.get(ApiToken, token_id)
    if token is None:
        raise TokenNotFound(f"API token {token_id} does not exist")
    if token.revoked_at is None and token.admin:
        # Locked: two admins revoking each other at once must not both succeed.
        admins = session.scalars(
            select(ApiToken.id).where(ApiToken.admin, ApiToken.revoked_at.is_(None)).with_for_update()
        ).all()
        if list(admins) == [token.id]:
            raise LastAdminToken(
                f"API token {token_id} is the last active admin token: create another admin token "
                "first (`apiary token create NAME --admin`); auth stays required either way"
            )
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.execute(
            update(WebSession)
            .where(WebSession.token_id == token.id, WebSession.ended_at.is_(None))
            .values(ended_at=token.revoked_at)
        )
        logger.info(
            "API token revoked",
            extra={"action": "token_revoked", "token": {"id": token.id, "user": token.user_name}},
        )
    return token


# -- web sessions (service.auth): only hashes are stored ------------------------------------------------


def add_web_session(session: Session, *, token: ApiToken, session_hash: str, expires_at: datetime) -> None:
    session.add(WebSession(token_id=token.id, session_hash=session_hash, expires_at=expires_at))
    logger.info(
        "web session started",
        extra={"action": "web_login", "token": {"id": token.id, "user": token.user_name}},
    )


def find_web_session_token(session: Session, *, session_hash: str) -> ApiToken | None:
    """The unrevoked token of an unended, unexpired web session."""
    return session.scalars(
        select(ApiToken)
        .join(WebSession, WebSession.token_id == ApiToken.id)
        .where(
            WebSession.session_hash == session_hash,
            WebSession.ended_at.is_(None),
            WebSession.expires_at > utcnow(),
            ApiToken.revoked_at.is_(None),
        )
    ).one_or_none()


def end_web_session(session: Session, *, session_hash: str) -> None:
    session.execute(
        update(WebSession)
        .where(WebSession.session_hash == session_hash, WebSession.ended_at.is_(None))
        .values(ended_at=utcnow())
    )


# -- sweeps (service.sweeps) ---------------------------------------------------------------------------


def create_sweep(session: Session, *, name: str, owner: str, spec: dict[str, Any]) -> Sweep:
    sweep = Sweep(name=name, owner=owner, state="running", spec=spec)
    session.add(sweep)
    session.flush()
    logger.info("sweep created", extra={"action": "sweep_created", "sweep": {"id": sweep.id, "name": name}})
    return sweep


def get_sweep(session: Session, sweep_id: int, *, for_update: bool = False) -> Sweep:
    query = select(Sweep).where(Sweep.id == sweep_id)
    sweep = session.scalar(query.with_for_update() if for_update else query)
    if sweep is None:
        raise SweepNotFound(f"sweep {sweep_id} does not exist")
    return sweep


def list_sweeps(session: Session, *, states: Sequence[str] = (), limit: int = 100) -> list[Sweep]:
    query = select(Sweep)
    if states:
        query = query.where(Sweep.state.in_(states))
    return list(session.scalars(query.order_by(Sweep.id.desc()).limit(limit)))


def trials_of(session: Session, sweep_id: int) -> list[Job]:
    """A sweep's trials by number."""
    return list(session.scalars(select(Job).where(Job.sweep_id == sweep_id).order_by(Job.trial)))


def metric_series(session: Session, job_id: int, metric: str, *, rank: int = 0) -> list[tuple[int, float]]:
    """(step, value) of one metric of a rank, for the steps that count (the latest attempt and segment
    that trained each step), by step."""
    query = MetricsQuery(rank=rank, limit=100_000)
    return [
        (point.step, float(point.values[metric]))
        for point in list_metrics(session, job_id, query)
        if isinstance(point.values.get(metric), int | float)
    ]
