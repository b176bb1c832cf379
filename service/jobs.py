"""What the API asks of the domain: submit, cancel, preempt, look up, see the queues, and take trainer
telemetry.

Idempotent submission (`submit_idempotent`): a request with an `Idempotency-Key` stores the key, per
owner, with a hash of its spec, in the same transaction as the job it creates. A repeat of the key
within `Settings.idempotency_key_ttl_s` gets that job back (`replayed`) if its spec is the same, and
`IdempotencyKeyReused` if not. Two requests racing with one key both try to insert it: the key's
primary key lets one commit, the other's transaction (its job with it) rolls back and it answers with
the winner's job. So a job is persisted once per key, whatever the retries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import auth, compare, logs, plateau, profiles, tracking
from service.allowlists import OwnPlaces, check_dataset, check_trainer
from service.auth import User
from service.capacity import (
    MARKS,
    ClusterSnapshot,
    capacity_text,
    fits_empty_cluster,
    gang_for,
    spot_capacity,
)
from service.cluster import ClusterBackend, local_ray_temp_dir, stop_job
from service.code import CodeStore, Incoming, sha256_of, trainer_in_code
from service.contract.code import mib, read_package, shadowed
from service.contract.errors import (
    AttemptSuperseded,
    ClusterUnavailable,
    CodeError,
    CodeUploadOff,
    CredentialsRedeemed,
    CredentialsRefused,
    IdempotencyKeyReused,
    InvalidReport,
    InvalidSpec,
    InvalidTransition,
    JobNotFound,
    ReportRefused,
    Unschedulable,
)
from service.contract.handoff import (
    handoff_uri,
    is_own_checkpoint,
    job_prefix,
    read_token,
    token_hash,
    token_matches,
)
from service.contract.protocol import (
    GROUP_STARTED,
    WORKER_FAILED,
    LaunchPointer,
    MetricPoint,
    TelemetryBatch,
    TelemetryReply,
)
from service.contract.queues import QueueConfig
from service.contract.spec import JobSpec, PlateauAction, PlateauSpec, Queue, SpotUse
from service.contract.states import JobState, StopReason
from service.contract.storage import S3Credentials, node_local
from service.contract.trainer_kind import TrainerKind, TrainerNotDefined, kind_of_trainer, kind_refusal
from service.costs import OwnerCost, sum_costs
from service.observability import Gauges, Metrics, RankFigures, RunningJob
from service.planning.formulas import Plan
from service.planning.measured import measured_plan, observed_spot_rate
from service.settings import Settings
from service.store import repository
from service.store.db import Database
from service.store.models import Checkpoint, CodePackage, IdempotencyKey, Job, JobEvent, Metric, utcnow

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class QueueView:
    """One queue as GET /queues shows it."""

    name: str
    config: QueueConfig
    share: dict[str, float] | None  # None while the cluster cannot be read
    in_use: dict[str, float]
    borrowed: dict[str, float]
    counts: dict[str, int]  # state -> jobs
    line: list[Job]  # queued jobs in order, the first `limit`
    costs: list[OwnerCost]  # what its jobs have cost, per owner (service.costs)
    cost_totals: list[OwnerCost]  # and in all, per unit


@dataclass(frozen=True, kw_only=True)
class SpotView:
    """The cluster's spot nodes as GET /queues, the web view and /metrics show them."""

    nodes: int | None  # alive now; None while the cluster cannot be read
    capacity: dict[str, float] | None  # their resources, summed
    interruptions: int  # spot nodes that left as interruptions, as the scheduler saw them
    node_hours: float  # the hours spot nodes were seen for
    rate_per_node_h: float  # what `checkpoint: {auto: true}` uses: observed, or the prior
    rate_basis: str


@dataclass(frozen=True, kw_only=True)
class QueuesOverview:
    queues: list[QueueView]
    spot: SpotView


@dataclass(frozen=True, kw_only=True)
class Submission:
    """What `POST /jobs` made of a request: its job, and whether an earlier request with the same
    Idempotency-Key created it (`replayed`: nothing was written this time)."""

    job: Job
    replayed: bool


def _installed_kind(trainer: str) -> TrainerKind | None:
    """The kind of a trainer installed beside the service, from its module's source (imports nothing);
    None when the source cannot tell. Raises `InvalidSpec` (field `trainer`) when it lacks the name."""
    try:
        return kind_of_trainer(trainer)
    except TrainerNotDefined:
        module, _, name = trainer.partition(":")
        raise InvalidSpec(
            f"trainer {trainer!r}: module {module!r} has no {name!r}", field="trainer"
        ) from None


def _check_kind(spec: JobSpec, kind: TrainerKind | None) -> None:
    """Raise `InvalidSpec` naming the first field that a trainer of `kind` cannot honor
    (`service.contract.trainer_kind.kind_refusal`); an unknown kind is the job's driver's to check."""
    given = {"checkpoint.async"} if "async_" in spec.checkpoint.model_fields_set else set()
    refused = kind_refusal(spec, kind, given=given)
    if refused is not None:
        raise InvalidSpec(f"{refused.field}: {refused.message}", field=refused.field)


def _resumed_from(batch: TelemetryBatch) -> int | None:
    """The step a worker-group start resumed from: its start event, else the step before its first point."""
    for event in batch.events:
        if event.kind == GROUP_STARTED:
            return event.step
    return min(point.step for point in batch.points) - 1 if batch.points else None


