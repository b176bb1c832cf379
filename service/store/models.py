"""Database tables: jobs, their event history, per-step metrics and checkpoints; the scheduler's lease,
the owners' fair-share usage, the submissions' idempotency keys, the API tokens, and who uploaded which
code package."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from service.contract.states import CheckpointState, JobState

# Named constraints, so that migrations on SQLite and PostgreSQL agree on names.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


# Ids, steps and counters are 64-bit (migration 0007): a long run passes 2**31 steps. A primary key stays
# INTEGER on SQLite, whose INTEGER PRIMARY KEY (64-bit there anyway) is the auto-incrementing rowid.
ID = BigInteger().with_variant(Integer, "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def _state_enum(name: str) -> Enum:
    # A CHECK constraint rather than a native enum: the same migration works on
    # SQLite and PostgreSQL, and adding a state later is one constraint swap.
    return Enum(
        JobState,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda states: [state.value for state in states],
        validate_strings=True,
    )


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    queue: Mapped[str] = mapped_column(String(32))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    owner: Mapped[str] = mapped_column(String(128))
    state: Mapped[JobState] = mapped_column(_state_enum("job_state"), default=JobState.QUEUED)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    attempt: Mapped[int] = mapped_column(BigInteger, default=0)
    ray_submission_id: Mapped[str | None] = mapped_column(String(128))
    latest_checkpoint: Mapped[str | None] = mapped_column(Text)
    latest_checkpoint_step: Mapped[int | None] = mapped_column(BigInteger)
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    admitted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # What the scheduler last decided for a waiting job (service.scheduling.policy, rule 6), so that every
    # replica
    # and a restarted service show it.
    queue_position: Mapped[int | None] = mapped_column(BigInteger)
    waiting_reason: Mapped[str | None] = mapped_column(Text)
    eta_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Progress of the current attempt, from the trainers' telemetry.
    latest_step: Mapped[int | None] = mapped_column(BigInteger)
    seconds_per_step: Mapped[float | None] = mapped_column(Float)
    last_checkpoint_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # How long the trainers took to write their latest checkpoint (CheckpointRecord.write_s): with
    # `seconds_per_step`, whether the job can checkpoint before a draining node's deadline.
    checkpoint_write_s: Mapped[float | None] = mapped_column(Float)
    # Why a job was told to checkpoint and stop (StopReason), and when: see service.contract.states.
    stop_requested: Mapped[str | None] = mapped_column(String(16))
    stop_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    preemptions: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Recovery (service.contract.states): worker-group restarts inside Ray Train (`restarts`), and every
    # failure
    # counted against the spec's `max_failures` budget (`failures`: restarts, lost drivers, lost Ray
    # jobs, failed submissions). `segment` is the current attempt's worker-group start (the
    # TelemetryBatch segment); a larger one is a restart.
    restarts: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    failures: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    segment: Mapped[int | None] = mapped_column(BigInteger)
    # Set by the `worker_failed` event of the current worker group (Ray Train tears it down and starts
    # another from the latest checkpoint); cleared when the new group first reports. Meanwhile the
    # hang timeout does not run (service.scheduling.scheduler), and the dying group's late statuses are
    # ignored.
    restarting_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Each rank of the current worker group: its last RankStatus (service.contract.protocol), when the service
    # heard from it (`seen`), its own work per step (`own_s`), whether it is a straggler, and the system
    # figures it stands out in (`outliers`, service.contract.system).
    ranks: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The sha256 of the current attempt's report token (service.contract.handoff): its telemetry must carry
    # the
    # token. The token itself is only in the attempt's handoff folder in storage.
    report_token_hash: Mapped[str | None] = mapped_column(String(64))
    # The sha256 of the current attempt's fetch token, which its driver redeems once for the job's S3
    # credentials (service.jobs.JobService.redeem_credentials), and when it did: a second redemption is
    # refused. The token itself is only in the attempt's runtime_env.
    credentials_token_hash: Mapped[str | None] = mapped_column(String(64))
    credentials_redeemed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # A sweep's trial (service.sweeps): its sweep, its number there (unique: no trial starts twice) and
    # the point of the search space it runs.
    sweep_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("sweeps.id", ondelete="SET NULL"))
    trial: Mapped[int | None] = mapped_column(BigInteger)
    trial_params: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Where the spec's `plateau.metric` stands (service.plateau.PlateauState): what the next telemetry
    # post is judged against.
    plateau: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The cost ledger (service.costs): the GPU-hours (CPU-hours without GPUs) its gang has held, the part
    # of them the price signal priced, their cost in `cost_unit` (price | carbon: kg CO2e), and when the
    # ledger was last brought up to date.
    resource_hours: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    priced_hours: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    cost: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    cost_unit: Mapped[str | None] = mapped_column(String(16))
    cost_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    events: Mapped[list[JobEvent]] = relationship(
        back_populates="job", order_by="JobEvent.id", cascade="all, delete-orphan"
    )

    __table_args__ = (
        Index("ix_jobs_state_queue_priority", "state", "queue", "priority"),
        Index("ix_jobs_ray_submission_id", "ray_submission_id", unique=True),
        Index("ix_jobs_sweep_trial", "sweep_id", "trial", unique=True),
    )


class Sweep(Base):
    """A search over a base job's config (service.contract.sweep); its trials are jobs (`Job.sweep_id`)."""

    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    owner: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16))  # running | succeeded | cancelled
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    best_job_id: Mapped[int | None] = mapped_column(BigInteger)
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_sweeps_state", "state"),)


