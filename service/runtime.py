"""The running service: database, Ray, job service and scheduler, started and stopped together."""

from __future__ import annotations

import logging
import threading

from service import costs
from service.auth import Auth
from service.cluster import (
    LOCAL_RAY_TOKEN_FILE,
    ClusterBackend,
    CurrentBackend,
    LocalRay,
    RayBackend,
    auth_env,
    pid_running,
    token_auth_env,
)
from service.contract.errors import ClusterUnavailable
from service.drains import DrainService
from service.jobs import JobService
from service.observability import Metrics
from service.scheduling.scheduler import Scheduler
from service.settings import Settings, secret_value
from service.store.db import Database
from service.sweeps import SweepRunner, SweepService
from service.tracking import Exporter

logger = logging.getLogger(__name__)


class Runtime:
    """Start order: database (waited for, then migrated; only checked with `migrate_on_start` off) →
    Ray (local or `ray_address`) → scheduler loop.

    A local Ray that this service started and that dies is started again (`local_ray_check_s`): its
    jobs' Ray jobs are gone with it, and the scheduler recovers them from their checkpoints on the
    new one. `drain()` is the first half of a clean stop of a service that owns its local Ray: the
    running jobs checkpoint and go back to the queue, so the next start resumes them.
    """

    def __init__(
        self, settings: Settings, *, backend: ClusterBackend | None = None, run_scheduler: bool = True
    ) -> None:
        self.settings = settings
        self._given_backend = backend
        self._run_scheduler = run_scheduler
        self.metrics = Metrics()  # this service's own registry (`GET /metrics`)
        self.local_ray: LocalRay | None = None
        self.db: Database | None = None
        self._jobs: JobService | None = None
        self._auth: Auth | None = None
        self._scheduler: Scheduler | None = None
        self._backend: CurrentBackend | None = None
        self._exporter: Exporter | None = None
        self._sweeps: SweepService | None = None
        self._sweep_runner: SweepRunner | None = None
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def jobs(self) -> JobService:
        assert self._jobs is not None, "Runtime.start() first"
        return self._jobs

    @property
    def backend(self) -> CurrentBackend:
        assert self._backend is not None, "Runtime.start() first"
        return self._backend

    @property
    def auth(self) -> Auth:
        assert self._auth is not None, "Runtime.start() first"
        return self._auth

    @property
    def drains(self) -> DrainService:
        assert self.db is not None, "Runtime.start() first"
        return DrainService(db=self.db, backend=self.backend)

    @property
    def scheduler(self) -> Scheduler:
        assert self._scheduler is not None, "Runtime.start() first"
        return self._scheduler

    def start(self) -> None:
        self.settings.queues  # noqa: B018 (a bad APIARY_QUEUES_FILE fails here, before anything starts)
        costs.check_at_start(self.settings.price_signal)  # and a bad APIARY_PRICE_SIGNAL file
        # The data dir holds the database, Ray's token and logs, checkpoints: its owner's alone.
        self.settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.settings.data_dir.chmod(0o700)
        self.db = Database(self.settings.resolved_database_url, pool_size=self.settings.database_pool_size)
        self.db.wait(self.settings.database_wait_s)
        if self.settings.migrate_on_start:
            self.db.upgrade()
        else:  # a deployment's own step (`apiary db upgrade`) migrated, or must have
            self.db.require_head()
        backend = self._backend = CurrentBackend(self._given_backend or self._connect_ray())
        self._auth = Auth(db=self.db, settings=self.settings)
        self._auth.fail_closed(host=self.settings.host)
        self._jobs = JobService(db=self.db, backend=backend, settings=self.settings, metrics=self.metrics)
        self._scheduler = Scheduler(db=self.db, backend=backend, settings=self.settings, metrics=self.metrics)
        self.metrics.watch_database(self._jobs.gauges)
        if self._run_scheduler:  # tests drive `scheduler.tick()` themselves
            self._scheduler.start()
        scheduler = self._scheduler
        self._exporter = Exporter.from_settings(
            self.settings, db=self.db, metrics=self.metrics, is_leader=lambda: scheduler.is_leader
        )
        if self._exporter is not None and self._run_scheduler:
            self._exporter.start()
        self._sweeps = SweepService(db=self.db, jobs=self._jobs)
        self._sweep_runner = SweepRunner(
            db=self.db,
            jobs=self._jobs,
            is_leader=lambda: scheduler.is_leader,
            interval_s=self.settings.sweep_interval_s,
            wake=scheduler.wake,
        )
        if self._run_scheduler:
            self._sweep_runner.start()
        if self.local_ray is not None:
            self._watchdog = threading.Thread(
                target=self._watch_local_ray, name="apiary-ray-watch", daemon=True
            )
            self._watchdog.start()

    def _connect_ray(self) -> ClusterBackend:
        if self.settings.ray_address:
            return RayBackend(
                self.settings.ray_address,
                auth_token=secret_value(self.settings.ray_auth_token),
                gcs_address=self.settings.ray_gcs_address,
            )
        self.local_ray = LocalRay.start_or_reuse(
            data_dir=self.settings.data_dir,
            num_cpus=self.settings.local_ray_cpus,
            withheld=self.settings.local_ray_withheld_env(),
        )
        backend = RayBackend(
            self.local_ray.dashboard_url,
            auth_token_path=self.local_ray.auth_token_path,
            gcs_address=self.local_ray.gcs_address,
        )
        backend.wait_for_nodes()
        return backend

    def _watch_local_ray(self) -> None:
        while not self._stopping.wait(self.settings.local_ray_check_s):
            cluster = self.local_ray
            if cluster is None or pid_running(cluster.pid):
                continue
            logger.error(
                "the local Ray (pid %s) is gone: starting a new one; its jobs are recovered from their "
                "checkpoints",
                cluster.pid,
                extra={"action": "ray_lost"},
            )
            cluster.stop(timeout_s=0)  # whatever of its process group is left
            try:
                backend = self._connect_ray()
            except ClusterUnavailable as err:
                logger.error(
                    "could not start the local Ray again: %s", err, extra={"action": "ray_restart_failed"}
                )
                continue
            assert self._backend is not None and self._scheduler is not None
            self._backend.switch(backend)
            self._scheduler.wake()

    def drain(self) -> int:
        """Checkpoint and requeue the running jobs before a clean stop, if this service owns its local
        Ray (whose stop would kill them); returns how many were asked. Another replica's or an
        external cluster's jobs keep running."""
        if self.local_ray is None or self._scheduler is None:
            return 0
        return self._scheduler.drain(timeout_s=self.settings.queues.preempt_grace_s + 15)

    @property
    def sweeps(self) -> SweepService:
        assert self._sweeps is not None, "Runtime.start() first"
        return self._sweeps

    @property
    def sweep_runner(self) -> SweepRunner:
        """Starts and prunes the sweeps' trials (service.sweeps); tests call its `tick()`."""
        assert self._sweep_runner is not None, "Runtime.start() first"
        return self._sweep_runner

    @property
    def exporter(self) -> Exporter | None:
        """What sends metrics to TensorBoard and MLflow (service.tracking); None with both off."""
        return self._exporter

    def stop(self) -> None:
        self._stopping.set()
        if self._scheduler is not None:
            self._scheduler.stop()
        if self._exporter is not None:
            self._exporter.stop()
        if self._sweep_runner is not None:
            self._sweep_runner.stop()
        if self.local_ray is not None:
            self.local_ray.stop()
            self.local_ray = None
        if self.db is not None:
            self.db.dispose()


def ray_client_env(settings: Settings) -> dict[str, str]:
    """What Ray's clients in this process need in the environment for the cluster's token auth. Ray
    fixes its auth mode when it is first imported: a command that imports Ray before the runtime starts
    (`apiary serve` routes Ray's loggers first) puts this in the environment before it does."""
    if settings.ray_address:
        token = secret_value(settings.ray_auth_token)
        return token_auth_env(token) if token else {}
    return auth_env(settings.data_dir / LOCAL_RAY_TOKEN_FILE)
