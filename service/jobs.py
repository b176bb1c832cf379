"""What the API asks of the domain: submit, cancel, preempt, look up, see the queues, and take trainer
telemetry."""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from service import logs, repository
from service.cluster import ClusterBackend, stop_job
from service.db import Database
from service.errors import ClusterUnavailable, InvalidSpec, InvalidTransition, Unschedulable
from service.models import Checkpoint, Job, JobEvent, Metric
from service.policy import ClusterSnapshot, Gang, capacity_text, fits_empty_cluster
from service.protocol import GROUP_STARTED, TelemetryBatch, TelemetryReply
from service.queues import QueueConfig
from service.settings import Settings
from service.spec import BUILTIN_TRAINERS, JobSpec, Queue
from service.states import JobState, StopReason
from service.storage import list_shards

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


def _resumed_from(batch: TelemetryBatch) -> int | None:
    """The step a worker-group start resumed from: its start event, else the step before its first point."""
    for event in batch.events:
        if event.kind == GROUP_STARTED:
            return event.step
    return min(point.step for point in batch.points) - 1 if batch.points else None


def gang_for(
    job_id: int, spec: JobSpec, *, data_cpus: float, owner: str = "", submitted_at: float = 0.0
) -> Gang:
    return Gang(
        job_id=job_id,
        queue=spec.queue.value,
        priority=spec.priority,
        # Admission needs the min gang of an elastic job (service.policy glossary: elastic gang).
        num_workers=spec.min_workers,
        max_workers=spec.max_workers if spec.is_elastic else None,
        per_worker=dict(spec.resources_per_worker),
        extra={"CPU": data_cpus},
        owner=owner,
        submitted_at=submitted_at,
        max_runtime_s=spec.max_runtime_s,
    )


