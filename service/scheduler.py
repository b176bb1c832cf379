"""The scheduler loop: reconcile what Ray reports, then admit what the policy says.

Each tick:
1. reconcile: for every active job (admitted or running), read its Ray job's
   status and move the database to match (running, succeeded, failed with the
   reason from the logs; a submission Ray never saw is requeued);
2. admit: read the queue and the cluster, call the pure `policy.decide`, and for
   each admitted job commit `queued → admitted` (with a new attempt and Ray
   submission id) BEFORE submitting, so that a crash in between leaves a record
   the next reconcile repairs, never an untracked Ray job.

Waiting reasons stay in memory (`waiting_reasons`): they change every tick and
are cheap to recompute; the API shows them beside the job.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

from sqlalchemy.orm import Session

from service import repository
from service.cluster import ClusterBackend, RayJobStatus
from service.db import Database
from service.errors import ClusterUnavailable
from service.jobs import gang_for
from service.models import Job
from service.policy import decide
from service.protocol import LaunchRequest, entrypoint, launch_env, reason_from_logs
from service.settings import Settings
from service.spec import JobSpec
from service.states import JobState

logger = logging.getLogger(__name__)


def run_name(job_id: int) -> str:
    """The Ray Train run of a job; the same across attempts, so a new attempt finds its checkpoints."""
    return f"job-{job_id}"


class Scheduler:
    def __init__(self, *, db: Database, backend: ClusterBackend, settings: Settings) -> None:
        self.db = db
        self.backend = backend
        self.settings = settings
        self.waiting_reasons: dict[int, str] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the loop -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="apiary-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def wake(self) -> None:
        """Run a tick now (e.g. after a submission) instead of at the next interval."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except ClusterUnavailable as err:
                logger.warning("scheduler tick skipped: %s", err, extra={"action": "tick_skipped"})
            except Exception:
                logger.exception("scheduler tick failed", extra={"action": "tick_failed"})
            self._wake.wait(self.settings.scheduler_interval_s)
            self._wake.clear()

    def tick(self) -> None:
        self.reconcile()
        self.admit()

    # -- reconcile ------------------------------------------------------------------------------

    def reconcile(self) -> None:
        with self.db.session() as session:
            active = [(job.id, job.ray_submission_id) for job in repository.active_jobs(session)]
        for job_id, submission_id in active:
            if submission_id is None:
                continue
            info = self.backend.job_info(submission_id)
            if info.status in (RayJobStatus.PENDING,):
                continue
            reason = ""
            if info.status is RayJobStatus.FAILED:
                reason = reason_from_logs(self.backend.job_logs(submission_id), info.message)
            with self.db.session() as session:
                job = repository.get_job(session, job_id, for_update=True)
                if job.ray_submission_id == submission_id and job.state in (
                    JobState.ADMITTED,
                    JobState.RUNNING,
                ):
                    self._apply(session, job, info.status, reason)

    def _apply(self, session: Session, job: Job, status: RayJobStatus, reason: str) -> None:
        move = repository.transition
        if status is RayJobStatus.RUNNING and job.state is JobState.ADMITTED:
            move(session, job, JobState.RUNNING, actor="reconciler", reason="Ray job is running")
        elif status is RayJobStatus.SUCCEEDED:
            move(session, job, JobState.SUCCEEDED, actor="reconciler", reason="training finished")
        elif status is RayJobStatus.FAILED:
            move(session, job, JobState.FAILED, actor="reconciler", reason=reason)
        elif status is RayJobStatus.STOPPED:
            move(
                session,
                job,
                JobState.FAILED,
                actor="reconciler",
                reason="the Ray job was stopped outside Apiary",
            )
        elif status is RayJobStatus.MISSING and job.state is JobState.ADMITTED:
            move(
                session,
                job,
                JobState.QUEUED,
                actor="reconciler",
                reason="Ray never received the submission; requeued",
                ray_submission_id=None,
            )
        elif status is RayJobStatus.MISSING:
            move(
                session,
                job,
                JobState.FAILED,
                actor="reconciler",
                reason="Ray has no record of the running job (was the cluster restarted?)",
            )

    # -- admit ----------------------------------------------------------------------------------

    def admit(self) -> None:
        data_cpus = self.settings.data_cpus_per_job
        with self.db.session() as session:
            queued = [
                gang_for(job.id, JobSpec.model_validate(job.spec), data_cpus=data_cpus)
                for job in repository.queued_jobs(session)
            ]
            active = [
                gang_for(job.id, JobSpec.model_validate(job.spec), data_cpus=data_cpus)
                for job in repository.active_jobs(session)
            ]
        if not queued:
            self.waiting_reasons = {}
            return
        decisions = decide(cluster=self.backend.snapshot(), queued=queued, active=active, now=time.time())
        self.waiting_reasons = dict(decisions.waiting)
        for job_id in decisions.admit:
            self._admit_one(job_id)

    def _admit_one(self, job_id: int) -> None:
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            if job.state is not JobState.QUEUED:
                return  # cancelled meanwhile
            attempt = job.attempt + 1
            submission_id = f"apiary-job-{job.id}-attempt-{attempt}-{secrets.token_hex(3)}"
            repository.transition(
                session,
                job,
                JobState.ADMITTED,
                actor="scheduler",
                # An elastic job is admitted on its min gang (service.policy glossary: elastic gang).
                reason=(
                    f"gang of {JobSpec.model_validate(job.spec).min_workers} worker(s) fits; "
                    f"submitting attempt {attempt}"
                ),
                attempt=attempt,
                ray_submission_id=submission_id,
            )
            launch = LaunchRequest(
                job_id=job.id,
                attempt=attempt,
                spec=JobSpec.model_validate(job.spec),
                storage_uri=self.settings.resolved_storage_uri,
                run_name=run_name(job.id),
                telemetry_url=f"{self.settings.resolved_public_url}/internal/jobs/{job.id}/telemetry",
                data_cpus=self.settings.data_cpus_per_job,
                s3_endpoint_url=self.settings.s3_endpoint_url,
                data_trace_dir=str(self.settings.data_trace_dir) if self.settings.data_trace_dir else None,
            )
        env_vars = {
            **launch_env(launch),
            # S3 credentials for the driver, the Train workers and the Ray Data tasks, on every node.
            # They go in the runtime_env only, never in the launch request (which Ray Train logs and
            # stores) nor in any log line here.
            **self.settings.job_aws_env(),
        }
        try:
            self.backend.submit(submission_id=submission_id, entrypoint=entrypoint(), env_vars=env_vars)
        except Exception as err:
            with self.db.session() as session:
                job = repository.get_job(session, job_id, for_update=True)
                if job.state is JobState.ADMITTED:
                    repository.transition(
                        session,
                        job,
                        JobState.FAILED,
                        actor="scheduler",
                        reason=f"Ray refused the submission: {err}",
                    )
            return
        with self.db.session() as session:
            cancelled = repository.get_job(session, job_id).state is JobState.CANCELLED
        if cancelled:  # cancelled between admission and submission: the cancel found no Ray job to stop
            self.backend.stop(submission_id)
