"""What-if on the service's own history: `apiary simulate --from-db [--since 14d] --queues other.yaml`.

The jobs submitted in the window that ran and ended (any end: succeeded, failed, cancelled or pruned
after they started) become a trace (`service.scheduling.simulate.TraceJob`) with their real
submission times, gangs and running time (`service.scheduling.history.EndedJob`); the simulator
replays it through another queue configuration, and `Observed` says what really happened to the same
jobs, in the simulator's terms. What the trace cannot say: jobs still queued or running at the end of
the window, and jobs submitted before it, are not replayed (the real waits saw them); jobs cancelled
before they started are left out; a job's resources other than CPU and GPU (and the data CPUs of
each job) are not modelled; its checkpoint interval is `every_s`, else `every_steps` at its last
measured pace, else its whole run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from service.capacity import ClusterSnapshot, fits_empty_cluster
from service.contract.states import TERMINAL_STATES
from service.scheduling.estimates import SIZE_CLASSES, size_class
from service.scheduling.history import EndedJob, ended_jobs
from service.scheduling.simulate import QueueStats, TraceJob, WaitStats, queue_stats, wait_stats
from service.store import repository
from service.store.db import Database

# `load_ended` refuses a window with more jobs than this (a shorter --since replays it).
MAX_REPLAY_JOBS = 200_000
MAX_SINCE_S = 100 * 366 * 86_400.0


@dataclass(frozen=True, kw_only=True)
class Observed:
    """What really happened to the replayed jobs, in the simulator's terms (`SimResult`'s keys)."""

    jobs: int
    preemptions: int
    queues: dict[str, QueueStats]
    size_classes: dict[str, WaitStats]

    def to_json(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "preemptions": self.preemptions,
            "queues": {
                name: {
                    "jobs": value.wait.jobs,
                    "wait_s": _without_jobs(value.wait),
                    "queued_s": _without_jobs(value.queued),
                    "preemptions_per_job": round(value.preemptions_per_job, 4),
                }
                for name, value in self.queues.items()
            },
            "size_classes": {
                name: {"jobs": value.jobs, "wait_s": _without_jobs(value)}
                for name, value in self.size_classes.items()
            },
        }


def _without_jobs(stats: WaitStats) -> dict[str, float]:
    return {"p50": stats.p50, "p95": stats.p95, "p99": stats.p99, "mean": stats.mean, "max": stats.max}


@dataclass(frozen=True, kw_only=True)
class Replay:
    """The window's jobs as a trace, what really happened to them, and the jobs left out (and why)."""

    trace: list[TraceJob]
    observed: Observed
    left_out: dict[str, int] = field(default_factory=dict)


def load_ended(db: Database, *, submitted_since: float) -> list[EndedJob]:
    """Every job submitted since `submitted_since` (unix seconds) that ran and ended, oldest first;
    ValueError when there are more than `MAX_REPLAY_JOBS`."""
    since = datetime.fromtimestamp(submitted_since, UTC)
    with db.session() as session:
        rows = repository.ended_runs(
            session, states=tuple(TERMINAL_STATES), submitted_since=since, limit=MAX_REPLAY_JOBS + 1
        )
        if len(rows) > MAX_REPLAY_JOBS:
            raise ValueError(
                f"more than {MAX_REPLAY_JOBS} jobs ran and ended in the window: replay a shorter --since"
            )
        return ended_jobs(session, rows)


def replay(jobs: Sequence[EndedJob], *, cluster: ClusterSnapshot, busy_key: str) -> Replay:
    """`jobs` as a trace from the first submission on (time 0), and what really happened to them, on
    `cluster` (a job whose gang fits no node layout of it is a ValueError naming the job). A job that
    asks for neither CPU nor GPU is left out (the simulator models those two)."""
    trace: list[TraceJob] = []
    kept: list[EndedJob] = []
    left_out: dict[str, int] = {}
    start = min((job.submitted_at for job in jobs), default=0.0)
    for job in jobs:
        per_worker = job.spec.resources_per_worker
        cpu, gpu = per_worker.get("CPU", 0.0), per_worker.get("GPU", 0.0)
        if cpu <= 0 and gpu <= 0:
            left_out["asks for neither CPU nor GPU"] = left_out.get("asks for neither CPU nor GPU", 0) + 1
            continue
        duration_s = max(1.0, round(job.ran_s, 1))
        traced = TraceJob(
            job_id=job.job_id,
            submit_s=round(job.submitted_at - start, 1),
            queue=job.queue,
            owner=job.owner,
            priority=job.priority,
            num_workers=job.spec.min_workers,
            cpu_per_worker=cpu,
            gpu_per_worker=gpu,
            duration_s=duration_s,
            checkpoint_every_s=_checkpoint_every_s(job, duration_s=duration_s),
            max_runtime_s=job.spec.max_runtime_s,
        )
        if not fits_empty_cluster(cluster, traced.gang()):
            raise ValueError(
                f"job {job.job_id} ({job.name}): a gang of {traced.num_workers} x (GPU {gpu:g}, CPU {cpu:g}) "
                f"fits no node layout of the simulated cluster: give its shape with --nodes and --node"
            )
        trace.append(traced)
        kept.append(job)
    if not trace:
        raise ValueError(f"nothing to replay: every job was left out ({', '.join(left_out)})")
    return Replay(trace=trace, observed=observe(kept, busy_key=busy_key), left_out=left_out)


def _checkpoint_every_s(job: EndedJob, *, duration_s: float) -> float:
    """Its periodic checkpoints' interval: `every_s`, else `every_steps` at its measured pace, else only
    the final one (its duration)."""
    every = [duration_s]
    if job.spec.checkpoint.every_s is not None:
        every.append(job.spec.checkpoint.every_s)
    if job.spec.checkpoint.every_steps is not None and job.seconds_per_step:
        every.append(job.spec.checkpoint.every_steps * job.seconds_per_step)
    return max(1.0, round(min(every), 1))


def observe(jobs: Sequence[EndedJob], *, busy_key: str) -> Observed:
    """The real waits of `jobs`, as the simulator reports its own: per queue the wait (first admission
    - submission) and all time queued, per size class of `busy_key` (GPU or CPU) the wait."""
    by_queue: dict[str, list[EndedJob]] = {queue: [] for queue in ("full-scale", "research")}
    by_size: dict[str, list[float]] = {}
    for job in jobs:
        by_queue.setdefault(job.queue, []).append(job)
        amount = job.spec.min_workers * job.spec.resources_per_worker.get(busy_key, 0.0)
        by_size.setdefault(size_class(amount), []).append(_wait(job))
    return Observed(
        jobs=len(jobs),
        preemptions=sum(job.preemptions for job in jobs),
        queues={name: queue_stats(members, wait=_wait) for name, members in sorted(by_queue.items())},
        size_classes={name: wait_stats(by_size[name]) for _, name in SIZE_CLASSES if name in by_size},
    )


def _wait(job: EndedJob) -> float:
    admitted = job.first_admitted_at if job.first_admitted_at is not None else job.submitted_at
    return max(0.0, admitted - job.submitted_at)


def parse_since(text: str) -> float:
    """`"14d"`, `"12h"`, `"30m"`, `"90s"` or `"2w"` -> seconds; ValueError for anything else."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, "w": 7 * 86_400.0}
    number, unit = text.strip()[:-1], text.strip()[-1:].lower()
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or not 0 < value * units[unit] <= MAX_SINCE_S:
        raise ValueError(f"--since must be a positive duration such as 14d, 12h or 30m, got {text!r}")
    return value * units[unit]