@dataclass(kw_only=True)
class JobService:
    db: Database
    backend: ClusterBackend
    settings: Settings

    def submit(self, spec: JobSpec, *, owner: str) -> Job:
        """Check that the job can run, then queue it. A refused job writes nothing.

        The stored spec is what runs: a job without `max_runtime_s` gets its queue's default.
        """
        spec = self._apply_queue(spec)
        self._check_trainer(spec)
        list_shards(
            spec.dataset.uri, data_format=spec.dataset.format, s3_endpoint_url=self.settings.s3_endpoint_url
        )
        self._check_fits(spec)
        with self.db.session() as session:
            return repository.create_job(session, spec=spec, owner=owner)

    def cancel(self, job_id: int, *, actor: str = "user") -> Job:
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            if job.state.is_terminal:
                raise InvalidTransition(f"job {job_id} is already {job.state.value}")
            submission_id = job.ray_submission_id if job.state is not JobState.QUEUED else None
            repository.transition(
                session, job, JobState.CANCELLED, actor=actor, reason=f"cancelled by {actor}"
            )
        if submission_id:
            stop_job(self.backend, submission_id)
        return job

    def preempt(self, job_id: int, *, actor: str) -> Job:
        """Tell a running job to checkpoint and stop; it goes back to the queue in its place."""
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            if job.state is not JobState.RUNNING:
                raise InvalidTransition(
                    f"job {job_id} is {job.state.value}: only a running job can be preempted"
                )
            return repository.request_stop(
                session, job, why=StopReason.USER, actor=actor, reason=f"preempted by {actor}"
            )

    def ingest(self, job_id: int, batch: TelemetryBatch) -> TelemetryReply:
        """Store a trainer rank's telemetry (its metric points, maybe a saved checkpoint); the reply
        tells the rank whether to checkpoint and stop."""
        with self.db.session() as session:
            # Locked: two ranks' first posts after a restart must count it once.
            job = repository.get_job(session, job_id, for_update=True)
            current = batch.attempt == job.attempt
            if current:
                repository.note_segment(
                    session, job, segment=batch.segment, resumed_from=_resumed_from(batch)
                )
            current = current and batch.segment >= (job.segment or 0)
            stored = repository.add_metrics(
                session,
                job,
                attempt=batch.attempt,
                segment=batch.segment,
                points=batch.points,
                current=current,
            )
            if current and batch.status is not None:
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
            # Only the attempt that was told to stop: an older attempt's late post changes nothing.
            stop = job.state is JobState.PREEMPTING and batch.attempt == job.attempt
            # A rank of an attempt that was given up (its driver died, the job was resubmitted) may
            # outlive it for a while: it must not go on writing checkpoints beside the new attempt.
            superseded = batch.attempt < job.attempt or job.state.is_terminal
            return TelemetryReply(stored=stored, stop=stop, superseded=superseded)

    def queues(self, *, limit: int = 100, offset: int = 0) -> list[QueueView]:
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
            in_use: dict[str, dict[str, float]] = {queue.value: {} for queue in Queue}
            for job in repository.active_jobs(session):
                gang = gang_for(
                    job.id, JobSpec.model_validate(job.spec), data_cpus=self.settings.data_cpus_per_job
                )
                for key, amount in gang.totals.items():
                    in_use[job.queue][key] = in_use[job.queue].get(key, 0.0) + amount
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
                    )
                )
            return views

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

    def list_metrics(
        self,
        job_id: int,
        *,
        rank: int | None = None,
        min_step: int | None = None,
        max_step: int | None = None,
        limit: int = 10_000,
        only_counted: bool = True,
        every: int | None = None,
        points: int | None = None,
    ) -> list[Metric]:
        with self.db.session() as session:
            return repository.list_metrics(
                session,
                job_id,
                rank=rank,
                min_step=min_step,
                max_step=max_step,
                limit=limit,
                only_counted=only_counted,
                every=every,
                points=points,
            )

    def list_checkpoints(self, job_id: int) -> list[Checkpoint]:
        with self.db.session() as session:
            return repository.list_checkpoints(session, job_id)

    def log_source(self, job_id: int, *, attempt: int | None = None) -> logs.LogSource:
        """Where the log of an attempt (default: the latest) is (service.logs)."""
        return logs.find_source(self.db, self.backend, job_id, attempt=attempt)

    def read_logs(self, source: logs.LogSource, *, tail: int | None = None) -> str:
        return logs.read(self.backend, source, tail=tail)

    def follow_logs(
        self, source: logs.LogSource, *, tail: int | None = None, poll_s: float = 1.0
    ) -> Iterator[str]:
        return logs.follow(self.backend, source, tail=tail, poll_s=poll_s)

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
        if queue.max_runtime_s is not None and (spec.max_runtime_s or math.inf) > queue.max_runtime_s:
            raise InvalidSpec(
                f"queue {spec.queue.value} takes jobs of at most max_runtime_s {queue.max_runtime_s:g}: "
                "ask for less or use the full-scale queue",
                field="max_runtime_s",
            )
        return spec

    def _check_trainer(self, spec: JobSpec) -> None:
        if spec.trainer in BUILTIN_TRAINERS:
            return
        module = spec.trainer.split(":", 1)[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise InvalidSpec(
                f"trainer module {module!r} cannot be imported in Apiary's environment", field="trainer"
            )

    def _check_fits(self, spec: JobSpec) -> None:
        try:
            cluster = self.backend.snapshot()
        except ClusterUnavailable as err:
            # Queue anyway: the scheduler admits it once the cluster is back.
            logger.warning("cannot check capacity at submission: %s", err)
            return
        gang = gang_for(0, spec, data_cpus=self.settings.data_cpus_per_job)
        if not fits_empty_cluster(cluster, gang):
            raise Unschedulable(
                f"the job needs {spec.min_workers} worker(s) x {spec.resources_per_worker} "
                f"plus {self.settings.data_cpus_per_job:g} CPU for data loading, but the cluster has "
                f"{capacity_text(cluster)}: use fewer workers or smaller resources_per_worker",
                field="num_workers",
            )
