"""Sweeps: many variants of one job, searched, the losers stopped early, the winner kept.

A sweep (`service.contract.sweep.SweepSpec`) is a row of the `sweeps` table; its trials are ordinary
jobs (`jobs.sweep_id`, `jobs.trial`, `jobs.trial_params`), owned by the sweep's owner, in the base
spec's queue: they get everything a job gets (fair share, preemption, recovery, exact resume, metrics,
shipped code).

The replica that holds the scheduler lease runs `SweepRunner.tick()` every `sweep_interval_s`; for each
running sweep it:
1. judges each running trial at the highest rung it has reached where at least `reduction_factor`
   trials have a value (ASHA, `service.contract.sweep.asha_keeps`): a loser is told to checkpoint
   and stop (`StopReason.PRUNED`) and ends `pruned`, with the rung and its value in its message;
   `POST /jobs/{id}/resume` queues it again, from that checkpoint;
2. starts trials while fewer than `parallel` are queued or running and fewer than the sweep's total
   exist: trial N's point is the grid's N-th, or drawn from (seed, N), or asked of Optuna's TPE told
   every finished trial's objective. A trial is created in one transaction, unique per (sweep, N):
   a restart or a new leader never starts a trial twice, and loses none;
3. ends the sweep once every trial has ended: `succeeded`, its best trial the one with the best final
   objective among those that succeeded (or, failing that, among all that reported one).

A trial's objective is the objective metric's last value (rank 0, the run that counted).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError

from service import auth
from service.auth import User
from service.contract.errors import InvalidSpec, InvalidTransition
from service.contract.spec import JobSpec, Queue
from service.contract.states import ACTIVE_STATES, JobState, StopReason
from service.contract.sweep import (
    SweepSpec,
    asha_keeps,
    grid_point,
    max_steps_of,
    random_point,
    rungs,
    trial_spec,
    value_at,
)
from service.jobs import JobService
from service.store import repository
from service.store.db import Database
from service.store.models import Job, Sweep, utcnow

logger = logging.getLogger(__name__)

RUNNING, SUCCEEDED, CANCELLED, FAILED = "running", "succeeded", "cancelled", "failed"
UNFINISHED = (JobState.QUEUED, *ACTIVE_STATES)


@dataclass(frozen=True)
class Trial:
    job: Job
    objective: float | None  # the objective's last value
    series: list[tuple[int, float]]  # (step, objective) of the run that counted


@dataclass(frozen=True)
class SweepView:
    sweep: Sweep
    spec: SweepSpec
    trials: list[Trial]
    best: Trial | None
    total: int  # trials the sweep runs in all


def objective_order(mode: str) -> Callable[[float], float]:
    return (lambda value: value) if mode == "min" else (lambda value: -value)


def best_trial(trials: Sequence[Trial], mode: str) -> Trial | None:
    """The succeeded trial with the best objective, or (none succeeded) the best of all that have one."""
    key = objective_order(mode)
    for pool in ([t for t in trials if t.job.state is JobState.SUCCEEDED], trials):
        scored = [t for t in pool if t.objective is not None]
        if scored:
            return min(scored, key=lambda t: key(t.objective))  # type: ignore[arg-type]
    return None


@dataclass(kw_only=True)
class SweepService:
    db: Database
    jobs: JobService

    def create(self, spec: SweepSpec, *, by: User) -> Sweep:
        """Check that the sweep's trials can run (the base spec as any job, and the first trial's
        point), then store it; its trials start on the leader's next pass."""
        try:
            self.jobs.checked(trial_spec(spec, first_point(spec), index=0), by=by)
        except InvalidSpec as err:
            field = f"base.{err.field}" if err.field else None
            raise InvalidSpec(err.message, field=field) from None
        with self.db.session() as session:
            return repository.create_sweep(
                session, name=spec.name, owner=by.name, spec=spec.model_dump(mode="json", by_alias=True)
            )

    def view(self, sweep_id: int) -> SweepView:
        with self.db.session() as session:
            sweep = repository.get_sweep(session, sweep_id)
            spec = SweepSpec.model_validate(sweep.spec)
            trials = [
                _trial(job, repository.metric_series(session, job.id, spec.objective.metric))
                for job in repository.trials_of(session, sweep_id)
            ]
        best = next((t for t in trials if t.job.id == sweep.best_job_id), None) or best_trial(
            trials, spec.objective.mode
        )
        return SweepView(sweep=sweep, spec=spec, trials=trials, best=best, total=spec.total_trials())

    def list(self, *, limit: int = 100) -> list[Sweep]:
        with self.db.session() as session:
            return repository.list_sweeps(session, limit=limit)

    def cancel(self, sweep_id: int, *, by: User) -> Sweep:
        """Stop starting trials and cancel the unfinished ones (the sweep's owner or an admin)."""
        with self.db.session() as session:
            sweep = repository.get_sweep(session, sweep_id, for_update=True)
            auth.require_owner_or_admin(by, owner=sweep.owner, job_id=sweep_id, action="cancel sweep")
            if sweep.state != RUNNING:
                raise InvalidTransition(f"sweep {sweep_id} is already {sweep.state}")
            sweep.state, sweep.finished_at, sweep.message = CANCELLED, utcnow(), f"cancelled by {by.name}"
            unfinished = [
                job.id for job in repository.trials_of(session, sweep_id) if job.state in UNFINISHED
            ]
        for job_id in unfinished:
            with contextlib.suppress(InvalidTransition):  # it ended meanwhile
                self.jobs.cancel(job_id, by=by)
        return sweep

    def best_spec(self, sweep_id: int, *, queue: Queue | None = None) -> JobSpec:
        """The best trial's spec, ready to submit (in `queue` if given, e.g. full-scale)."""
        view = self.view(sweep_id)
        if view.best is None:
            raise InvalidTransition(f"sweep {sweep_id} has no trial with an objective yet")
        spec = JobSpec.model_validate(view.best.job.spec)
        changes: dict[str, Any] = {"name": f"{view.sweep.name}-best"}
        if queue is not None:
            changes["queue"] = queue
            changes["max_runtime_s"] = None  # the research queue's default is not the other queue's
        return JobSpec.model_validate({**spec.model_dump(mode="json", by_alias=True), **changes})


