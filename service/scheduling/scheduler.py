"""The scheduler loop: reconcile what Ray reports, enforce stops, then carry out what the policy says.

Each tick, by the one replica that holds the scheduler lease (a `scheduler_leases` row with an
expiry, renewed every tick; another replica takes over once it expires):

1. reconcile: for every active job (admitted, running or preempting), read its Ray job's status and
   move the database to match: running; succeeded; failed with the reason from the logs; a
   submission Ray never saw is requeued; a preempting job whose Ray job ended goes back to the
   queue (or fails, when it ran out of `max_runtime_s`; or succeeds, stopped early on a loss plateau);
2. enforce: a running job past its `max_runtime_s` is told to checkpoint and stop; a job told so
   `preempt_grace_s` ago that has not stopped is stopped (its event says how much work that lost);
3. schedule: read every unfinished job in one query and the cluster (its alive nodes, and what Ray
   reports in use on them: other Ray users' use is not Apiary's to admit, service.scheduling.policy);
   requeue a started job whose gang no longer fits them (a node left: `requeue_unplaceable`); honor
   node drains (service.drains: Ray's and those told to Apiary; a job with a rank on a draining node
   checkpoints at its next step boundary and is requeued, or is stopped when it cannot before the
   deadline: `honor_drains`); hold every queued job while checkpoint storage is a local path on more
   than one node; call the pure `policy.decide` on the nodes that do not drain (each queued job with
   history's estimate of its duration, each active job with its expected end: its measured pace, or
   history early on, never beyond its max_runtime_s;
   service.scheduling.estimates and service.scheduling.history; and the price signal, for which
   deferrable jobs wait: service.scheduling.deferral), then preempt (running -> preempting:
   the trainers hear it in the reply to their next telemetry post, checkpoint at the next step
   boundary and exit), admit (commit `queued -> admitted` with a new attempt and Ray submission id
   BEFORE submitting, so a crash in between leaves a record the next reconcile repairs, never an
   untracked Ray job; after submitting it checks the row again and stops its submission if a replica
   that took the lease meanwhile requeued the job, so one attempt runs at a time), and store every
   waiting job's position, reason and ETA (changed rows only, one statement); the active jobs' cost
   ledgers are brought up to date every LEDGER_EVERY_S (service.costs);
4. retain: delete the checkpoints that the jobs' `checkpoint.keep_last`/`keep_best` let go, never the
   one a job resumes from (service.scheduling.retention; only jobs with new checkpoints or deletions to
   retry);
   and, every `PRUNE_KEYS_EVERY_S`, delete the expired idempotency keys of submissions (service.jobs).

Each pass's duration, each admission's wait, each recovery and each preemption is counted in the
service's Prometheus metrics (service.observability).

Every decision is written in a transaction that first checks, with the lease row locked, that this
replica still holds the lease: two replicas never admit the same job or over-commit the cluster.
Fair share: each owner's usage (dominant-share-seconds, halving every `fair_share_half_life_s`) is
brought up to date every tick from the active jobs.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, object_session

from service.capacity import (
    ClusterSnapshot,
    Gang,
    capacity_text,
    fits_empty_cluster,
    format_resources,
    gang_for,
)
from service.cluster import ClusterBackend, RayJobStatus, retired_idle, stop_job, submission_prefix
from service.code import CodeStore, sha256_of
from service.contract.errors import ClusterUnavailable, one_line
from service.contract.handoff import Handoff, new_token, run_name, token_hash, write_handoff
from service.contract.protocol import (
    HEARTBEAT_S,
    JobFailure,
    LaunchRequest,
    code_modules,
    entrypoint,
    failure_from_logs,
    launch_env,
)
from service.contract.spec import JobSpec, SpotUse
from service.contract.states import ACTIVE_STATES, JobState, StopReason
from service.contract.storage import checkpoint_uri, node_local
from service.costs import PriceSignal, Rates, accrue
from service.drains import (
    STOP_MARGIN_S,
    Drain,
    can_checkpoint_before,
    checkpoint_needs_s,
    clock,
    drained_node,
    merge,
)
from service.observability import Metrics
from service.planning.formulas import time_to_finish_s
from service.planning.measured import observed_mtbf
from service.scheduling.deferral import WAIT_SAMPLES, RecentWaits
from service.scheduling.estimates import job_size, live_remaining_s
from service.scheduling.history import LiveHistory, to_time
from service.scheduling.policy import (
    QUEUE_ORDER,
    Decisions,
    Preemption,
    Wait,
    decayed_usage,
    decide,
    dominant_share,
)
from service.scheduling.retention import Retention
from service.settings import Settings
from service.store import repository
from service.store.db import Database
from service.store.models import Job

logger = logging.getLogger(__name__)

LEASE = "scheduler"
# The least time between the end of a pass and a pass that a wake asks for, and that time as a multiple
# of the pass's own (Scheduler._wake_gap_s).
WAKE_GAP_S = 0.25
WAKE_GAP_FACTOR = 9.0
# The spot nodes' last-seen times are written at least this often while the set does not change: the
# observed interruption rate counts node-hours to within this.
SPOT_SEEN_EVERY_S = 60.0


def _spot_nodes(cluster: ClusterSnapshot, placement: Sequence[int], gang: Gang) -> int:
    """The spot nodes among those the policy placed a gang's workers on (its extra, Ray Data's tasks, is
    not in the placement group)."""
    return len({index for index in placement[: gang.num_workers] if cluster.nodes[index].spot})


class _Facts(NamedTuple):
    """What a job's spec says beyond its gang, for the estimates of its duration."""

    name: str
    max_steps: int | None
    size: float  # `service.scheduling.estimates.job_size`


