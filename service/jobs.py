"""What the API asks of the domain: submit, cancel, look up, and take trainer telemetry."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from service import repository
from service.cluster import ClusterBackend
from service.db import Database
from service.errors import ClusterUnavailable, InvalidSpec, InvalidTransition, Unschedulable
from service.models import Job, JobEvent, Metric
from service.policy import Gang, capacity_text, fits_empty_cluster
from service.protocol import TelemetryBatch
from service.settings import Settings
from service.spec import BUILTIN_TRAINERS, JobSpec
from service.states import JobState
from service.storage import list_shards

logger = logging.getLogger(__name__)


def gang_for(job_id: int, spec: JobSpec, *, data_cpus: float) -> Gang:
    return Gang(
        job_id=job_id,
        queue=spec.queue.value,
        priority=spec.priority,
        # Admission needs the min gang of an elastic job (service.policy glossary: elastic gang).
        num_workers=spec.min_workers,
        max_workers=spec.max_workers if spec.is_elastic else None,
        per_worker=dict(spec.resources_per_worker),
        extra={"CPU": data_cpus},
    )


@dataclass(kw_only=True)
class JobService:
    db: Database
    backend: ClusterBackend
    settings: Settings

    def submit(self, spec: JobSpec, *, owner: str) -> Job:
        """Check that the job can run, then queue it. A refused job writes nothing."""
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
            self.stop_ray_job(submission_id)
        return job

    def stop_ray_job(self, submission_id: str) -> None:
        try:
            self.backend.stop(submission_id)
        except ClusterUnavailable as err:
            logger.error(
                "could not stop Ray job %s: %s",
                submission_id,
                err,
                extra={"action": "ray_stop_failed", "submission_id": submission_id},
            )

    def ingest(self, job_id: int, batch: TelemetryBatch) -> int:
        """Store a trainer rank's telemetry (its metric points, maybe a saved checkpoint)."""
        with self.db.session() as session:
            job = repository.get_job(session, job_id)
            stored = repository.add_metrics(session, job, attempt=batch.attempt, points=batch.points)
            if batch.checkpoint is not None:
                repository.set_checkpoint(session, job, step=batch.checkpoint.step, uri=batch.checkpoint.uri)
            return stored

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
    ) -> list[Metric]:
        with self.db.session() as session:
            return repository.list_metrics(
                session, job_id, rank=rank, min_step=min_step, max_step=max_step, limit=limit
            )

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