def _trial(job: Job, series: list[tuple[int, float]]) -> Trial:
    return Trial(job=job, objective=series[-1][1] if series else None, series=series)


def first_point(spec: SweepSpec) -> dict[str, Any]:
    return grid_point(spec, 0) if spec.method == "grid" else random_point(spec, 0)


def tpe_point(
    spec: SweepSpec, index: int, finished: Sequence[tuple[dict[str, Any], float]]
) -> dict[str, Any]:
    """Trial `index`'s point from Optuna's TPE sampler, told the finished trials (point, objective):
    the same inputs give the same point (a fresh sampler seeded by (seed, index))."""
    import optuna
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    from service.contract.sweep import Choice, IntRange, LogUniform, Uniform

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions: dict[str, Any] = {}
    choices: dict[str, list[Any]] = {}
    for key, param in sorted(spec.space.items()):
        if isinstance(param, Choice):
            # Optuna's choices must be plain values: each choice is given by its position.
            choices[key] = list(param.choice)
            distributions[key] = CategoricalDistribution(list(range(len(param.choice))))
        elif isinstance(param, Uniform):
            distributions[key] = FloatDistribution(*param.uniform)
        elif isinstance(param, LogUniform):
            distributions[key] = FloatDistribution(*param.loguniform, log=True)
        else:
            assert isinstance(param, IntRange)
            distributions[key] = IntDistribution(*param.int_)
    sampler = optuna.samplers.TPESampler(seed=(spec.seed * 1_000_003 + index) % (2**32))
    study = optuna.create_study(
        direction="minimize" if spec.objective.mode == "min" else "maximize", sampler=sampler
    )
    for point, value in finished:
        params = {
            key: choices[key].index(point[key]) if key in choices else point[key]
            for key in distributions
            if key in point and (key not in choices or point[key] in choices[key])
        }
        if len(params) == len(distributions) and math.isfinite(value):
            study.add_trial(
                optuna.trial.create_trial(params=params, distributions=distributions, value=value)
            )
    asked = study.ask(distributions)
    return {key: choices[key][value] if key in choices else value for key, value in asked.params.items()}


# -- the leader's loop -----------------------------------------------------------------------------


