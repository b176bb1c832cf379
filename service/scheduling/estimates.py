"""What the service can know of how long a job runs, for the policy and its simulator alike.

- A queued job: its declared `max_runtime_s` (a bound: the job is stopped there) and what history
  says, the median duration of the last finished jobs of the same owner, name and size class, else of the same
  owner and size class, else of the size class (`History`). Neither: unknown (None).
- A running job: its measured pace, the seconds per step so far times the steps left to `max_steps`
  (`pace_remaining_s`), once it has run `PACE_AFTER_S` (before that the pace says little: start-up,
  compilation, the first checkpoint). The simulator knows the true remaining time and spoils it the
  way a measured pace errs: times a fixed log-normal factor per job (`PACE_ERROR_SIGMA`), used only
  after `PACE_AFTER_S` of running (`simulated_remaining_s`). The live scheduler has the pace its
  trainers report (`live_remaining_s`), and its history is what its database says of the jobs that
  ran and ended (`service.scheduling.history.LiveHistory`); a job's size there is `job_size`.

No I/O here.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

# A measured pace is trusted after this many seconds of running.
PACE_AFTER_S = 300.0
# The simulator's error of a pace-based remaining time: a log-normal factor with this sigma, per job.
PACE_ERROR_SIGMA = 0.3
# History: an estimate needs at least this many finished jobs of the same kind, and uses the last ones.
HISTORY_MIN_JOBS = 3
HISTORY_KEEP = 50
# Size classes by the GPUs a job holds (CPUs on a cluster without GPUs): upper bounds.
SIZE_CLASSES = ((1, "1"), (8, "2-8"), (32, "9-32"), (math.inf, "33+"))


def size_class(amount: float) -> str:
    return next(name for bound, name in SIZE_CLASSES if amount <= bound)


@dataclass
class History:
    """Durations of finished jobs, by (owner, name, size class), (owner, size class) and size class."""

    keep: int = HISTORY_KEEP
    min_jobs: int = HISTORY_MIN_JOBS
    _seen: dict[tuple[str, str, str], deque[float]] = field(default_factory=dict)

    def record(self, *, owner: str, name: str | None, size: float, duration_s: float) -> None:
        for key in self._keys(owner, name, size):
            self._seen.setdefault(key, deque(maxlen=self.keep)).append(duration_s)

    def estimate(
        self, *, owner: str, name: str | None, size: float, declared_s: float | None = None
    ) -> float | None:
        """The job's expected duration in seconds: history's median, never beyond `declared_s`."""
        estimate = None
        for key in self._keys(owner, name, size):
            durations = self._seen.get(key)
            if durations is not None and len(durations) >= self.min_jobs:
                estimate = statistics.median(durations)
                break
        if declared_s is not None:
            return declared_s if estimate is None else min(estimate, declared_s)
        return estimate

    @staticmethod
    def _keys(owner: str, name: str | None, size: float) -> list[tuple[str, str, str]]:
        kind = size_class(size)
        keys = [("owner-size", owner, kind), ("size", "", kind)]
        return [("owner-name", owner, f"{name}|{kind}"), *keys] if name else keys


def job_size(per_worker: dict[str, float], num_workers: int) -> float:
    """A job's size for its size class in the live service: the GPUs its workers hold, or their CPUs
    when it asks for no GPU (the simulator counts the cluster's busy resource, the same on a cluster
    of one kind)."""
    gpus = per_worker.get("GPU", 0.0)
    return num_workers * (gpus if gpus > 0 else per_worker.get("CPU", 0.0))


def live_remaining_s(*, ran_s: float, pace_s: float | None, expected_s: float | None) -> float | None:
    """What the live service believes is left of a running job whose current attempt has run `ran_s`:
    its measured pace's estimate `pace_s` (seconds per step times the steps left) once it has run
    `PACE_AFTER_S`; before that, history's `expected_s` less what it has run; without history, the
    early pace (better than nothing); else None. The caller bounds it by the job's max_runtime_s."""
    if pace_s is not None and ran_s >= PACE_AFTER_S:
        return pace_s
    if expected_s is not None:
        return max(0.0, expected_s - ran_s)
    return pace_s


def pace_remaining_s(*, ran_s: float, steps_done: int, max_steps: int | None) -> float | None:
    """Seconds left at the pace measured so far; None before `PACE_AFTER_S` or without a pace."""
    if max_steps is None or steps_done <= 0 or ran_s < PACE_AFTER_S:
        return None
    return ran_s / steps_done * max(0, max_steps - steps_done)


def pace_error(job_id: int, *, seed: int = 0, sigma: float = PACE_ERROR_SIGMA) -> float:
    """The fixed factor by which the simulated pace of job `job_id` errs (median 1)."""
    return float(np.random.default_rng([seed, job_id]).lognormal(0.0, sigma))


def simulated_remaining_s(
    *, true_remaining_s: float, error: float, ran_s: float, expected_s: float | None, done_s: float
) -> float | None:
    """What the service would believe is left of a running job: the pace's estimate (the truth times
    `error`) once it has run `PACE_AFTER_S`, else what was expected of it before it started
    (`expected_s` of work in all, `done_s` done) or None."""
    if ran_s >= PACE_AFTER_S:
        return true_remaining_s * error
    if expected_s is None:
        return None
    return max(0.0, expected_s - done_s)