class Scheduler:
    def __init__(
        self,
        *,
        db: Database,
        backend: ClusterBackend,
        settings: Settings,
        holder: str | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.db = db
        self.backend = backend
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._keys_pruned_at: float | None = None
        self.queues = settings.queues
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.is_leader = False
        self._templates: dict[int, Gang] = {}  # what a job's (immutable) spec says of its gang
        self._facts: dict[int, _Facts] = {}
        # History's estimates of the jobs' durations (service.scheduling.history): read from the
        # database when this replica takes the lease, then fed with each job that ends.
        self.history = LiveHistory()
        # job -> (the history's version, its expected duration, its queued gang with that estimate)
        self._estimates: dict[int, tuple[int, float | None, Gang]] = {}
        self._unplaceable_since: dict[int, float] = {}  # started jobs whose gang fits no more, since
        # Node drains (service.drains): the ones last seen, why Ray's were last unreadable (said once),
        # and the attempts stopped before a drain's deadline (stopped once).
        self.drains: dict[str, Drain] = {}
        self._drains_problem: str | None = None
        self._ray_drained: set[str] = set()
        self._drain_stopped: set[str] = set()
        # The price signal (deferral, and the cost ledger), and the jobs whose ledger runs: active at the
        # last tick (service.costs).
        self.prices = PriceSignal(settings.price_signal, refresh_s=settings.price_signal_refresh_s)
        self.rates = Rates(
            unit=settings.price_signal_unit,
            gpu_power_kw=settings.gpu_power_kw,
            cpu_power_kw=settings.cpu_power_kw,
        )
        self._charging: set[int] = set()
        # Each queue's recent admission waits, whose longest sets how early a deferred job must join
        # the line (service.scheduling.deferral: expected wait): read from the database with the
        # history, then fed with each admission. A deferred job's wait counts from its window's start.
        self.waits = RecentWaits()
        self._window_at: dict[int, float] = {}
        # The spot nodes last written as seen, and when (service.store.repository.observe_spot_nodes).
        self._spot_seen: tuple[frozenset[str], float] = (frozenset(), -math.inf)
        self._spot_alive = 0  # spot nodes in the last snapshot
        # What the log last said of other Ray users' use and of Ray's pending demand (said on change).
        self._others_said = f"other Ray users hold {format_resources({})}"
        self._stop = threading.Event()
        self._draining = threading.Event()  # a clean stop is under way: admit nothing
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.retention = Retention(
            db=db,
            fenced=self._fenced,
            run_uri=lambda job_id: checkpoint_uri(
                storage_uri=settings.resolved_storage_uri, run_name=run_name(job_id), name=""
            ),
            s3_endpoint_url=settings.s3_endpoint_url,
            # Within the lease: a tick that runs past it lets another replica take over.
            max_pass_s=settings.scheduler_lease_s / 2,
        )

    # -- the loop -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="apiary-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def drain(self, *, timeout_s: float) -> int:
        """Tell every running job to checkpoint and stop, admit nothing more, and wait (up to `timeout_s`)
        until they are back in the queue; returns how many were told. For a clean stop of the service."""
        self._draining.set()
        with self.db.session() as session:
            running = [job.id for job in repository.active_jobs(session) if job.state is JobState.RUNNING]
        told = [
            job_id
            for job_id in running
            if self.request_stop(
                job_id, StopReason.SHUTDOWN, reason="the service is stopping: checkpoint and requeue"
            )
        ]
        if told:
            logger.info(
                "stopping: %d running job(s) checkpoint and go back to the queue (up to %g s)",
                len(told),
                timeout_s,
                extra={"action": "drain"},
            )
        deadline = time.monotonic() + timeout_s
        while told and time.monotonic() < deadline:
            self.wake()
            time.sleep(0.5)
            with self.db.session() as session:
                if all(repository.get_job(session, job_id).state not in ACTIVE_STATES for job_id in told):
                    break
        return len(told)

    def wake(self) -> None:
        """Run a tick now (e.g. after a submission) instead of at the next interval."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except ClusterUnavailable as err:
                logger.warning("scheduler tick skipped: %s", err, extra={"action": "tick_skipped"})
            except (OperationalError, InterfaceError) as err:
                # The database is away: every change is one transaction, so nothing half-done is left,
                # and the next pass after it returns takes up where this one could not.
                logger.warning(
                    "scheduler tick skipped: the database is unavailable (%s)",
                    one_line(err.orig or err),
                    extra={"action": "tick_skipped"},
                )
            except Exception:
                logger.exception("scheduler tick failed", extra={"action": "tick_failed"})
            ended = time.monotonic()
            if self._wake.wait(self.settings.scheduler_interval_s):
                self._stop.wait(max(0.0, ended + self._wake_gap_s(ended - started) - time.monotonic()))
            self._wake.clear()

    def _wake_gap_s(self, pass_s: float) -> float:
        """How long after a pass a wake (a submission) may start the next one. A burst of submissions
        wakes the loop once each, and one pass serves every job queued before it: passes woken back to
        back are spaced, so that they take at most a tenth of the time the burst's writes compete with,
        and never wait longer than the interval would have."""
        return min(max(WAKE_GAP_S, WAKE_GAP_FACTOR * pass_s), self.settings.scheduler_interval_s)

    def tick(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not self._hold_lease(now):
            if self.is_leader:
                logger.warning("scheduler lease lost to another replica", extra={"action": "lease_lost"})
            self.is_leader = False
            return
        if not self.is_leader:
            logger.info("this replica schedules now (%s)", self.holder, extra={"action": "lease_taken"})
            self.history.loaded = False  # it may have missed jobs that ended meanwhile: read again
        self.is_leader = True
        started = time.perf_counter()
        with self.db.session() as session:
            active = [row for row in repository.scheduling_rows(session) if row.state in ACTIVE_STATES]
            self._learn_specs(session, [row.id for row in active])
        self.reconcile(active, now)
        self.enforce(active, now)
        self.schedule(now)
        self.retention.run_pass(_utc(now))
        self._maybe_prune_keys(now)
        self.metrics.scheduler_passed(duration_s=time.perf_counter() - started)

    def _maybe_prune_keys(self, now: float) -> None:
        if self._keys_pruned_at is not None and now - self._keys_pruned_at < PRUNE_KEYS_EVERY_S:
            return
        self._keys_pruned_at = now
        before = _utc(now) - timedelta(seconds=self.settings.idempotency_key_ttl_s)
        with self.db.session() as session:
            pruned = repository.prune_idempotency_keys(session, before=before)
        if pruned:
            logger.info("pruned %d expired idempotency key(s)", pruned, extra={"action": "keys_pruned"})

    def _hold_lease(self, now: float) -> bool:
        with self.db.session() as session:
            return repository.hold_lease(
                session, name=LEASE, holder=self.holder, now=_utc(now), ttl_s=self.settings.scheduler_lease_s
            )

    def _fenced(self, session: Session) -> bool:
        """Called first in every decision's transaction: is this replica still the scheduler?"""
        return repository.owns_lease(session, name=LEASE, holder=self.holder, now=_utc(time.time()))

    # -- 1. reconcile ---------------------------------------------------------------------------

    def reconcile(self, active: Sequence[Any], now: float | None = None) -> None:
        """Move the active jobs (`repository.scheduling_rows`) to what Ray says of them."""
        now = time.time() if now is None else now
        for row in active:
            job_id, submission_id = row.id, row.ray_submission_id
            if submission_id is None:
                continue
            info = self.backend.job_info(submission_id)
            starting = row.state in STARTING_STATES
            if info.status is RayJobStatus.PENDING and not (starting and self._start_overdue(row, now)):
                continue
            if info.status is RayJobStatus.RUNNING and not starting:
                continue  # nothing to write: no transaction
            failure = None
            if info.status is RayJobStatus.FAILED:
                failure = failure_from_logs(self.backend.job_logs(submission_id), info.message)
            with self.db.session() as session:
                if not self._fenced(session):
                    return
                job = repository.get_job(session, job_id, for_update=True)
                if job.ray_submission_id != submission_id or job.state not in ACTIVE_STATES:
                    continue
                if info.status is RayJobStatus.MISSING:
                    # Ask again under the row lock: a replica that admitted the job may be submitting
                    # it right now, and it checks this row after submitting (`_submit`).
                    info = self.backend.job_info(submission_id)
                resubmit = self._apply(session, job, info.status, failure)
            if resubmit is not None:
                self.metrics.job_recovered(queue=job.queue)
                self._submit(job_id, resubmit)

    def _start_overdue(self, row: Any, now: float) -> bool:
        admitted_at = to_time(row.admitted_at)
        return admitted_at is not None and now - admitted_at >= self.settings.start_timeout_s

    def _apply(
        self, session: Session, job: Job, status: RayJobStatus, failure: JobFailure | None
    ) -> Handoff | None:
        """Write what Ray's `status` means for `job`; returns the launch of a recovery to submit."""
        move = repository.transition
        stopping = job.state is JobState.PREEMPTING
        starting = job.state in STARTING_STATES
        if status is RayJobStatus.RUNNING and starting:
            move(
                session,
                job,
                JobState.RUNNING,
                actor="reconciler",
                reason="Ray job is running"
                if job.state is JobState.ADMITTED
                else f"attempt {job.attempt} is running: recovered",
            )
        elif status is RayJobStatus.PENDING:  # starting, and overdue (reconcile)
            stop_job(self.backend, job.ray_submission_id or "")
            move(
                session,
                job,
                JobState.QUEUED,
                actor="reconciler",
                reason=f"Ray did not start attempt {job.attempt} within {self.settings.start_timeout_s:g} s "
                "(its Ray job is still pending: the cluster may lack the resources it reported); "
                "stopped it and requeued the job in its place",
                ray_submission_id=None,
            )
        elif stopping and status is not RayJobStatus.RUNNING and (failure is None or failure.retryable):
            grace_s = self.queues.preempt_grace_s
            lost = {
                RayJobStatus.SUCCEEDED: None,  # it checkpointed and stopped by itself
                RayJobStatus.STOPPED: {
                    StopReason.LOST_CAPACITY: "stopped: its gang lost a node",
                    StopReason.DRAINED: "stopped before its node's drain deadline",
                }.get(
                    StopReason(job.stop_requested or StopReason.PREEMPTED),
                    f"stopped after {grace_s:g} s without checkpointing",
                ),
                RayJobStatus.FAILED: "its Ray job failed while stopping",
                RayJobStatus.MISSING: "Ray lost its Ray job while stopping",
            }[status]
            self._finish_stop(session, job, lost=lost)
        elif status is RayJobStatus.SUCCEEDED:
            move(session, job, JobState.SUCCEEDED, actor="reconciler", reason="training finished")
        elif failure is not None and failure.retryable:
            return self._recover(
                session, job, why=f"the job's Ray job failed outside its code: {failure.reason}"
            )
        elif failure is not None:
            move(session, job, JobState.FAILED, actor="reconciler", reason=failure.reason)
        elif status is RayJobStatus.STOPPED:
            move(
                session,
                job,
                JobState.FAILED,
                actor="reconciler",
                reason="the Ray job was stopped outside Apiary",
            )
        elif status is RayJobStatus.MISSING and starting:
            move(
                session,
                job,
                JobState.QUEUED,
                actor="reconciler",
                reason="Ray never received the submission; requeued",
                ray_submission_id=None,
            )
        elif status is RayJobStatus.MISSING:
            return self._recover(
                session,
                job,
                why="Ray has no record of the running job (the cluster was restarted or lost it)",
            )
        return None

    def _recover(self, session: Session, job: Job, *, why: str) -> Handoff | None:
        """A job lost to something outside its code: resubmit it from its latest checkpoint, as a new
        attempt, while its failure budget lasts (service.contract.states: recovering)."""
        spec = JobSpec.model_validate(job.spec)
        if job.failures >= spec.max_failures:
            repository.transition(
                session,
                job,
                JobState.FAILED,
                actor="reconciler",
                reason=f"{why}; not recovered: its failure budget is spent "
                f"(max_failures {spec.max_failures}, {job.failures} failure(s) so far)",
            )
            return None
        step = job.latest_checkpoint_step
        attempt = job.attempt + 1
        submission_id = _submission_id(job.id, attempt)
        token, fetch_token = new_token(), new_token()
        repository.transition(
            session,
            job,
            JobState.RECOVERING,
            actor="reconciler",
            # The new attempt resumes from the newest complete checkpoint in storage, which may be newer
            # than the last one the trainers reported here.
            reason=f"{why}; resubmitted as attempt {attempt}, resuming from its newest complete checkpoint "
            + (f"(step {step} when last reported)" if step is not None else "(none reported yet)")
            + f" (failure {job.failures + 1} of at most {spec.max_failures})",
            attempt=attempt,
            ray_submission_id=submission_id,
            failures=job.failures + 1,
            segment=None,
            report_token_hash=token_hash(token),
            credentials_token_hash=token_hash(fetch_token),
            credentials_redeemed_at=None,
        )
        return Handoff(request=self._launch_request(job, spec), token=token, fetch_token=fetch_token)

    def _finish_stop(self, session: Session, job: Job, *, lost: str | None) -> None:
        """A job told to checkpoint and stop has ended: back to the queue, or failed, or done.

        `lost` says how it ended when it did not stop by itself after its checkpoint."""
        spec = JobSpec.model_validate(job.spec)
        step = job.latest_checkpoint_step
        where = f"checkpoint at step {step}" if step is not None else "no checkpoint"
        steps_lost = max(0, (job.latest_step or 0) - (step or 0))
        if lost is not None:
            where = f"{lost}: {where}, {steps_lost} step(s) lost"
        elif steps_lost:
            # A Ray Train function stops at its next report, which may carry no checkpoint.
            where = f"{where}, {steps_lost} step(s) after it lost"
        if step is not None and spec.max_steps is not None and step >= spec.max_steps:
            # A sweep's stop that came too late leaves no "pruned at rung ..." on a job that succeeded.
            message = None if job.stop_requested == StopReason.PRUNED else job.message
            repository.transition(
                session,
                job,
                JobState.SUCCEEDED,
                actor="reconciler",
                reason=f"reached max_steps ({where})",
                message=message,
            )
        elif job.stop_requested == StopReason.PRUNED:
            repository.transition(
                session,
                job,
                JobState.PRUNED,
                actor="sweep",
                reason=f"{job.message or 'pruned by its sweep'} ({where})",
                stop_requested=None,
                stop_requested_at=None,
            )
        elif job.stop_requested == StopReason.PLATEAU:
            reason = f"{job.message or 'stopped early on a plateau'} ({where})"
            repository.transition(
                session,
                job,
                JobState.SUCCEEDED,
                actor="reconciler",
                reason=reason,
                message=reason,
                stop_requested=None,
                stop_requested_at=None,
            )
        elif job.stop_requested == StopReason.MAX_RUNTIME:
            repository.transition(
                session,
                job,
                JobState.FAILED,
                actor="reconciler",
                reason=f"ran out of max_runtime_s ({spec.max_runtime_s:g} s); {where}",
            )
        else:
            # Neither a clean stop of the service nor a lost node is a preemption by the policy.
            why, counted = {
                StopReason.SHUTDOWN: ("the service stopped", False),
                StopReason.LOST_CAPACITY: ("capacity lost", False),
                StopReason.DRAINED: ("its node drains", False),
            }.get(StopReason(job.stop_requested or StopReason.PREEMPTED), ("preempted", True))
            if job.stop_requested == StopReason.DRAINED:
                # What the drain cost, in steps: the work since the checkpoint it resumes from.
                stopped = "checkpointed and stopped" if lost is None else lost
                checkpoint = f"checkpoint at step {step}" if step is not None else "start (no checkpoint)"
                where = f"{checkpoint}; {stopped}, {steps_lost} step(s) lost"
            repository.transition(
                session,
                job,
                JobState.QUEUED,
                actor="reconciler",
                reason=f"{why}; requeued in its place, resumes from its {where}",
                ray_submission_id=None,
                stop_requested=None,
                stop_requested_at=None,
                preemptions=job.preemptions + counted,
            )

    # -- 2. enforce -----------------------------------------------------------------------------

    def enforce(self, active: Sequence[Any], now: float) -> None:
        """Stop what has run too long, and restart what hangs (`repository.scheduling_rows` of the active
        jobs)."""
        grace_s = self.queues.preempt_grace_s
        overdue = [
            row.id
            for row in active
            if row.state is JobState.RUNNING
            and (runtime := self._templates[row.id].max_runtime_s) is not None
            and now - (to_time(row.admitted_at) or now) >= runtime
        ]
        unresponsive = [
            row.ray_submission_id
            for row in active
            if row.state is JobState.PREEMPTING
            and row.ray_submission_id is not None
            and now - (to_time(row.stop_requested_at) or now) >= grace_s
        ]
        for job_id in overdue:
            self.request_stop(job_id, StopReason.MAX_RUNTIME, reason="ran out of max_runtime_s")
        for submission_id in unresponsive:
            logger.warning(
                "Ray job %s did not stop within %g s of the request: stopping it",
                submission_id,
                grace_s,
                extra={"action": "stop_forced", "submission_id": submission_id},
            )
            stop_job(self.backend, submission_id)
        for row in active:
            if row.state is JobState.RUNNING and row.ray_submission_id is not None:
                hang = self._hang(row, now)
                if hang is not None:
                    self._restart_hung(row.id, row.ray_submission_id, why=hang)

    def _hang(self, row: Any, now: float) -> str | None:
        """Why a running job is hung (no rank completed a step for the hang timeout), or None.

        The rank to blame, in order: one that stopped reporting (a frozen process, a lost node); one
        stuck outside a collective (reading data, writing a checkpoint); else it is not known, since
        every rank waits on the others (decided only once a silent rank would have shown).

        While Ray Train restarts the worker group (`restarting_since`), there is no step to wait for:
        the new group has the start timeout to report."""
        if (restarting := to_time(row.restarting_since)) is not None:
            waited_s = now - restarting
            if waited_s < self.settings.start_timeout_s:
                return None
            return (
                f"the worker group that Ray Train restarted {waited_s:.0f} s ago has not reported "
                f"(start timeout {self.settings.start_timeout_s:.0f} s)"
            )
        ranks = list((row.ranks or {}).values())
        done = [rank["step_at"] for rank in ranks if rank.get("step_at") is not None]
        if not done:
            return None  # no step yet: the start timeout and Ray Train's own start-up checks apply
        timeout_s = max(self.settings.hang_floor_s, self.settings.hang_factor * (row.seconds_per_step or 0))
        idle_s = now - max(done)
        if idle_s < timeout_s:
            return None
        silent = sorted(
            (rank for rank in ranks if now - rank["seen"] > 3 * HEARTBEAT_S), key=lambda r: r["seen"]
        )
        writing = [rank for rank in ranks if rank["phase"] in ("checkpoint", "eval") and rank not in silent]
        if writing and idle_s < CHECKPOINT_HANG_FACTOR * timeout_s:
            return None  # a rank finishes writing a checkpoint or an eval: large ones take a while
        stuck = sorted(
            (rank for rank in ranks if rank["phase"] not in ("sync", "compute", "done")),
            key=lambda r: r["phase_since"],
        )
        if silent:
            rank = silent[0]
            blame = (
                f"rank {rank['rank']} on node {rank['node']} stopped reporting "
                f"{now - rank['seen']:.0f} s ago (after step {rank['step']}, in {rank['phase']}): "
                "frozen, or cut off"
            )
        elif stuck:
            rank = stuck[0]
            blame = (
                f"rank {rank['rank']} on node {rank['node']} has been in {rank['phase']} for "
                f"{now - rank['phase_since']:.0f} s (after step {rank['step']}) while the others wait"
            )
        elif idle_s < timeout_s + 3 * HEARTBEAT_S:
            return None  # give a frozen rank's silence the time to show, to name it
        else:
            blame = "every rank waits on a collective: which one holds them up is not known"
        return f"no rank completed a step for {idle_s:.0f} s (hang timeout {timeout_s:.0f} s): {blame}"

    def _restart_hung(self, job_id: int, submission_id: str, *, why: str) -> None:
        """Stop a hung attempt and resubmit the job from its checkpoint (a failure, like a lost driver)."""
        with self.db.session() as session:
            if not self._fenced(session):
                return
            job = repository.get_job(session, job_id, for_update=True)
            if job.state is not JobState.RUNNING or job.ray_submission_id != submission_id:
                return
            launch = self._recover(session, job, why=why)
        logger.warning("job %s hung: %s", job_id, why, extra={"action": "job_hung", "job": {"id": job_id}})
        stop_job(self.backend, submission_id)
        if launch is not None:
            self.metrics.job_recovered(queue=job.queue)
            self._submit(job_id, launch)

    def request_stop(self, job_id: int, why: StopReason, *, reason: str) -> bool:
        """running -> preempting (service.contract.states), if this replica still schedules."""
        with self.db.session() as session:
            if not self._fenced(session):
                return False
            job = repository.get_job(session, job_id, for_update=True)
            if job.state is not JobState.RUNNING:
                return False
            repository.request_stop(session, job, why=why, actor="scheduler", reason=reason)
            return True

    # -- 3. schedule ----------------------------------------------------------------------------

    def schedule(self, now: float) -> Decisions:
        with self.db.session() as session:
            rows = repository.scheduling_rows(session)
            live = {row.id for row in rows}
            ended = sorted(self._templates.keys() - live)
            if self.history.loaded:
                self.history.learn(session, ended)
            else:
                self.history.load(session)
                self.waits = RecentWaits()
                for queue in QUEUE_ORDER:
                    for wait_s in repository.recent_admission_waits(session, queue, limit=WAIT_SAMPLES):
                        self.waits.add(queue, wait_s)
            self._forget_changed(rows)
            self._learn_specs(session, [row.id for row in rows])
            stored_usage = repository.owner_usage(session)
        for job_id in ended:  # its template is not needed again
            self._forget(job_id)
        waiting_before = {
            row.id: (row.queue_position, row.waiting_reason, _rounded(to_time(row.eta_at)))
            for row in rows
            if row.state is JobState.QUEUED
        }
        queued = [self._queued_gang(row.id) for row in rows if row.state is JobState.QUEUED]
        active = [self._gang(row, now=now) for row in rows if row.state in ACTIVE_STATES]
        cluster = self.backend.snapshot()
        self._watch_spot(cluster, now=now)
        self.requeue_unplaceable(rows, cluster, now=now)
        self.drains = self._read_drains(cluster)
        self.honor_drains(rows, now=now)
        usage = self._update_usage(stored_usage, active, cluster=cluster, now=now)
        if self._draining.is_set():
            queued = []  # a clean stop is under way: nothing starts
        unreachable = self._unreachable_storage(cluster)
        held, queued = (queued, []) if unreachable else ([], queued)
        # A job held for its window is looked at again a tick later: it starts by its last start.
        deferral = replace(
            self.prices.deferral(now, margin_s=self.settings.scheduler_interval_s),
            expected_wait_s=self.waits.expected(),
        )
        self._keep_ledgers(rows, now=now)
        # A draining node's capacity does not count: no gang is placed there (Ray agrees).
        placeable = replace(cluster, nodes=tuple(n for n in cluster.nodes if n.node_id not in self.drains))
        decisions = decide(
            cluster=placeable,
            queued=queued,
            active=active,
            now=now,
            queues=self.queues,
            usage=usage,
            deferral=deferral,
        )
        if held:
            waiting = {
                gang.job_id: Wait(position, unreachable, None) for position, gang in enumerate(held, 1)
            }
            decisions = replace(decisions, waiting={**decisions.waiting, **waiting})
        self._note_others(decisions, cluster)
        self._window_at.update(decisions.deferred_until)
        for victim in decisions.preempt:
            self._preempt(victim)
        for job_id in decisions.admit:
            placement = decisions.placements.get(job_id, ())
            self._admit_one(
                job_id,
                note=decisions.deferral_notes.get(job_id),
                spot_nodes=_spot_nodes(placeable, placement, self._templates[job_id]),
            )
        self._store_waiting(decisions, before=waiting_before, admitted=set(decisions.admit))
        return decisions

    def _watch_spot(self, cluster: ClusterSnapshot, *, now: float) -> None:
        """Write which spot nodes are alive (when the set changes, else every `SPOT_SEEN_EVERY_S`), and
        count those that left as interruptions (service.planning.measured.observed_spot_rate)."""
        alive = frozenset(node.node_id for node in cluster.nodes if node.spot)
        self._spot_alive = len(alive)
        seen, written_at = self._spot_seen
        if alive == seen and now - written_at < SPOT_SEEN_EVERY_S:
            return
        with self.db.session() as session:
            if not self._fenced(session):
                return
            departed = dict(cluster.departed)
            left = repository.observe_spot_nodes(
                session,
                alive=alive,
                departed=departed,
                idle={node_id for node_id, message in departed.items() if retired_idle(message)},
                now=_utc(now),
            )
            for node in left:
                logger.warning(
                    "spot node %s left the cluster%s: %s",
                    node.node_id,
                    " (an interruption)" if node.interrupted else " (retired, not an interruption)",
                    node.reason,
                    extra={"action": "spot_node_left", "node": node.node_id, "interrupted": node.interrupted},
                )
        self._spot_seen = (alive, now)

    def _keep_ledgers(self, rows: Sequence[Any], *, now: float) -> None:
        """Bring the cost ledgers up to date (service.costs): every `LEDGER_EVERY_S` for an active job,
        and once more, up to its end, for a job that has left the active states since the last tick."""
        active = {row.id: row for row in rows if row.state in ACTIVE_STATES}
        due = [
            row
            for row in active.values()
            if now - (to_time(row.cost_at) or to_time(row.admitted_at) or now) >= LEDGER_EVERY_S
        ]
        left = sorted(self._charging - active.keys())
        self._charging = set(active)
        if not due and not left:
            return
        signal = self.prices.current(now)
        with self.db.session() as session:
            if not self._fenced(session):
                return
            ended = repository.ledgers(session, left)
            changes = []
            for row, end in [(row, now) for row in due] + [
                (row, to_time(row.finished_at) or now) for row in ended
            ]:
                template = self._templates.get(row.id)
                admitted_at = to_time(row.admitted_at)
                if template is None or admitted_at is None:
                    continue
                start = max(admitted_at, to_time(row.cost_at) or admitted_at)
                if end <= start:
                    continue
                added = accrue(signal, resources=template.totals, start=start, end=end, rates=self.rates)
                changes.append(
                    {
                        "id": row.id,
                        "resource_hours": row.resource_hours + added.resource_hours,
                        "priced_hours": row.priced_hours + added.priced_hours,
                        "cost": row.cost + added.cost,
                        "cost_unit": self.rates.unit,
                        "cost_at": _utc(end),
                    }
                )
            repository.set_ledgers(session, changes)

    def _note_others(self, decisions: Decisions, cluster: ClusterSnapshot) -> None:
        """Log what other Ray users hold and what Ray cannot place yet, when either changes: on a shared
        cluster, the reason why Apiary admits less than its nodes hold (the waiting reasons say it too)."""
        said = f"other Ray users hold {format_resources(decisions.foreign)}"
        if cluster.pending:
            said += f"; Ray cannot place yet: {'; '.join(cluster.pending)}"
        if said == self._others_said:
            return
        self._others_said = said
        logger.info(
            "%s",
            said,
            extra={
                "action": "cluster_shared",
                "foreign": dict(decisions.foreign),
                "pending": cluster.pending,
            },
        )

    def _forget_changed(self, rows: Sequence[Any]) -> None:
        """Drop the templates of the jobs whose queue or priority an admin changed: learned again."""
        for row in rows:
            template = self._templates.get(row.id)
            if template is not None and (template.queue, template.priority) != (row.queue, row.priority):
                self._forget(row.id)

    def _forget(self, job_id: int) -> None:
        del self._templates[job_id], self._facts[job_id]
        self._estimates.pop(job_id, None)
        self._window_at.pop(job_id, None)

    def _unreachable_storage(self, cluster: ClusterSnapshot) -> str:
        """Why no job can start: checkpoint storage that the cluster's other nodes cannot reach (a local
        path on more than one node), or '' when there is no such reason."""
        storage = self.settings.resolved_storage_uri
        if len(cluster.nodes) <= 1 or self.settings.shared_filesystem or not node_local(storage):
            return ""
        return (
            f"checkpoint storage {storage} is a local path and the cluster has {len(cluster.nodes)} "
            "nodes, which cannot all reach it: set APIARY_STORAGE_URI to s3://... (or "
            "APIARY_SHARED_FILESYSTEM=true if it is a mount every node shares)"
        )

    def requeue_unplaceable(self, rows: Sequence[Any], cluster: ClusterSnapshot, *, now: float) -> None:
        """Stop and requeue the started jobs whose gang no longer fits the alive nodes (a node left and
        took part of the gang): Ray Train would wait for the lost workers' resources for ever. After
        `capacity_loss_grace_s` (a node that comes back at once costs nothing): a running job goes
        `preempting` (StopReason.LOST_CAPACITY) and its Ray job is stopped at once, then the reconciler
        requeues it; a starting one goes back to `queued`. It resumes from its checkpoint once the
        policy finds room again."""
        grace_s = self.settings.capacity_loss_grace_s
        unplaceable = {
            row.id: row
            for row in rows
            if row.state in (JobState.RUNNING, *STARTING_STATES)
            and not fits_empty_cluster(cluster, self._templates[row.id])
        }
        for job_id in self._unplaceable_since.keys() - unplaceable.keys():
            del self._unplaceable_since[job_id]
        for job_id, row in unplaceable.items():
            since = self._unplaceable_since.setdefault(job_id, now)
            if now - since >= grace_s and row.ray_submission_id is not None:
                self._requeue_lost(
                    job_id,
                    row.ray_submission_id,
                    why=f"capacity lost: its gang no longer fits the cluster's {capacity_text(cluster)} "
                    f"(for {now - since:.0f} s)",
                )

    def _read_drains(self, cluster: ClusterSnapshot) -> dict[str, Drain]:
        """The alive nodes that drain (service.drains): Ray's, and those told to Apiary; the rows of nodes
        that are gone are dropped."""
        alive = {node.node_id for node in cluster.nodes}
        problem = None
        try:
            from_ray = {node: at for node, at in self.backend.draining_nodes().items() if node in alive}
        except ClusterUnavailable as err:
            problem, from_ray = str(err), {}
        if from_ray.keys() != self._ray_drained:
            logger.info(
                "Ray drains %d node(s): %s",
                len(from_ray),
                ", ".join(f"{node} (deadline {clock(at)})" for node, at in sorted(from_ray.items()))
                or "none",
                extra={"action": "ray_drains", "nodes": sorted(from_ray)},
            )
            self._ray_drained = set(from_ray)
        if problem != self._drains_problem:
            if problem is not None:
                logger.warning(
                    "%s: only drains told to Apiary are seen", problem, extra={"action": "drains_unknown"}
                )
            self._drains_problem = problem
        with self.db.session() as session:
            rows = repository.node_drains(session)
            gone = [row.node_id for row in rows if row.node_id not in alive]
            if gone and self._fenced(session):
                repository.forget_node_drains(session, gone)
            told = [
                Drain(node_id=row.node_id, deadline_at=to_time(row.deadline_at), source=row.requested_by)
                for row in rows
                if row.node_id in alive
            ]
        drains = merge(from_ray, told)
        for drain in drains.values():
            if drain.node_id not in self.drains:
                logger.warning(
                    "node %s drains (deadline %s, from %s): no gang is placed there",
                    drain.node_id,
                    clock(drain.deadline_at),
                    drain.source,
                    extra={
                        "action": "node_draining",
                        "node": {"id": drain.node_id, "deadline": drain.deadline_at},
                    },
                )
        return drains

    def honor_drains(self, rows: Sequence[Any], *, now: float) -> None:
        """Every running job with a rank on a draining node checkpoints at its next step boundary and
        stops, when it can before the deadline; else it is stopped now. One told so and still running
        `STOP_MARGIN_S` before the deadline is stopped then (service.drains)."""
        if not self.drains:
            return
        for row in rows:
            drain = drained_node(row.ranks, self.drains)
            if drain is None or row.ray_submission_id is None:
                continue
            node = f"node {drain.node_id[:8]} drains (deadline {clock(drain.deadline_at)}"
            if drain.deadline_at is not None:
                node += f", in {drain.deadline_at - now:.0f} s"
            node += f", from {drain.source})"
            if row.state is JobState.RUNNING:
                step_s, write_s = row.seconds_per_step, row.checkpoint_write_s
                if can_checkpoint_before(
                    now=now, deadline_at=drain.deadline_at, step_s=step_s, write_s=write_s
                ):
                    self.request_stop(
                        row.id,
                        StopReason.DRAINED,
                        reason=f"{node}: checkpoint at the next step boundary (after step "
                        f"{row.latest_step or 0}) and requeue",
                    )
                else:
                    needs = checkpoint_needs_s(step_s=step_s, write_s=write_s)
                    self._requeue_lost(
                        row.id,
                        row.ray_submission_id,
                        why=f"{node}: too soon to checkpoint first ("
                        + (f"that needs {needs:.1f} s" if needs is not None else "no step time yet")
                        + "): it loses the steps since its last checkpoint",
                        stop_reason=StopReason.DRAINED,
                    )
            elif (
                row.state is JobState.PREEMPTING
                and row.stop_requested == StopReason.DRAINED
                and drain.deadline_at is not None
                and now >= drain.deadline_at - STOP_MARGIN_S
                and row.ray_submission_id not in self._drain_stopped
            ):
                self._drain_stopped.add(row.ray_submission_id)
                self._requeue_lost(
                    row.id,
                    row.ray_submission_id,
                    why=f"{node}: not stopped {STOP_MARGIN_S:g} s before the deadline: it loses the steps "
                    "since its last checkpoint",
                    stop_reason=StopReason.DRAINED,
                )

    def _requeue_lost(
        self, job_id: int, submission_id: str, *, why: str, stop_reason: StopReason = StopReason.LOST_CAPACITY
    ) -> None:
        """Stop a job's attempt at once, without a checkpoint: a running job goes `preempting` (its Ray
        job stopped, the reconciler requeues it), a starting one back to `queued`. With a drain, a job
        already told to checkpoint that has not stopped in time is stopped too."""
        drain = stop_reason is StopReason.DRAINED
        with self.db.session() as session:
            if not self._fenced(session):
                return
            job = repository.get_job(session, job_id, for_update=True)
            if job.ray_submission_id != submission_id:
                return
            if job.state is JobState.RUNNING:
                repository.request_stop(
                    session, job, why=stop_reason, actor="scheduler", reason=f"{why}; stopping it"
                )
            elif job.state is JobState.PREEMPTING and drain:
                repository.record_event(session, job, actor="scheduler", reason=f"{why}; stopping it")
            elif job.state in STARTING_STATES and not drain:
                repository.transition(
                    session,
                    job,
                    JobState.QUEUED,
                    actor="scheduler",
                    reason=f"{why}; requeued in its place, resumes from its newest checkpoint",
                    ray_submission_id=None,
                )
            else:
                return
        self._unplaceable_since.pop(job_id, None)
        action = "drain_stop" if drain else "capacity_lost"
        logger.warning("job %s: %s", job_id, why, extra={"action": action, "job": {"id": job_id}})
        stop_job(self.backend, submission_id)

    def _learn_specs(self, session: Session, job_ids: Sequence[int]) -> None:
        """Gang templates (and max_steps) of the jobs not seen before: a spec never changes, but for the
        queue and priority an admin may change (PATCH /jobs/{id} stores them in the spec too)."""
        new = [job_id for job_id in job_ids if job_id not in self._templates]
        if not new:
            return
        for job_id, spec_json, owner, created_at in repository.specs(session, new):
            spec = JobSpec.model_validate(spec_json)
            self._templates[job_id] = gang_for(
                job_id,
                spec,
                data_cpus=self.settings.data_cpus_per_job,
                owner=owner,
                submitted_at=to_time(created_at) or 0.0,
            )
            size = job_size(spec.resources_per_worker, spec.min_workers)
            self._facts[job_id] = _Facts(name=spec.name, max_steps=spec.max_steps, size=size)

    def _estimate(self, job_id: int) -> tuple[float | None, Gang]:
        """History's estimate of the job's whole duration (never beyond its max_runtime_s), and its gang
        as the policy sees it queued (`estimated_runtime_s`); computed again when the history changes."""
        cached = self._estimates.get(job_id)
        if cached is not None and cached[0] == self.history.version:
            return cached[1], cached[2]
        template, facts = self._templates[job_id], self._facts[job_id]
        expected = self.history.estimate(
            owner=template.owner, name=facts.name, size=facts.size, declared_s=template.max_runtime_s
        )
        # The history changed, but rarely this job's estimate: keep its gang then.
        if cached is not None and cached[1] == expected:
            gang = cached[2]
        else:
            gang = replace(template, estimated_runtime_s=expected)
        self._estimates[job_id] = (self.history.version, expected, gang)
        return expected, gang

    def _queued_gang(self, job_id: int) -> Gang:
        return self._estimate(job_id)[1]

    def _gang(self, row: Any, *, now: float) -> Gang:
        """An active job as the policy sees it: its gang, and its progress. Its attempt started when it
        was admitted (`started_at` is the job's first start, before any preemption)."""
        template = self._templates[row.id]
        started_at = to_time(row.admitted_at) if row.state not in STARTING_STATES else None
        return replace(
            template,
            started_at=started_at,
            last_checkpoint_at=to_time(row.last_checkpoint_at),
            expected_end_at=self._expected_end(row, template, started_at=started_at, now=now),
            stopping=row.state is JobState.PREEMPTING,
        )

    def _expected_end(self, row: Any, gang: Gang, *, started_at: float | None, now: float) -> float | None:
        """When the job will release its gang: what the estimates say is left of it
        (`service.scheduling.estimates.live_remaining_s`: its measured pace toward max_steps, or history
        early on), never beyond its max_runtime_s."""
        ends = []
        if gang.max_runtime_s is not None:
            ends.append((started_at if started_at is not None else now) + gang.max_runtime_s)
        max_steps = self._facts[row.id].max_steps
        pace_s = None
        if row.seconds_per_step and row.latest_step is not None and max_steps is not None:
            steps_left = max_steps - row.latest_step
            pace_s = time_to_finish_s(steps_left=steps_left, step_time_s=row.seconds_per_step)
        ran_s = max(0.0, now - started_at) if started_at is not None else 0.0
        remaining = live_remaining_s(ran_s=ran_s, pace_s=pace_s, expected_s=self._estimate(row.id)[0])
        if remaining is not None:
            ends.append(now + remaining)
        return min(ends) if ends else None

    def _update_usage(
        self,
        stored: Mapping[str, tuple[float, datetime]],
        active: Sequence[Gang],
        *,
        cluster: ClusterSnapshot,
        now: float,
    ) -> dict[str, float]:
        """Each owner's usage decayed to `now`; owners with active jobs also get the time since their
        last update at their current rate (the dominant share of the cluster they hold)."""
        totals: dict[str, float] = {}
        for node in cluster.nodes:
            for key, amount in node.resources.items():
                totals[key] = totals.get(key, 0.0) + amount
        rate: dict[str, float] = {}
        for gang in active:
            rate[gang.owner] = rate.get(gang.owner, 0.0) + dominant_share(gang, totals)
        usage: dict[str, float] = {}
        updates: dict[str, float] = {}
        for owner, (value, updated_at) in stored.items():
            usage[owner] = decayed_usage(
                value,
                rate=rate.get(owner, 0.0),
                elapsed_s=max(0.0, now - (to_time(updated_at) or now)),
                half_life_s=self.queues.fair_share_half_life_s,
            )
            if owner in rate:
                updates[owner] = usage[owner]
        for owner in rate.keys() - stored.keys():
            usage[owner] = updates[owner] = 0.0  # from now on
        with self.db.session() as session:
            if self._fenced(session):
                repository.set_owner_usage(session, updates, now=_utc(now))
        return usage

    def _preempt(self, victim: Preemption) -> None:
        if self.request_stop(victim.job_id, StopReason.PREEMPTED, reason=victim.reason):
            self.metrics.job_preempted(queue=self._templates[victim.job_id].queue, by="policy")
            logger.info(
                "job %s preempted for job %s",
                victim.job_id,
                victim.for_job,
                extra={"action": "job_preempted", "job": {"id": victim.job_id, "for": victim.for_job}},
            )

    def _store_waiting(
        self,
        decisions: Decisions,
        *,
        before: Mapping[int, tuple[int | None, str | None, float | None]],
        admitted: set[int],
    ) -> None:
        changes = [
            {
                "id": job_id,
                "queue_position": wait.position,
                "waiting_reason": wait.reason,
                "eta_at": _utc(wait.eta) if wait.eta is not None else None,
            }
            for job_id, wait in decisions.waiting.items()
            if job_id not in admitted
            and before.get(job_id) != (wait.position, wait.reason, _rounded(wait.eta))
        ]
        with self.db.session() as session:
            if self._fenced(session):
                repository.set_waiting(session, changes)

    def _admit_one(self, job_id: int, *, note: str | None = None, spot_nodes: int = 0) -> None:
        """`spot_nodes`: how many spot nodes the policy placed its workers on (its MTBF, and the event)."""
        with self.db.session() as session:
            if not self._fenced(session):
                return
            job = repository.get_job(session, job_id, for_update=True)
            if job.state is not JobState.QUEUED:
                return  # cancelled meanwhile
            attempt = job.attempt + 1
            token, fetch_token = new_token(), new_token()
            spec = JobSpec.model_validate(job.spec)
            queued_at = to_time(repository.queued_since(session, job_id)) or to_time(job.created_at)
            repository.transition(
                session,
                job,
                JobState.ADMITTED,
                actor="scheduler",
                # An elastic job is admitted on its min gang (service.scheduling.policy glossary: elastic
                # gang).
                reason=f"gang of {spec.min_workers} worker(s) fits"
                + (f" (on {spot_nodes} spot node(s))" if spot_nodes else "")
                + f"; submitting attempt {attempt}"
                + (f"; {note}" if note else ""),
                attempt=attempt,
                ray_submission_id=_submission_id(job.id, attempt),
                queue_position=None,
                waiting_reason=None,
                eta_at=None,
                segment=None,
                report_token_hash=token_hash(token),
                credentials_token_hash=token_hash(fetch_token),
                credentials_redeemed_at=None,
            )
            launch = Handoff(
                request=self._launch_request(job, spec, spot_nodes=spot_nodes),
                token=token,
                fetch_token=fetch_token,
            )
        admitted_at = time.time()
        self.metrics.job_admitted(queue=job.queue, waited_s=admitted_at - (queued_at or admitted_at))
        joined = max(queued_at or admitted_at, self._window_at.pop(job_id, 0.0))
        self.waits.add(job.queue, admitted_at - joined)
        self._submit(job_id, launch)

    def _launch_request(self, job: Job, spec: JobSpec, *, spot_nodes: int | None = None) -> LaunchRequest:
        """What the attempt `job.attempt` runs (its row already holds the attempt and submission id).
        `spot_nodes`: the spot nodes its workers were placed on; None (a recovery, resubmitted where Ray
        finds room): as many as it could be on (none for `spot: never`)."""
        mtbf = None
        if spec.checkpoint.auto:
            session = object_session(job)
            assert session is not None  # both callers hold the job's row in their session
            if spot_nodes is None:
                may_use_spot = spec.spot_use is not SpotUse.NEVER
                spot_nodes = min(spec.max_workers, self._spot_alive) if may_use_spot else 0
            mtbf = observed_mtbf(
                session,
                default_s=self.settings.default_mtbf_s,
                spot_nodes=spot_nodes,
                spot_prior_per_node_h=self.settings.spot_prior_interruptions_per_node_h,
            )
            repository.record_event(
                session,
                job,
                actor="scheduler",
                reason=f"checkpoint auto: MTBF {mtbf.mtbf_s / 3600:.1f} h ({mtbf.basis}); the cadence "
                "follows once the trainers have measured a save",
            )
        return LaunchRequest(
            job_id=job.id,
            attempt=job.attempt,
            submission_id=job.ray_submission_id,
            spec=spec,
            storage_uri=self.settings.resolved_storage_uri,
            run_name=run_name(job.id),
            telemetry_url=f"{self.settings.resolved_public_url}/internal/jobs/{job.id}/telemetry",
            data_cpus=self.settings.data_cpus_per_job,
            failures_left=max(0, spec.max_failures - job.failures),
            s3_endpoint_url=self.settings.s3_endpoint_url,
            data_trace_dir=str(self.settings.data_trace_dir) if self.settings.data_trace_dir else None,
            mtbf_s=mtbf.mtbf_s if mtbf else None,
            mtbf_basis=mtbf.basis if mtbf else None,
        )

    def _submit(self, job_id: int, launch: Handoff) -> None:
        """Submit an attempt whose row is committed (admitted or recovering, with its submission id).

        Its launch request and report token go to its handoff folder in storage first; a failed write
        submits nothing, and the next reconcile requeues the job (Ray never saw the submission)."""
        submission_id = launch.request.submission_id
        assert submission_id is not None
        request = launch.request
        try:
            pointer = write_handoff(
                request,
                token=launch.token,
                credentials_url=f"{self.settings.resolved_public_url}/internal/jobs/{request.job_id}"
                f"/attempts/{request.attempt}/credentials",
                fetch_token=launch.fetch_token,
            )
        except OSError as err:
            logger.warning(
                "cannot write the handoff of job %s attempt %s to storage: %s",
                job_id,
                launch.request.attempt,
                err,
                extra={"action": "handoff_failed", "submission_id": submission_id},
            )
            return
        # No S3 credential here: Ray logs a job's runtime_env on each node and shows it on its
        # dashboard. The driver redeems the pointer's single-use fetch token for them instead
        # (service.contract.handoff), on the local Ray and on an external cluster alike.
        env_vars = {**launch_env(pointer), **self.settings.job_ray_env()}
        working_dir = None
        if launch.request.spec.code is not None:
            try:
                working_dir = str(CodeStore.of(self.settings).local_path(sha256_of(launch.request.spec.code)))
            except OSError as err:
                logger.warning(
                    "cannot read the code package of job %s from storage: %s",
                    job_id,
                    err,
                    extra={"action": "code_unavailable", "submission_id": submission_id},
                )
                return
        try:
            self.backend.submit(
                submission_id=submission_id,
                entrypoint=entrypoint(self.settings.job_python),
                env_vars=env_vars,
                py_modules=code_modules() if self.settings.ship_code else None,
                working_dir=working_dir,
            )
        except Exception as err:
            self._submission_failed(job_id, submission_id, err)
            return
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            # Cancelled between admission and submission (the cancel found no Ray job to stop), or
            # requeued by a replica that took the lease meanwhile and found no Ray job: this
            # submission is not the job's any more.
            orphaned = job.state is JobState.CANCELLED or job.ray_submission_id != submission_id
        if orphaned:
            stop_job(self.backend, submission_id)

    def _submission_failed(self, job_id: int, submission_id: str, err: Exception) -> None:
        """A submit call raised: its outcome is unknown (the request may have landed, its answer lost).
        Ray is asked before anything is decided; only a submission Ray answered and refused fails the
        job. Otherwise the row stays as it is and the next reconcile decides: a Ray job that exists is
        tracked, a submission Ray never saw is requeued."""
        try:
            status: RayJobStatus | None = self.backend.job_info(submission_id).status
        except ClusterUnavailable:
            status = None
        refused = status is RayJobStatus.MISSING and _refused_by_ray(err)
        logger.warning(
            "submission %s of job %s raised %s: %s; %s",
            submission_id,
            job_id,
            type(err).__name__,
            err,
            "Ray refused it"
            if refused
            else f"Ray says {status.value if status else 'nothing (unreachable)'}",
            extra={"action": "submit_failed", "submission_id": submission_id},
        )
        if not refused:
            return
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            if job.state in STARTING_STATES and job.ray_submission_id == submission_id:
                repository.transition(
                    session,
                    job,
                    JobState.FAILED,
                    actor="scheduler",
                    reason=f"Ray refused the submission: {err}",
                )


# How often the leader deletes expired idempotency keys (an indexed range delete; mostly nothing).
PRUNE_KEYS_EVERY_S = 300.0


# The states of a job whose Ray job was submitted and has not been seen running yet.
STARTING_STATES = frozenset({JobState.ADMITTED, JobState.RECOVERING})
# How often an active job's cost ledger is written (and once more when it stops being active).
LEDGER_EVERY_S = 30.0


# A rank that reports it is finishing a checkpoint write (or an eval) gets this many hang timeouts
# before it counts as hung (its heartbeat shows it is alive; a large checkpoint to S3 takes minutes).
CHECKPOINT_HANG_FACTOR = 10


def _submission_id(job_id: int, attempt: int) -> str:
    return f"{submission_prefix(job_id, attempt)}{secrets.token_hex(3)}"


def _refused_by_ray(err: Exception) -> bool:
    """Ray's job client raises `RuntimeError("Request failed with status code 4xx: ...")` for a
    submission it answered and refused; anything else (a connection error, a 5xx) may have landed."""
    return "status code 4" in str(err)


def _utc(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC)


def _rounded(timestamp: float | None) -> float | None:
    """A stored time as the database gives it back (microseconds at most)."""
    return round(timestamp, 3) if timestamp is not None else None