def _judge_plateau(session: Session, job: Job, points: Sequence[MetricPoint]) -> None:
    """Judge rank 0's points of a running job's `plateau.metric` (service.plateau): a plateau is an
    `anomaly` event, and with `on_plateau: stop` the job is asked to checkpoint and stop."""
    if job.spec.get("plateau") is None:
        return
    rule = PlateauSpec.model_validate(job.spec["plateau"])
    values = [
        (point.step, point.values[rule.metric])
        for point in points
        if point.rank == 0 and rule.metric in point.values
    ]
    if not values:
        return
    before = plateau.PlateauState.model_validate(job.plateau) if job.plateau is not None else None
    state, found = plateau.judge(rule, before, values)
    if state is not None and state != before:
        job.plateau = state.model_dump(mode="json")
    if found is None:
        return
    action = PlateauAction(job.spec.get("on_plateau", PlateauAction.WARN))
    repository.record_event(
        session, job, actor="service", reason=f"{found.describe()} (on_plateau: {action}) [anomaly]"
    )
    logger.info("job %s: %s", job.id, found.describe(), extra={"action": "plateau", "job": {"id": job.id}})
    if action is PlateauAction.STOP:
        # The scheduler ends it `succeeded`, with this message, once it has stopped (_finish_stop).
        job.message = f"stopped early: {found.describe()} (on_plateau: stop)"
        repository.request_stop(
            session,
            job,
            why=StopReason.PLATEAU,
            actor="service",
            reason=f"{rule.metric} plateaued (on_plateau: stop): checkpoint and stop",
        )


def request_hash(spec: JobSpec) -> str:
    """What identifies a submission's body: the sha256 of its spec as canonical JSON (so the same spec
    sent with its keys in another order, or a default written out, is the same request)."""
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def in_use_by_queue(jobs: Iterable[Job], *, data_cpus: float) -> dict[str, dict[str, float]]:
    """queue -> resource -> what `jobs` (the active ones) hold, with their data-loading CPUs."""
    in_use: dict[str, dict[str, float]] = {queue.value: {} for queue in Queue}
    for job in jobs:
        gang = gang_for(job.id, JobSpec.model_validate(job.spec), data_cpus=data_cpus)
        held = in_use.setdefault(job.queue, {})
        for key, amount in gang.totals.items():
            if key not in MARKS:
                held[key] = held.get(key, 0.0) + amount
    return in_use


@dataclass(frozen=True, kw_only=True)
class JobCode:
    """A job's code package, as `GET /jobs/{id}/code` gives it back."""

    digest: str
    chunks: Iterator[bytes]


@dataclass(frozen=True)
class JobHistory:
    job: Job
    checkpoints: list[Checkpoint]
    events: list[JobEvent]
    cursor: tuple[int, int]  # (event id, metric id): a stream resumed from here sends what is newer


@dataclass(frozen=True)
class JobChanges:
    events: list[JobEvent]
    metrics: list[Metric]
    metric_id: int  # the last metric row read (the stream's new cursor)
    job: Job


@dataclass(frozen=True)
class Comparison:
    runs: list[tuple[Job, compare.MetricSummary]]
    spec_diff: dict[str, list[Any]]  # dotted spec key -> each job's value, where they differ


REPORT_REFUSED = (
    "job {job_id}: telemetry is taken only from its current attempt, with that attempt's report token "
    "(Authorization: Bearer)"
)
GIVEN_UP_HASHES_KEPT = 10_000
CREDENTIALS_REFUSED = (
    "job {job_id}: credentials go only to its current attempt's driver, with that attempt's fetch token "
    "(Authorization: Bearer)"
)
JOB_ENDED = "job {job_id} ended ({state}): its report tokens write nothing more; exit"
# A finished job's report token is dead: a post after the job ended changes nothing. For this long
# after the end, a post of its final attempt with that attempt's token is answered 202 (`stored: 0`,
# `superseded: true`: exit) rather than 403: it can only be a late copy of the final report (a post
# whose answer the rank's `close()` did not wait for, then sent again and delivered: trainers.
# telemetry), since a job's Ray job, and so its end here, comes only after its ranks' last posts.
# Later, and for any other post, 403 `AttemptSuperseded` (before the body is read, api.gate).
FINAL_REPORT_GRACE_S = 120.0


def _final_report_window_over(job: Job) -> bool:
    if not job.state.is_terminal:
        return False
    if job.finished_at is None:
        return True
    finished = job.finished_at if job.finished_at.tzinfo is not None else job.finished_at.replace(tzinfo=UTC)
    return (datetime.now(UTC) - finished).total_seconds() > FINAL_REPORT_GRACE_S


