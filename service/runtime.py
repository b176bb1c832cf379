"""The running service: database, Ray, job service and scheduler, started and stopped together."""

from __future__ import annotations

import logging

from service.cluster import ClusterBackend, LocalRay, RayBackend
from service.db import Database
from service.jobs import JobService
from service.scheduler import Scheduler
from service.settings import Settings

logger = logging.getLogger(__name__)


class Runtime:
    """Start order: database (migrated) → Ray (local or `ray_address`) → scheduler loop."""

    def __init__(
        self, settings: Settings, *, backend: ClusterBackend | None = None, run_scheduler: bool = True
    ) -> None:
        self.settings = settings
        self._given_backend = backend
        self._run_scheduler = run_scheduler
        self.local_ray: LocalRay | None = None
        self.db: Database | None = None
        self._jobs: JobService | None = None
        self._scheduler: Scheduler | None = None

    @property
    def jobs(self) -> JobService:
        assert self._jobs is not None, "Runtime.start() first"
        return self._jobs

    @property
    def scheduler(self) -> Scheduler:
        assert self._scheduler is not None, "Runtime.start() first"
        return self._scheduler

    def start(self) -> None:
        self.settings.queues  # noqa: B018 (a bad APIARY_QUEUES_FILE fails here, before anything starts)
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.db = Database(self.settings.resolved_database_url)
        self.db.upgrade()
        backend = self._given_backend or self._connect_ray()
        self._jobs = JobService(db=self.db, backend=backend, settings=self.settings)
        self._scheduler = Scheduler(db=self.db, backend=backend, settings=self.settings)
        if self._run_scheduler:  # tests drive `scheduler.tick()` themselves
            self._scheduler.start()

    def _connect_ray(self) -> ClusterBackend:
        if self.settings.ray_address:
            return RayBackend(self.settings.ray_address)
        self.local_ray = LocalRay.start_or_reuse(
            data_dir=self.settings.data_dir, num_cpus=self.settings.local_ray_cpus
        )
        backend = RayBackend(self.local_ray.dashboard_url, auth_token_path=self.local_ray.auth_token_path)
        backend.wait_for_nodes()
        return backend

    def stop(self) -> None:
        if self._scheduler is not None:
            self._scheduler.stop()
        if self.local_ray is not None:
            self.local_ray.stop()
            self.local_ray = None
        if self.db is not None:
            self.db.dispose()
