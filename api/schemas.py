"""Request and response schemas, one per direction. The request body of POST /jobs is `JobSpec`.

The SDK (api.client) returns these same models, so this module loads without SQLAlchemy or FastAPI."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from service.contract.queues import QueueConfig
from service.contract.spec import MAX_PRIORITY, Bool, Float, Int, JobSpec, Queue
from service.contract.states import CheckpointState, JobState

if TYPE_CHECKING:  # the SDK (api.client) reads these schemas without the database's modules
    from service.jobs import Comparison, QueuesOverview, QueueView, SpotView
    from service.profiles import Profile
    from service.store.models import ApiToken, Checkpoint, CodePackage, Job, JobEvent, Metric
    from service.sweeps import SweepView, Trial


class JobUpdate(BaseModel):
    """PATCH /jobs/{id} (admins): what to change; a field left out stays as it is."""

    model_config = ConfigDict(extra="forbid")

    queue: Queue | None = Field(default=None, description="Move a queued job to this queue.")
    priority: Int | None = Field(
        default=None, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="The job's new priority."
    )


def _utc(value: datetime) -> datetime:
    # SQLite hands back the UTC times it stored without their offset; RFC 3339 (JSON) needs one.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_utc)]


class JobPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    queue: str
    priority: int
    owner: str
    state: JobState
    attempt: int
    spec: JobSpec
    ray_submission_id: str | None
    latest_checkpoint: str | None
    latest_checkpoint_step: int | None
    message: str | None
    queue_position: int | None = Field(description="Place in its queue while queued (1 = next).")
    waiting_reason: str | None = Field(
        description="Why it is not running yet, from the last scheduling pass."
    )
    eta_at: UtcDatetime | None = Field(
        description="When it is expected to start (an estimate), while queued."
    )
    latest_step: int | None
    stop_requested: str | None = Field(
        description="preempted | user | max_runtime | shutdown | lost_capacity | pruned | plateau, while "
        "preempting."
    )
    preemptions: int
    ranks: dict[str, dict[str, Any]] | None = Field(
        description="Each rank of the running worker group: step, phase, node, when last heard from "
        "(seen), its own work per step (own_s), whether it is a straggler, what its process uses "
        "(system: CPU, memory, GPU, data and network bytes) and the figures it stands out in (outliers)."
    )
    restarts: int = Field(description="Worker-group restarts inside Ray Train (a worker died).")
    failures: int = Field(
        description="Failures counted against the spec's max_failures: restarts, lost drivers and Ray jobs."
    )
    # Defaults: a server from before the cost ledger sends none of these.
    resource_hours: float = Field(
        default=0.0, description="GPU-hours its gang has held so far (CPU-hours for a job without GPUs)."
    )
    priced_hours: float = Field(
        default=0.0, description="The part of resource_hours that the price signal priced."
    )
    cost: float = Field(
        default=0.0,
        description="What those hours cost by the price signal: in its currency (cost_unit price) or kg "
        "CO2e (cost_unit carbon).",
    )
    cost_unit: str | None = Field(
        default=None, description="price | carbon; null before its ledger first ran."
    )
    created_at: UtcDatetime
    updated_at: UtcDatetime
    admitted_at: UtcDatetime | None
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None

    @classmethod
    def build(cls, job: Job) -> JobPublic:
        return cls.model_validate(job)


class CodePublic(BaseModel):
    """A code package its uploader may name in a spec's `code` (PUT /code/{sha256})."""

    model_config = ConfigDict(from_attributes=True)

    digest: str = Field(description="What a spec's `code` names: sha256:<hex>.")
    owner: str
    files: int
    size_bytes: int = Field(description="Its files' sizes, unpacked.")
    created_at: UtcDatetime

    @classmethod
    def build(cls, package: CodePackage) -> CodePublic:
        return cls(
            digest=f"sha256:{package.sha256}",
            owner=package.owner,
            files=package.files,
            size_bytes=package.size_bytes,
            created_at=package.created_at,
        )


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


class EventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    at: UtcDatetime
    from_state: JobState | None
    to_state: JobState | None
    actor: str
    reason: str

    @classmethod
    def build(cls, event: JobEvent) -> EventPublic:
        return cls.model_validate(event)