@dataclass
class SweepRunner:
    """Runs every running sweep (see the module docstring), on the replica that holds the lease."""

    db: Database
    jobs: JobService
    is_leader: Callable[[], bool]
    interval_s: float = 2.0
    wake: Callable[[], None] = lambda: None  # the scheduler's: admit the new trials at once
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="apiary-sweeps", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            if not self.is_leader():
                continue
            try:
                self.tick()
            except Exception:  # a database hiccup: the next pass tries again
                logger.exception("sweep pass failed", extra={"action": "sweep_pass_failed"})

    def tick(self) -> None:
        with self.db.session() as session:
            running = [sweep.id for sweep in repository.list_sweeps(session, states=(RUNNING,), limit=10_000)]
        started = 0
        for sweep_id in running:
            started += self._advance(sweep_id)
        if started:
            self.wake()

    def _advance(self, sweep_id: int) -> int:
        with self.db.session() as session:
            sweep = repository.get_sweep(session, sweep_id)
            spec = SweepSpec.model_validate(sweep.spec)
            trials = [
                _trial(job, repository.metric_series(session, job.id, spec.objective.metric))
                for job in repository.trials_of(session, sweep_id)
            ]
        if spec.early_stopping is not None:
            self._prune(spec, trials)
        started = self._start_trials(sweep, spec, trials)
        if not started:
            self._finish_if_done(sweep_id, spec, trials)
        return started

    def _prune(self, spec: SweepSpec, trials: Sequence[Trial]) -> None:
        early = spec.early_stopping
        assert early is not None
        steps = rungs(early, max_steps=max_steps_of(spec))
        at_rung: dict[int, list[float]] = {}
        reached: dict[int, list[int]] = {}  # job id -> the rungs it has reached, lowest first
        for trial in trials:
            last_step = trial.series[-1][0] if trial.series else 0
            for rung in steps:
                value = value_at(trial.series, rung)
                if rung <= last_step and value is not None:
                    at_rung.setdefault(rung, []).append(value)
                    reached.setdefault(trial.job.id, []).append(rung)
        for trial in trials:
            if trial.job.state is not JobState.RUNNING:
                continue
            # Its highest rung where enough trials can be compared: a trial that runs ahead of the
            # others (it started first, or passed several rungs between two passes) is judged where
            # they are, not let through until it ends.
            comparable = [
                r for r in reached.get(trial.job.id, []) if len(at_rung[r]) >= early.reduction_factor
            ]
            if not comparable:
                continue
            rung = comparable[-1]
            value = value_at(trial.series, rung)
            assert value is not None
            others = at_rung[rung]
            if asha_keeps(value, others, factor=early.reduction_factor, mode=spec.objective.mode):
                continue
            reason = (
                f"pruned at rung {rung} steps: {spec.objective.metric} {value:.4g} is not in the best "
                f"1/{early.reduction_factor} of the {len(others)} trials there"
            )
            self._request_prune(trial.job.id, reason)

    def _request_prune(self, job_id: int, reason: str) -> None:
        with self.db.session() as session:
            job = repository.get_job(session, job_id, for_update=True)
            if job.state is not JobState.RUNNING:
                return
            repository.request_stop(session, job, why=StopReason.PRUNED, actor="sweep", reason=reason)
            job.message = reason
        logger.info(reason, extra={"action": "trial_pruned", "job": {"id": job_id}})

    def _start_trials(self, sweep: Sweep, spec: SweepSpec, trials: Sequence[Trial]) -> int:
        unfinished = sum(1 for t in trials if t.job.state in UNFINISHED)
        next_index = max((t.job.trial or 0) + 1 for t in trials) if trials else 0
        total = spec.total_trials()
        started = 0
        while unfinished + started < spec.parallel and next_index < total:
            point = self._point(spec, next_index, trials)
            owner = User(name=sweep.owner)
            try:
                job_spec, _ = self.jobs.checked(trial_spec(spec, point, index=next_index), by=owner)
            except (InvalidSpec, ValidationError, ValueError) as err:
                self._fail(sweep.id, f"trial {next_index} cannot run: {err}")
                return started
            try:
                with self.db.session() as session:
                    repository.create_job(
                        session,
                        spec=job_spec,
                        owner=sweep.owner,
                        actor="sweep",
                        sweep_id=sweep.id,
                        trial=next_index,
                        trial_params=point,
                    )
            except IntegrityError:
                return started  # another replica created this trial: it goes on from there
            logger.info(
                "sweep %d: trial %d queued with %s",
                sweep.id,
                next_index,
                point,
                extra={"action": "trial_started", "sweep": {"id": sweep.id, "trial": next_index}},
            )
            started += 1
            next_index += 1
        return started

    def _point(self, spec: SweepSpec, index: int, trials: Sequence[Trial]) -> dict[str, Any]:
        if spec.method == "grid":
            return grid_point(spec, index)
        if spec.method == "random":
            return random_point(spec, index)
        finished = [
            (t.job.trial_params or {}, t.objective)
            for t in trials
            if t.job.state.is_terminal and t.objective is not None
        ]
        return tpe_point(spec, index, [(p, v) for p, v in finished if v is not None])

    def _finish_if_done(self, sweep_id: int, spec: SweepSpec, trials: Sequence[Trial]) -> None:
        if len(trials) < spec.total_trials() or any(not t.job.state.is_terminal for t in trials):
            return
        best = best_trial(trials, spec.objective.mode)
        with self.db.session() as session:
            sweep = repository.get_sweep(session, sweep_id, for_update=True)
            if sweep.state != RUNNING:
                return
            sweep.state, sweep.finished_at = SUCCEEDED, utcnow()
            sweep.best_job_id = best.job.id if best is not None else None
            sweep.message = (
                f"best: job {best.job.id} ({spec.objective.metric} {best.objective:.4g})"
                if best is not None and best.objective is not None
                else "no trial reported its objective"
            )
        logger.info("sweep %d done: %s", sweep_id, sweep.message, extra={"action": "sweep_done"})

    def _fail(self, sweep_id: int, message: str) -> None:
        with self.db.session() as session:
            sweep = repository.get_sweep(session, sweep_id, for_update=True)
            sweep.state, sweep.finished_at, sweep.message = FAILED, utcnow(), message[:2000]
        logger.warning("sweep %d failed: %s", sweep_id, message, extra={"action": "sweep_failed"})