@dataclass(kw_only=True)
class JobService:
    db: Database
    backend: ClusterBackend
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    # (job, attempt) -> the SHA-256 of a given-up attempt's report token (None: it has none), read from
    # its handoff folder once: a post with a wrong token must not cost a storage read each time.
    _given_up_hashes: dict[tuple[int, int], str | None] = field(default_factory=dict, repr=False)

    @property
    def code(self) -> CodeStore:
        return CodeStore.of(self.settings)

    def _own_places(self) -> OwnPlaces:
        """What no dataset may be read from (service.allowlists): the data dir but its datasets/ folder,
        and the local Ray's temp folder."""
        data_dir = self.settings.data_dir
        return OwnPlaces(
            folders=(str(data_dir), str(local_ray_temp_dir(data_dir).parent)),
            data_folders=(str(self.settings.datasets_dir),),
        )

    def submit(self, spec: JobSpec, *, by: User) -> Job:
        """Check that the job can run, then queue it, owned by `by`. A refused job writes nothing.

        The stored spec is what runs: a job without `max_runtime_s` gets its queue's default. A
        priority above `Settings.user_max_priority` is an admin's to give (service.auth).
        """
        return self.submit_idempotent(spec, by=by, key=None).job

    def submit_idempotent(self, spec: JobSpec, *, by: User, key: str | None) -> Submission:
        """`submit`, once per `key` (see the module docstring); `key=None` always creates a job.

        A replay answers with the job as it is now, without checking the spec again (its dataset
        may have moved since: the job exists, and the first request was the one checked)."""
        owner = by.name
        digest = request_hash(spec)
        expired_before = self._keys_expire_before()
        stale = False  # an expired row of the key is there: the insert replaces it
        if key is not None:
            with self.db.session() as session:
                found = repository.find_idempotency_key(session, owner=owner, key=key, since=None)
                if found is not None and repository.is_live(found, since=expired_before):
                    return self._replay(session, found, digest)
                stale = found is not None
        spec, package = self.checked(spec, by=by)
        try:
            with self.db.session() as session:
                job = repository.create_job(session, spec=spec, owner=owner)
                if package is not None:
                    code = package[1]
                    repository.record_event(
                        session,
                        job,
                        actor=owner,
                        reason=f"code {spec.code} ({code.files} files, {mib(code.size_bytes)})",
                    )
                if key is not None:
                    repository.add_idempotency_key(
                        session,
                        owner=owner,
                        key=key,
                        request_hash=digest,
                        job_id=job.id,
                        expired_before=expired_before if stale else None,
                    )
                return Submission(job=job, replayed=False)
        except IntegrityError:
            if key is None:
                raise
            # A concurrent request with this key committed first: its job is the one.
            with self.db.session() as session:
                found = repository.find_idempotency_key(
                    session, owner=owner, key=key, since=self._keys_expire_before()
                )
                if found is None:
                    raise
                logger.info(
                    "a concurrent submission with the same idempotency key won; answering with its job",
                    extra={"action": "idempotent_race", "job": {"id": found.job_id}},
                )
                return self._replay(session, found, digest)

    def checked(self, spec: JobSpec, *, by: User) -> tuple[JobSpec, tuple[Path, CodePackage] | None]:
        """What `submit` checks before it writes anything: priority, queue limits (the spec as stored,
        with its queue's defaults), code, trainer, datasets, size. Returns the spec to store and its
        code package; raises what the API maps to 4xx."""
        self._check_priority(spec)
        _check_deadline(spec, now=time.time())
        auth.check_priority(by, spec.priority, ceiling=self.settings.user_max_priority)
        spec = self._apply_queue(spec)
        package = self._code_of(spec, by=by)
        # A trainer from the job's own code is the owner's to run: the allowlist is for what is
        # installed beside the service.
        from_code, kind = trainer_in_code(package[0], spec.trainer) if package is not None else (False, None)
        if not from_code:
            check_trainer(spec.trainer, allowed_modules=self.settings.trainer_module_prefixes)
            kind = _installed_kind(spec.trainer)
        _check_kind(spec, kind)
        if spec.dataset is not None:
            check_dataset(
                spec.dataset.uri,
                roots=self.settings.resolved_data_roots,
                data_format=spec.dataset.format,
                s3_endpoint_url=self.settings.s3_endpoint_url,
                timeout_s=self.settings.dataset_check_timeout_s,
                own=self._own_places(),
            )
        if spec.eval is not None:
            check_dataset(
                spec.eval.dataset.uri,
                roots=self.settings.resolved_data_roots,
                data_format=spec.eval.dataset.format,
                s3_endpoint_url=self.settings.s3_endpoint_url,
                timeout_s=self.settings.dataset_check_timeout_s,
                own=self._own_places(),
                field="eval.dataset.uri",
            )
        self._check_fits(spec)
        return spec, package

    def _code_of(self, spec: JobSpec, *, by: User) -> tuple[Path, CodePackage] | None:
        """The package a spec names, checked: code uploads on, the submitter's own upload (an admin
        may name anyone's), in storage, and nothing in it that shadows Apiary."""
        if spec.code is None:
            return None
        self.require_code_upload()
        sha256 = sha256_of(spec.code)
        with self.db.session() as session:
            found = repository.find_code_package(session, sha256=sha256, owner=None if by.admin else by.name)
        if found is None:
            raise CodeError(
                f"{spec.code} is not a code package you uploaded: upload it first (apiary submit --code "
                "DIR, or PUT /code/<sha256>)"
            )
        try:
            path = self.code.local_path(sha256)
        except OSError as err:
            raise ClusterUnavailable(f"the code package cannot be read from storage: {err}") from err
        contents = read_package(path, max_bytes=self.settings.code_max_bytes)
        if (why := shadowed(contents.names)) is not None:
            raise CodeError(why)
        return path, found

    def require_code_upload(self) -> None:
        """403 (`CodeUploadOff`) unless this service takes code with a job (APIARY_CODE_UPLOAD)."""
        if not self.settings.code_upload:
            raise CodeUploadOff(
                "this service takes no code with a job (APIARY_CODE_UPLOAD=false): name a trainer "
                "installed in its image instead"
            )

    def add_code(self, incoming: Incoming, *, sha256: str, by: User) -> tuple[CodePackage, bool]:
        """Store an uploaded package (once per content) and record that `by` uploaded it; True when
        this is `by`'s first upload of it. Refused (`CodeError`, 422) when its bytes are not `sha256`,
        it is not a package within the limit, or it holds a top-level package named like Apiary's."""
        self.require_code_upload()
        incoming.close()
        if incoming.sha256 != sha256:
            raise CodeError(
                f"the body's sha256 is {incoming.sha256}, not {sha256}: the upload was cut or changed",
                field="sha256",
            )
        contents = read_package(incoming.path, max_bytes=self.settings.code_max_bytes)
        if (why := shadowed(contents.names)) is not None:
            raise CodeError(why)
        try:
            self.code.put(sha256, incoming.path)
        except OSError as err:
            raise ClusterUnavailable(f"the code package cannot be written to storage: {err}") from err
        try:
            with self.db.session() as session:
                created = repository.add_code_package(
                    session,
                    sha256=sha256,
                    owner=by.name,
                    size_bytes=contents.size_bytes,
                    files=len(contents.names),
                )
        except IntegrityError:  # the same owner's concurrent upload of the same bytes
            created = False
        with self.db.session() as session:
            found = repository.find_code_package(session, sha256=sha256, owner=by.name)
            assert found is not None
        if created:
            logger.info(
                "code package stored",
                extra={"action": "code_stored", "code": {"sha256": sha256, "owner": by.name}},
            )
        return found, created

    def job_code(self, job_id: int, *, by: User) -> JobCode:
        """A job's code package: its owner's or an admin's to read."""
        with self.db.session() as session:
            job = repository.get_job(session, job_id)
            auth.require_owner_or_admin(by, owner=job.owner, job_id=job_id, action="read the code of")
            digest = JobSpec.model_validate(job.spec).code
        if digest is None:
            raise JobNotFound(f"job {job_id} was submitted without code")
        sha256 = sha256_of(digest)
        try:
            chunks = self.code.chunks(sha256)
            first = next(chunks, b"")
        except OSError as err:
            raise ClusterUnavailable(f"the code package cannot be read from storage: {err}") from err

        def all_chunks() -> Iterator[bytes]:
            yield first
            yield from chunks

        return JobCode(digest=digest, chunks=all_chunks())

    def _check_priority(self, spec: JobSpec) -> None:
        low, high = self.settings.priority_min, self.settings.priority_max
        if not low <= spec.priority <= high:
            raise InvalidSpec(
                f"priority must be between {low} and {high} on this service, got {spec.priority}",
                field="priority",
            )

    def _replay(self, session: Session, found: IdempotencyKey, digest: str) -> Submission:
        if found.request_hash != digest:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {found.key!r} was used for a different job spec (job {found.job_id}) "
                f"within the last {self.settings.idempotency_key_ttl_s:g} s: send the same spec to get "
                "that job, or use a new key for a new job"
            )
        return Submission(job=repository.get_job(session, found.job_id), replayed=True)

    def _keys_expire_before(self) -> datetime:
        return utcnow() - timedelta(seconds=self.settings.idempotency_key_ttl_s)

    def cancel(self, job_id: int, *, by: User) -> Job:
        """Cancel a queued or running job (its owner or an admin)."""
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            auth.require_owner_or_admin(by, owner=job.owner, job_id=job_id, action="cancel")
            if job.state.is_terminal:
                raise InvalidTransition(f"job {job_id} is already {job.state.value}")
            submission_id = job.ray_submission_id if job.state is not JobState.QUEUED else None
            repository.transition(
                session, job, JobState.CANCELLED, actor=by.name, reason=f"cancelled by {by.name}"
            )
        if submission_id:
            stop_job(self.backend, submission_id)
        return job

    def resume(self, job_id: int, *, by: User) -> Job:
        """Queue a pruned sweep trial again; it resumes from its checkpoint (its owner or an admin)."""
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            auth.require_owner_or_admin(by, owner=job.owner, job_id=job_id, action="resume")
            if job.state is not JobState.PRUNED:
                raise InvalidTransition(
                    f"job {job_id} is {job.state.value}: only a pruned trial can be resumed"
                )
            step = job.latest_checkpoint_step
            where = f"its checkpoint at step {step}" if step is not None else "step 0 (it has no checkpoint)"
            return repository.transition(
                session,
                job,
                JobState.QUEUED,
                actor=by.name,
                reason=f"resumed by {by.name}: queued again, from {where}",
                finished_at=None,
                message=None,
                ray_submission_id=None,
            )

    def preempt(self, job_id: int, *, by: User) -> Job:
        """Tell a running job to checkpoint and stop; it goes back to the queue in its place (its owner
        or an admin)."""
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            auth.require_owner_or_admin(by, owner=job.owner, job_id=job_id, action="preempt")
            if job.state is not JobState.RUNNING:
                raise InvalidTransition(
                    f"job {job_id} is {job.state.value}: only a running job can be preempted"
                )
            job = repository.request_stop(
                session, job, why=StopReason.USER, actor=by.name, reason=f"preempted by {by.name}"
            )
        self.metrics.job_preempted(queue=job.queue, by="user")
        return job

    def update(
        self, job_id: int, *, by: User, queue: Queue | None = None, priority: int | None = None
    ) -> Job:
        """Change a job's priority (until it ends) or queue (while it waits): an admin's decision.
        A new queue's limits apply as at submission (`_apply_queue`)."""
        auth.require_admin(by, action="change a job's queue or priority")
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            if job.state.is_terminal:
                raise InvalidTransition(f"job {job_id} is already {job.state.value}")
            spec = JobSpec.model_validate(job.spec)
            if queue is not None and queue.value != job.queue:
                if job.state is not JobState.QUEUED:
                    raise InvalidTransition(
                        f"job {job_id} is {job.state.value}: only a queued job can move to another queue"
                    )
                spec = self._apply_queue(spec.model_copy(update={"queue": queue}))
            if priority is not None:
                spec = spec.model_copy(update={"priority": priority})
            return repository.update_job(
                session,
                job,
                queue=queue.value if queue is not None else None,
                priority=priority,
                spec=spec,
                actor=by.name,
            )

    def ingest(self, job_id: int, batch: TelemetryBatch, *, token: str | None) -> TelemetryReply:
        """Store a trainer rank's telemetry (its metric points, maybe a saved checkpoint); the reply
        tells the rank whether to checkpoint and stop.

        Only the job's current attempt may report, with its report token (service.contract.handoff), and only
        a
        checkpoint under the job's own storage prefix: anything else is refused and changes nothing
        (`AttemptSuperseded` for an attempt that was given up, `ReportRefused`, `InvalidReport`). An
        attempt that was given up but shows its own token keeps its points, and nothing else, and is
        told it was superseded."""
        with self.db.session() as session:
            # Locked: two ranks' first posts after a restart must count it once.
            job = repository.get_job(session, job_id, for_update=True)
            if job.state.is_terminal:
                self._check_after_the_end(job, batch, token=token)
                return TelemetryReply(stored=0, stop=False, superseded=True)
            # A given-up attempt's points only: the next attempt may resume from a checkpoint that
            # one wrote after it was given up, and then nobody trains those steps again. No
            # checkpoint, status or event of it counts, and the reply tells it to exit.
            given_up = self._given_up_attempt(job, batch, token=token)
            restarted = False
            if not given_up:
                self._check_report(job, batch, token=token)
                restarts = job.restarts
                resumed_from = _resumed_from(batch)
                repository.note_segment(session, job, segment=batch.segment, resumed_from=resumed_from)
                restarted = job.restarts > restarts
            current = not given_up and batch.segment >= (job.segment or 0)
            stored = repository.add_metrics(
                session,
                job,
                attempt=batch.attempt,
                segment=batch.segment,
                points=batch.points,
                current=current,
            )
            if given_up:
                self.metrics.points_ingested(stored)
                return TelemetryReply(stored=stored, stop=False, superseded=True)
            if any(event.kind == WORKER_FAILED for event in batch.events):
                repository.note_group_failed(session, job)
            # The failed group's ranks may post once more while Ray Train tears them down.
            dying = job.restarting_since is not None and batch.segment <= (job.segment or 0)
            if current and not dying and batch.status is not None:
                repository.note_rank_status(
                    session,
                    job,
                    batch.status,
                    points=batch.points,
                    now=time.time(),
                    straggler_factor=self.settings.straggler_factor,
                )
            for event in batch.events:
                repository.record_event(
                    session, job, actor=f"rank {event.rank}", reason=f"{event.message} [{event.kind}]"
                )
            if batch.checkpoint is not None:
                repository.set_checkpoint(
                    session, job, step=batch.checkpoint.step, uri=batch.checkpoint.uri, attempt=batch.attempt
                )
                if batch.checkpoint.write_s is not None:
                    job.checkpoint_write_s = batch.checkpoint.write_s
            if current and job.state is JobState.RUNNING:
                _judge_plateau(session, job, batch.points)
            stop = job.state is JobState.PREEMPTING
            # A rank of a job that ended (cancelled, failed) may outlive it for a while: it must not go
            # on writing checkpoints.
            superseded = job.state.is_terminal
        self.metrics.points_ingested(stored)
        if restarted:
            self.metrics.job_restarted(queue=job.queue)
        return TelemetryReply(stored=stored, stop=stop, superseded=superseded)

    def check_report_token(self, job_id: int, token: str | None) -> None:
        """Before a telemetry post's body is read (api.gate): `ReportRefused` unless `token` is the
        report token of the job's current attempt or of one it gave up, so that a post without it costs
        one lookup whatever its size. `ingest` then checks the body against the token."""
        if token is None:
            raise ReportRefused(REPORT_REFUSED.format(job_id=job_id))
        with self.db.session() as session:
            job = repository.get_job(session, job_id)
            attempt, current = job.attempt, job.report_token_hash
            if _final_report_window_over(job):
                raise AttemptSuperseded(JOB_ENDED.format(job_id=job_id, state=job.state.value))
        if not token_matches(token, current) and not any(
            token_matches(token, self._given_up_hash(job_id, earlier))
            for earlier in range(attempt - 1, 0, -1)
        ):
            raise ReportRefused(REPORT_REFUSED.format(job_id=job_id))

    def redeem_credentials(self, job_id: int, *, attempt: int, token: str | None) -> S3Credentials:
        """The job's S3 credentials, for the driver of its current `attempt`, in exchange for that
        attempt's fetch token (service.contract.handoff), once. `CredentialsRefused` (401) without the
        token; `CredentialsRedeemed` (403) for an attempt that was given up, and for the attempt's own
        token once the job ended or the token was redeemed: a replay (of a token copied from Ray's
        logs), recorded as an event of the job."""
        refused: str | None = None
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            if token is not None and attempt < job.attempt:
                # Its hash is gone with it: nothing to check the token against, nor to record.
                raise CredentialsRedeemed(
                    f"job {job_id}: attempt {attempt} was given up for attempt {job.attempt}: its fetch "
                    "token is dead"
                )
            if attempt != job.attempt or not token_matches(token, job.credentials_token_hash):
                raise CredentialsRefused(CREDENTIALS_REFUSED.format(job_id=job_id))
            if job.state.is_terminal:
                refused = f"the job ended ({job.state.value})"
            elif job.credentials_redeemed_at is not None:
                refused = f"it was redeemed at {job.credentials_redeemed_at:%Y-%m-%d %H:%M:%S}"
            else:
                job.credentials_redeemed_at = utcnow()
            reason = (
                f"credentials refused to a fetch token of attempt {attempt}: {refused}"
                if refused is not None
                else f"credentials handed to attempt {attempt}'s driver (its fetch token is now dead)"
            )
            repository.record_event(session, job, actor="control plane", reason=reason)
        if refused is not None:
            logger.warning(
                "job %s: %s", job_id, reason, extra={"action": "credentials_refused", "job_id": job_id}
            )
            raise CredentialsRedeemed(f"job {job_id}: {reason}")
        credentials = self.settings.job_s3_credentials()
        return credentials if credentials is not None else S3Credentials()

    def _check_after_the_end(self, job: Job, batch: TelemetryBatch, *, token: str | None) -> None:
        """A post to a job that ended changes nothing. Its final attempt's own post within
        FINAL_REPORT_GRACE_S of the end passes (the caller answers it as delivered: see the constant);
        anything else is refused."""
        if batch.attempt == job.attempt and token_matches(token, job.report_token_hash):
            if not _final_report_window_over(job):
                return
        elif batch.attempt >= job.attempt:
            raise ReportRefused(REPORT_REFUSED.format(job_id=job.id))
        raise AttemptSuperseded(JOB_ENDED.format(job_id=job.id, state=job.state.value))

    def _given_up_hash(self, job_id: int, attempt: int) -> str | None:
        key = (job_id, attempt)
        if key not in self._given_up_hashes:
            pointer = LaunchPointer(
                job_id=job_id,
                attempt=attempt,
                handoff_uri=handoff_uri(self.settings.resolved_storage_uri, job_id=job_id, attempt=attempt),
                s3_endpoint_url=self.settings.s3_endpoint_url,
            )
            try:
                issued: str | None = token_hash(read_token(pointer))
            except ValueError:
                issued = None
            if len(self._given_up_hashes) >= GIVEN_UP_HASHES_KEPT:
                self._given_up_hashes.clear()
            self._given_up_hashes[key] = issued
        return self._given_up_hashes[key]

    def _given_up_attempt(self, job: Job, batch: TelemetryBatch, *, token: str | None) -> bool:
        """True for a post of an attempt that was given up which carries that attempt's own report token
        (read from its handoff folder once: rare, only such posts pay it)."""
        if batch.attempt >= job.attempt or token is None:
            return False
        return token_matches(token, self._given_up_hash(job.id, batch.attempt))

    def _check_report(self, job: Job, batch: TelemetryBatch, *, token: str | None) -> None:
        if batch.attempt < job.attempt:
            # A rank of an attempt that was given up (its driver died, the job was resubmitted) may
            # outlive it for a while: it must not go on writing checkpoints beside the new attempt.
            raise AttemptSuperseded(
                f"attempt {batch.attempt} of job {job.id} was given up for attempt {job.attempt}: exit"
            )
        if batch.attempt != job.attempt or not token_matches(token, job.report_token_hash):
            raise ReportRefused(REPORT_REFUSED.format(job_id=job.id))
        storage_uri = self.settings.resolved_storage_uri
        if batch.checkpoint is not None and not is_own_checkpoint(
            batch.checkpoint.uri, storage_uri=storage_uri, job_id=job.id
        ):
            raise InvalidReport(
                f"checkpoint {batch.checkpoint.uri} is not under job {job.id}'s storage prefix "
                f"{job_prefix(storage_uri, job.id)}",
                field="checkpoint.uri",
            )

    def queues(self, *, limit: int = 100, offset: int = 0) -> list[QueueView]:
        return self.overview(limit=limit, offset=offset).queues

    def overview(self, *, limit: int = 100, offset: int = 0) -> QueuesOverview:
        """Both queues (`QueueView`) and the cluster's spot nodes (`SpotView`), from one snapshot."""
        try:
            cluster: ClusterSnapshot | None = self.backend.snapshot()
        except ClusterUnavailable:
            cluster = None
        totals: dict[str, float] = {}
        for node in cluster.nodes if cluster is not None else ():
            for key, amount in node.resources.items():
                totals[key] = totals.get(key, 0.0) + amount
        with self.db.session() as session:
            counts = repository.count_unfinished(session)
            costs: dict[str, list[OwnerCost]] = {}
            for queue_name, owner, unit, hours, priced, cost in repository.costs_by_owner(session):
                costs.setdefault(queue_name, []).append(
                    OwnerCost(owner=owner, unit=unit, resource_hours=hours, priced_hours=priced, cost=cost)
                )
            in_use = in_use_by_queue(
                repository.active_jobs(session), data_cpus=self.settings.data_cpus_per_job
            )
            views = []
            for queue in Queue:
                config = self.settings.queues.of(queue)
                share = (
                    {key: total * config.share_of(key) for key, total in totals.items()} if cluster else None
                )
                used = in_use[queue.value]
                borrowed = {
                    key: amount - (share or {}).get(key, 0.0)
                    for key, amount in used.items()
                    if share is not None and amount > share.get(key, 0.0) + 1e-9
                }
                views.append(
                    QueueView(
                        name=queue.value,
                        config=config,
                        share=share,
                        in_use=used,
                        borrowed=borrowed,
                        counts={state.value: n for (name, state), n in counts.items() if name == queue.value},
                        line=repository.waiting_line(session, queue.value, limit=limit, offset=offset),
                        costs=costs.get(queue.value, []),
                        cost_totals=sum_costs(costs.get(queue.value, [])),
                    )
                )
            return QueuesOverview(queues=views, spot=self._spot_view(session, cluster))

    def _spot_view(self, session: Session, cluster: ClusterSnapshot | None) -> SpotView:
        rate = observed_spot_rate(session, prior_per_node_h=self.settings.spot_prior_interruptions_per_node_h)
        return SpotView(
            nodes=sum(node.spot for node in cluster.nodes) if cluster is not None else None,
            capacity=spot_capacity(cluster) if cluster is not None else None,
            interruptions=rate.interruptions,
            node_hours=rate.node_hours,
            rate_per_node_h=rate.per_node_h,
            rate_basis=rate.basis,
        )

    def gauges(self) -> Gauges:
        """What `GET /metrics` reads of the database at each scrape: grouped counts and the active jobs
        (bounded by the cluster), never the metric points."""
        with self.db.session() as session:
            counts = repository.count_jobs(session)
            active = repository.active_jobs(session)
            interruptions, _ = repository.spot_history(session)
        try:
            cluster: ClusterSnapshot | None = self.backend.snapshot()
        except ClusterUnavailable:
            cluster = None  # no spot capacity series while Ray cannot be read
        workers: dict[str, int] = {}
        running = []
        for job in active:
            if job.state not in (JobState.RUNNING, JobState.PREEMPTING):
                continue
            spec = JobSpec.model_validate(job.spec)
            # An elastic job runs as many workers as report; before any report, its min gang.
            num_workers = len(job.ranks) if job.ranks else spec.min_workers
            workers[job.queue] = workers.get(job.queue, 0) + num_workers
            if job.state is JobState.RUNNING:
                running.append(
                    RunningJob(
                        job_id=job.id,
                        queue=job.queue,
                        step=job.latest_step,
                        samples_per_s=spec.batch_size * num_workers / job.seconds_per_step
                        if job.seconds_per_step and spec.batch_size is not None
                        else None,
                        ranks=[
                            RankFigures(
                                rank=int(name),
                                system=entry["system"],
                                outliers=tuple(entry.get("outliers") or ()),
                            )
                            for name, entry in (job.ranks or {}).items()
                            if entry.get("system")
                        ],
                    )
                )
        return Gauges(
            jobs=counts,
            workers=workers,
            in_use=in_use_by_queue(active, data_cpus=self.settings.data_cpus_per_job),
            running=running,
            spot_nodes=sum(node.spot for node in cluster.nodes) if cluster is not None else None,
            spot_capacity=spot_capacity(cluster) if cluster is not None else None,
            spot_interruptions=interruptions,
        )

    def get_job(self, job_id: int) -> Job:
        with self.db.session() as session:
            return repository.get_job(session, job_id)

    def list_jobs(
        self, *, states: Sequence[JobState] = (), queue: str | None = None, offset: int = 0, limit: int = 100
    ) -> tuple[list[Job], int]:
        with self.db.session() as session:
            return repository.list_jobs(session, states=states, queue=queue, offset=offset, limit=limit)

    def list_events(self, job_id: int) -> list[JobEvent]:
        with self.db.session() as session:
            return repository.list_events(session, job_id)

    def list_metrics(self, job_id: int, query: repository.MetricsQuery) -> list[Metric]:
        with self.db.session() as session:
            return repository.list_metrics(session, job_id, query)

    def job_history(self, job_id: int) -> JobHistory:
        """A job, its checkpoints and events, and the stream cursor after them, read together."""
        with self.db.session() as session:
            job = repository.get_job(session, job_id)
            return JobHistory(
                job=job,
                checkpoints=repository.list_checkpoints(session, job_id),
                events=repository.list_events(session, job_id),
                cursor=repository.stream_cursor(session, job_id),
            )

    def changes_after(
        self, job_id: int, *, event_id: int, metric_id: int, max_events: int, max_metrics: int
    ) -> JobChanges:
        """What a job stream has not sent yet: events and points stored after the cursor, then the job
        (a state that says "ended" comes with all it stored)."""
        with self.db.session() as session:
            events = repository.events_after(session, job_id, after_id=event_id, limit=max_events)
            metrics, last_metric_id = repository.metrics_after(
                session, job_id, after_id=metric_id, limit=max_metrics
            )
            return JobChanges(
                events=events,
                metrics=metrics,
                metric_id=last_metric_id,
                job=repository.get_job(session, job_id),
            )

    def plan(
        self, *, facts: dict[str, Any], spec: JobSpec | None, job_id: int | None
    ) -> tuple[Plan, dict[str, str]]:
        """`service.planning.measured.measured_plan` over this service's database and cluster."""
        with self.db.session() as session:
            return measured_plan(
                session,
                backend=self.backend,
                default_mtbf_s=self.settings.default_mtbf_s,
                facts=facts,
                spec=spec,
                job_id=job_id,
            )

    def compare(self, job_ids: Sequence[int]) -> Comparison:
        """Jobs side by side (`service.compare`): each one's final and best metrics (rank 0, the run
        that counted), and the spec keys they differ in. JobNotFound for an unknown id."""
        runs: list[tuple[Job, compare.MetricSummary]] = []
        query = repository.MetricsQuery(
            rank=0, points=compare.MAX_COMPARED_STEPS - 1, limit=compare.MAX_COMPARED_STEPS
        )
        with self.db.session() as session:
            for job_id in job_ids:
                job = repository.get_job(session, job_id)
                points = repository.list_metrics(session, job_id, query)
                runs.append((job, compare.summarize((point.step, point.values) for point in points)))
        return Comparison(runs=runs, spec_diff=compare.spec_diff([job.spec for job, _ in runs]))

    def tensorboard_logdirs(self, job_ids: Sequence[int]) -> list[str]:
        """The TensorBoard folders of these jobs (JobNotFound for an unknown one), or the storage root."""
        with self.db.session() as session:
            for job_id in job_ids:
                repository.get_job(session, job_id)
        return tracking.logdirs(self.settings, job_ids)

    def list_profiles(self, job_id: int) -> list[profiles.Profile]:
        """The job's profiles in storage (`service.profiles`); JobNotFound for an unknown job."""
        with self.db.session() as session:
            repository.get_job(session, job_id)
        return profiles.list_profiles(
            self.settings.resolved_storage_uri, job_id, s3_endpoint_url=self.settings.s3_endpoint_url
        )

    def profile_root(self, job_id: int) -> str:
        return profiles.profile_root(self.settings.resolved_storage_uri, job_id)

    def list_checkpoints(self, job_id: int) -> list[Checkpoint]:
        with self.db.session() as session:
            return repository.list_checkpoints(session, job_id)

    def log_source(self, job_id: int, *, attempt: int | None = None) -> logs.LogSource:
        """Where the log of an attempt (default: the latest) is (service.logs)."""
        return logs.find_source(self.db, self.backend, job_id, attempt=attempt)

    def read_logs(self, source: logs.LogSource, *, tail: int | None = None, raw: bool = False) -> str:
        return logs.read(self.backend, source, tail=tail, raw=raw)

    def follow_logs(
        self, source: logs.LogSource, *, tail: int | None = None, poll_s: float = 1.0, raw: bool = False
    ) -> Iterator[str]:
        return logs.follow(self.backend, source, tail=tail, poll_s=poll_s, raw=raw)

    def _apply_queue(self, spec: JobSpec) -> JobSpec:
        queue = self.settings.queues.of(spec.queue)
        if queue.max_workers_per_job is not None and spec.max_workers > queue.max_workers_per_job:
            raise InvalidSpec(
                f"queue {spec.queue.value} takes jobs of at most {queue.max_workers_per_job} workers, "
                f"this one asks for {spec.max_workers}: use fewer workers or the full-scale queue",
                field="num_workers",
            )
        if spec.max_runtime_s is None and queue.default_max_runtime_s is not None:
            spec = spec.model_copy(update={"max_runtime_s": queue.default_max_runtime_s})
        if spec.spot is None:
            spec = spec.model_copy(update={"spot": spec.spot_use})
        if queue.max_runtime_s is not None and (spec.max_runtime_s or math.inf) > queue.max_runtime_s:
            raise InvalidSpec(
                f"queue {spec.queue.value} takes jobs of at most max_runtime_s {queue.max_runtime_s:g}: "
                "ask for less or use the full-scale queue",
                field="max_runtime_s",
            )
        return spec

    def _check_fits(self, spec: JobSpec) -> None:
        try:
            cluster = self.backend.snapshot()
        except ClusterUnavailable as err:
            # Queue anyway: the scheduler admits it once the cluster is back.
            logger.warning("cannot check capacity at submission: %s", err)
            return
        if (
            spec.dataset is not None
            and len(cluster.nodes) > 1
            and not self.settings.shared_filesystem
            and node_local(spec.dataset.uri)
        ):
            raise InvalidSpec(
                f"dataset {spec.dataset.uri} is a local path and the cluster has {len(cluster.nodes)} "
                "nodes, which cannot all read it: put it in object storage (s3://...), or set "
                "APIARY_SHARED_FILESYSTEM=true on the service if it is a mount every node shares",
                field="dataset.uri",
            )
        gang = gang_for(0, spec, data_cpus=self.settings.data_cpus_per_job)
        if not fits_empty_cluster(cluster, gang):
            never = spec.spot_use is SpotUse.NEVER and any(node.spot for node in cluster.nodes)
            raise Unschedulable(
                f"the job needs {spec.min_workers} worker(s) x {spec.resources_per_worker} "
                f"plus {self.settings.data_cpus_per_job:g} CPU for data loading"
                + (" on on-demand nodes (spot: never)" if never else "")
                + f", but the cluster has {capacity_text(cluster)}: use fewer workers or smaller "
                "resources_per_worker" + (", or allow spot nodes (spot: allowed)" if never else ""),
                field="num_workers",
            )


def _check_deadline(spec: JobSpec, *, now: float) -> None:
    """A deferrable job's `finish_by` must be in the future when it is submitted."""
    deferrable = spec.deferrable
    if deferrable is not None and deferrable.finish_by is not None and deferrable.deadline(now) <= now:
        raise InvalidSpec(
            f"deferrable.finish_by: {deferrable.finish_by} has passed; give a time in the future",
            field="deferrable.finish_by",
        )