class EventsPublic(BaseModel):
    data: list[EventPublic]
    count: int


class MetricPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    rank: int
    attempt: int
    segment: int = Field(description="The worker-group start within the attempt that trained this step.")
    time: float
    values: dict[str, float]

    @classmethod
    def build(cls, metric: Metric) -> MetricPublic:
        return cls.model_validate(metric)


class MetricsPublic(BaseModel):
    data: list[MetricPublic]
    count: int


class CheckpointPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    attempt: int
    uri: str
    state: CheckpointState = Field(
        description="kept; deleting (retention decided, storage not done yet: retried); deleted."
    )
    metrics: dict[str, float] = Field(description="Rank 0's step metrics at its step ({} if not known).")
    created_at: UtcDatetime
    delete_attempts: int
    last_error: str | None = Field(description="Why the last deletion failed, or was not made.")
    deleted_at: UtcDatetime | None

    @classmethod
    def build(cls, checkpoint: Checkpoint) -> CheckpointPublic:
        return cls.model_validate(checkpoint)


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]
    count: int


class TracePublic(BaseModel):
    rank: int | None = Field(description="The rank whose trace it is (None: a file not named rank-R).")
    name: str = Field(description="rank-R.pt.trace.json: a Chrome trace (TensorBoard's profiler, Perfetto).")
    uri: str
    size_bytes: int


class ProfilePublic(BaseModel):
    """One profiled window of a job (`JobSpec.profile`): its traces and its compute/communication split."""

    run: str = Field(description="steps-A-B: the run TensorBoard's PyTorch Profiler tab lists.")
    start_step: int
    end_step: int
    folder: str = Field(description="{storage}/job-N/profile/plugins/profile/steps-A-B (file:// or s3://).")
    traces: list[TracePublic]
    summary: dict[str, Any] | None = Field(
        description="summary.json, written by rank 0: the split on average (compute_percent, "
        "communication_percent, ...) and `per_rank` (window_s, compute_s, communication_s, overlap_s, "
        "idle_s of each rank); None until written."
    )

    @classmethod
    def build(cls, profile: Profile) -> ProfilePublic:
        return cls.model_validate(profile, from_attributes=True)


class ProfilesPublic(BaseModel):
    data: list[ProfilePublic]
    count: int
    logdir: str = Field(description="The job's profile folder: `tensorboard --logdir` there shows them.")


class Health(BaseModel):
    """GET /readyz: whether the service can do its work (database and Ray reachable)."""

    status: str = Field(description="ok | degraded (Ray unreachable) | unavailable (database unreachable).")
    database: str
    ray: str


class Alive(BaseModel):
    """GET /healthz: the process lives and answers (liveness; it checks nothing else)."""

    status: str