class JobEvent(Base):
    """One state transition (or notable fact) of a job: who did what, and why."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(ID, primary_key=True)
    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    from_state: Mapped[JobState | None] = mapped_column(_state_enum("job_event_from_state"))
    to_state: Mapped[JobState | None] = mapped_column(_state_enum("job_event_to_state"))
    actor: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text)

    job: Mapped[Job] = relationship(back_populates="events")


class Metric(Base):
    """One rank's values at one step of one worker-group start (`segment`) of one attempt.

    A restarted group replays the steps since its checkpoint: the replay is a new segment, and the
    points of the run that counted are, for each step, those of the latest (attempt, segment).
    """

    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(ID, primary_key=True)
    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(BigInteger)
    segment: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    step: Mapped[int] = mapped_column(BigInteger)
    rank: Mapped[int] = mapped_column(BigInteger)
    time: Mapped[float] = mapped_column(Float)
    values: Mapped[dict[str, float]] = mapped_column(JSON)

    __table_args__ = (
        # A trainer re-posts a batch whose answer it lost: the same point twice is one row.
        UniqueConstraint("job_id", "attempt", "segment", "rank", "step", name="uq_metrics_point"),
        Index("ix_metrics_job_step", "job_id", "step"),
    )


class Checkpoint(Base):
    """One checkpoint a job's trainers reported (persisted in storage), and its retention."""

    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(ID, primary_key=True)
    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger)
    uri: Mapped[str] = mapped_column(Text)
    # Rank 0's step metrics at `step` (what keep_best ranks by); {} while not known.
    metrics: Mapped[dict[str, float]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    state: Mapped[CheckpointState] = mapped_column(
        Enum(
            CheckpointState,
            name="checkpoint_state",
            native_enum=False,
            create_constraint=True,
            length=16,
            values_callable=lambda states: [state.value for state in states],
            validate_strings=True,
        ),
        default=CheckpointState.KEPT,
    )
    # Whether a retention pass has work with this row: a new checkpoint to judge, or a deletion to
    # (re)try once `retry_at` has passed. Indexed, so that a pass finds its jobs without a scan.
    retention_due: Mapped[bool] = mapped_column(Boolean, default=True, index=True)
    delete_attempts: Mapped[int] = mapped_column(BigInteger, default=0)
    last_error: Mapped[str | None] = mapped_column(Text)
    retry_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        # A re-posted report (its answer was lost) is the same checkpoint.
        UniqueConstraint("job_id", "uri", name="uq_checkpoints_job_uri"),
        Index("ix_checkpoints_job_step", "job_id", "step"),
    )


class SchedulerLease(Base):
    """Who schedules: one row per lease, held by one service process until `expires_at`."""

    __tablename__ = "scheduler_leases"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class SpotNode(Base):
    """A spot node the scheduler has seen (service.scheduling.scheduler), for the observed interruption
    rate that `checkpoint: {auto: true}` uses (service.planning.measured): node-hours seen, and whether
    it left the cluster as an interruption (not an idle scale-down)."""

    __tablename__ = "spot_nodes"

    node_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    first_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    left_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), index=True)
    interrupted: Mapped[bool] = mapped_column(Boolean, default=False)
    reason: Mapped[str | None] = mapped_column(Text)  # why it left, as Ray said it (or that it vanished)


class OwnerUsage(Base):
    """An owner's recent use of the cluster, for fair share: dominant-share-seconds, decaying."""

    __tablename__ = "owner_usage"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    usage: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class IdempotencyKey(Base):
    """An `Idempotency-Key` a client sent with `POST /jobs`, and the job that request created.

    The primary key (owner, key) is what makes a retried submission race-safe: two requests with one
    key insert their rows in the same transaction as their jobs, and the second one's insert fails, so
    only one job is ever committed (service.jobs). A key older than `Settings.idempotency_key_ttl_s`
    no longer matches, and the scheduler prunes it.
    """

    __tablename__ = "idempotency_keys"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    # sha256 of the submitted spec (canonical JSON): the same key with another body is refused.
    request_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)


class AuthState(Base):
    """Whether every request needs an API token (service.auth): one row (id 1, written by the migration),
    set once and never unset by the service, so that revoking tokens cannot open a server again."""

    __tablename__ = "auth_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    required: Mapped[bool] = mapped_column(Boolean, default=False)
    required_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    reason: Mapped[str | None] = mapped_column(Text)  # what made it required first


class ApiToken(Base):
    """An API token (service.auth): only the SHA-256 of its secret is stored, never the secret."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_name: Mapped[str] = mapped_column(String(128))  # the owner of the jobs this token submits
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class CodePackage(Base):
    """A job code package that `owner` uploaded (service.code): the package itself is stored once, by its
    sha256, in storage; a row per owner says who may name it in a spec (a digest seen on another's job
    page gives no one that job's code)."""

    __tablename__ = "code_packages"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)  # unpacked
    files: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebSession(Base):
    """A web view's login (service.auth): the browser's cookie holds a random session id, of which only
    the SHA-256 is stored; it ends at logout, at `expires_at`, or when its token is revoked."""

    __tablename__ = "web_sessions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    session_hash: Mapped[str] = mapped_column(String(64), unique=True)
    token_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class NodeDrain(Base):
    """A Ray node that an admin (a termination handler) said is going away: `POST
    /admin/nodes/{id}/drain` (service.drains). Ray's own drains are read from Ray each tick; this row
    makes one told to Apiary count on every replica, even when Ray could not be asked."""

    __tablename__ = "node_drains"

    node_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    deadline_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    reason: Mapped[str] = mapped_column(Text)
    requested_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