class ErrorDetail(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorPublic(BaseModel):
    """Every error's body: a message that says what to do, and the error's name; for a refused
    field, `detail` names it (its `loc`)."""

    message: str
    error: str
    detail: list[ErrorDetail] | None = None


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route for these error statuses, each with the `ErrorPublic` body."""
    return {
        status: {
            "model": ErrorPublic,
            "description": ERROR_STATUSES[status],
            # Also on routes whose success is not JSON (logs, streams): their errors are.
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorPublic"}}},
        }
        for status in statuses
    }


ERROR_STATUSES = {
    400: "The body is not JSON.",
    401: "No API token, or an unknown or revoked one (`Authorization: Bearer ...`); for telemetry, not "
    "the report token of the job's current attempt.",
    403: "The token may not do this: only the job's owner or an admin may (admin-only routes: an admin); "
    "for telemetry, an attempt that was given up.",
    404: "No such job; for logs also: no such attempt, or Ray has forgotten that attempt's logs.",
    409: "The job is not in a state that allows this (for logs: it has not started yet).",
    413: "The request body is too large (a code package: larger than APIARY_CODE_MAX_BYTES).",
    422: "A field is invalid (its name is in `detail[].loc`), or the job could never run as written.",
    503: "The database or the Ray cluster cannot be reached right now: retry after Retry-After seconds.",
}


class QueuedJobPublic(BaseModel):
    id: int
    name: str
    owner: str
    priority: int
    position: int | None
    reason: str | None
    eta_at: UtcDatetime | None


class CostPublic(BaseModel):
    """What jobs have cost (service.costs): one owner's, or (owner null) the whole queue's."""

    owner: str | None
    unit: str | None = Field(description="price (the signal's currency) | carbon (kg CO2e).")
    resource_hours: float = Field(description="GPU-hours (CPU-hours of jobs without GPUs).")
    priced_hours: float
    cost: float


class QueueCostsPublic(BaseModel):
    total: list[CostPublic] = Field(description="The queue's, one per unit.")
    by_owner: list[CostPublic]


class QueuePublic(BaseModel):
    name: str
    config: QueueConfig
    share: dict[str, float] | None = Field(
        description="Guaranteed resources now; null while Ray is unreachable."
    )
    in_use: dict[str, float]
    borrowed: dict[str, float] = Field(description="What it uses beyond its share.")
    counts: dict[str, int] = Field(description="Unfinished jobs by state.")
    jobs: list[QueuedJobPublic] = Field(description="Queued jobs in order (the first `limit`).")
    costs: QueueCostsPublic = Field(description="What its jobs have cost, summed per owner and in all.")

    @classmethod
    def build(cls, view: QueueView) -> QueuePublic:
        return cls(
            name=view.name,
            config=view.config,
            share=view.share,
            in_use=view.in_use,
            borrowed=view.borrowed,
            counts=view.counts,
            costs=QueueCostsPublic(
                total=[CostPublic.model_validate(cost, from_attributes=True) for cost in view.cost_totals],
                by_owner=[CostPublic.model_validate(cost, from_attributes=True) for cost in view.costs],
            ),
            jobs=[
                QueuedJobPublic(
                    id=job.id,
                    name=job.name,
                    owner=job.owner,
                    priority=job.priority,
                    position=job.queue_position,
                    reason=job.waiting_reason,
                    eta_at=job.eta_at,
                )
                for job in view.line
            ],
        )


class SpotPublic(BaseModel):
    """The cluster's spot nodes (docs/spot-and-cheaper-hours.md#spot-nodes)."""

    nodes: int | None = Field(description="Alive spot nodes; null while Ray is unreachable.")
    capacity: dict[str, float] | None = Field(
        description="Their resources summed (GPU, CPU, ...); null while Ray is unreachable."
    )
    interruptions: int = Field(description="Spot nodes that left as interruptions, as the scheduler saw.")
    node_hours: float = Field(description="Hours spot nodes were seen for, all together.")
    interruptions_per_node_h: float = Field(
        description="What `checkpoint: {auto: true}` uses: observed, or the prior until an interruption."
    )
    basis: str = Field(description="Where that rate comes from.")

    @classmethod
    def build(cls, view: SpotView) -> SpotPublic:
        return cls(
            nodes=view.nodes,
            capacity=view.capacity,
            interruptions=view.interruptions,
            node_hours=view.node_hours,
            interruptions_per_node_h=view.rate_per_node_h,
            basis=view.rate_basis,
        )


class QueuesPublic(BaseModel):
    data: list[QueuePublic]
    spot: SpotPublic | None = Field(default=None, description="The cluster's spot nodes and interruptions.")

    @classmethod
    def build(cls, overview: QueuesOverview) -> QueuesPublic:
        return cls(
            data=[QueuePublic.build(view) for view in overview.queues], spot=SpotPublic.build(overview.spot)
        )


class UserPublic(BaseModel):
    """GET /me: who the request's token (or, without auth, the local user) is."""

    user: str
    admin: bool


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user: str = Field(min_length=1, max_length=128, description="Who the token is: its jobs' owner.")
    admin: Bool = False


class TokenPublic(BaseModel):
    """A token as listed: never its secret (only its hash is stored)."""

    id: int
    user: str
    admin: bool
    created_at: UtcDatetime
    revoked_at: UtcDatetime | None

    @classmethod
    def build(cls, token: ApiToken) -> TokenPublic:
        return cls(
            id=token.id,
            user=token.user_name,
            admin=token.admin,
            created_at=token.created_at,
            revoked_at=token.revoked_at,
        )


class TokenCreated(TokenPublic):
    token: str = Field(description="The secret: shown this once, send it as `Authorization: Bearer ...`.")


class TokensPublic(BaseModel):
    data: list[TokenPublic]
    count: int


class RunSummaryPublic(BaseModel):
    id: int
    name: str
    state: JobState
    latest_step: int | None
    final: dict[str, float] = Field(description="Each metric's value at its last step (rank 0).")
    final_step: dict[str, int]
    best: dict[str, float] = Field(description="Each metric's best value: lowest for *loss, else highest.")
    best_step: dict[str, int]


class ComparePublic(BaseModel):
    jobs: list[RunSummaryPublic]
    spec_diff: dict[str, list[Any]] = Field(
        description="The spec keys (dotted, e.g. config.lr) whose values differ, with each job's value."
    )

    @classmethod
    def build(cls, comparison: Comparison) -> ComparePublic:
        return cls(
            jobs=[
                RunSummaryPublic(
                    id=job.id,
                    name=job.name,
                    state=job.state,
                    latest_step=job.latest_step,
                    final=summary.final,
                    final_step=summary.final_step,
                    best=summary.best,
                    best_step=summary.best_step,
                )
                for job, summary in comparison.runs
            ],
            spec_diff=comparison.spec_diff,
        )


class TrialPublic(BaseModel):
    trial: int
    job: int
    state: JobState
    params: dict[str, Any] = Field(description="The point of the search space it runs.")
    objective: float | None = Field(description="The objective's last value (rank 0), if reported.")
    step: int | None = Field(description="Its latest step.")
    message: str | None


class SweepPublic(BaseModel):
    id: int
    name: str
    owner: str
    state: str = Field(description="running | succeeded | cancelled | failed")
    method: str
    objective: dict[str, str]
    total: int = Field(description="The trials it runs in all (max_trials, or the grid's size).")
    trials: list[TrialPublic]
    best: TrialPublic | None
    message: str | None
    spec: dict[str, Any]
    created_at: UtcDatetime
    finished_at: UtcDatetime | None

    @classmethod
    def build(cls, view: SweepView) -> SweepPublic:
        def trial(t: Trial) -> TrialPublic:
            return TrialPublic(
                trial=t.job.trial or 0,
                job=t.job.id,
                state=t.job.state,
                params=t.job.trial_params or {},
                objective=t.objective,
                step=t.job.latest_step,
                message=t.job.message,
            )

        sweep = view.sweep
        return cls(
            id=sweep.id,
            name=sweep.name,
            owner=sweep.owner,
            state=sweep.state,
            method=view.spec.method,
            objective=view.spec.objective.model_dump(),
            total=view.total,
            trials=[trial(t) for t in view.trials],
            best=trial(view.best) if view.best is not None else None,
            message=sweep.message,
            spec=sweep.spec,
            created_at=sweep.created_at,
            finished_at=sweep.finished_at,
        )


class SweepsPublic(BaseModel):
    data: list[SweepPublic]
    count: int


class NodeDrainCreate(BaseModel):
    """POST /admin/nodes/{id}/drain (admins): the node goes away in `deadline_s` (a spot notice)."""

    model_config = ConfigDict(extra="forbid")

    deadline_s: Float = Field(
        gt=0, le=7 * 24 * 3600, description="Seconds until the node goes (e.g. 120 for an AWS spot notice)."
    )
    reason: str = Field(
        default="spot interruption notice",
        max_length=500,
        pattern=r"^[^\x00-\x1f\x7f-\x9f]*$",
        description="Why, for the jobs' events and logs.",
    )


class NodeDrainPublic(BaseModel):
    node_id: str
    deadline_at: UtcDatetime = Field(description="When it goes: the earliest deadline told.")
    requested_by: str
    ray_drain: str = Field(
        description="`accepted`: Ray drains the node too (it places nothing new there); else why Ray was "
        "not asked or refused (Apiary honours the drain anyway)."
    )
