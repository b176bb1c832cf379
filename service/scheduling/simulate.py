"""Replay a job trace in simulated time through a scheduling policy (`service.scheduling.policy`), and make
traces.

    apiary simulate TRACE.csv --nodes 8 --node "CPU=32,GPU=8" --policy share-first [--json]
    apiary simulate --generate 10000 --seed 1 > trace.csv

No database and no Ray: the same `decide` the live scheduler calls, fed by an event loop. A trace is
a CSV with the columns `job_id, submit_s, queue, owner, priority, num_workers, cpu_per_worker,
gpu_per_worker, duration_s, checkpoint_every_s` and optionally `max_runtime_s` (a job's declared
limit: the policy lets it backfill when it ends before a reservation; the simulation does not stop
jobs at it).

The model:
- a job needs its whole gang (`num_workers` x (CPU, GPU)) at once; it runs `duration_s` of work,
  checkpointing every `checkpoint_every_s` of it;
- the policy is asked what to do whenever something happens (arrivals, ends; events at the same time
  are taken together). Admitted jobs start at once. A preempted job stops at once and loses the work
  since its last checkpoint (the worst case: the live service asks for a checkpoint first, so it
  usually loses less), then waits in its queue again with its original submission time;
- wait = first start - submission; utilization = busy GPU-seconds (CPU-seconds on a cluster without
  GPUs) over the capacity from the first arrival to the last end.
- money and carbon (`SimPricing`, `SimSpot`; issue 31): every held hour is priced by a signal as the
  cost ledger prices it; a seeded share of research jobs is deferrable and waits for its cheaper
  window by `decide`'s rule 0 on the duration the service would use (a wake-up event at each window's
  start); spot nodes are interrupted by a Poisson process, and a job there keeps its progress when
  the notice covers a checkpoint, else only its last periodic checkpoint. Invariant (with `check`):
  busy time = useful work + lost work, interruptions included.

`generate` writes a trace shaped like the published cluster traces (Microsoft Philly, Alibaba PAI,
Shanghai AI Lab Helios): most jobs small and short, a few large and long ones that hold most of the
GPU-hours, heavy-tailed (log-normal) durations, and bursty arrivals that follow a daily cycle. Its
parameters are `TraceShape`'s fields, each documented there.
"""

from __future__ import annotations

import csv
import heapq
import io
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, TextIO, TypeVar

import numpy as np

from service.capacity import ClusterSnapshot, Gang, NodeCapacity, fits_empty_cluster
from service.contract.queues import DEFAULT_QUEUES, QueuesConfig
from service.contract.signal import Point, Signal
from service.costs import Rates, accrue
from service.scheduling.deferral import Deferral, RecentWaits
from service.scheduling.estimates import SIZE_CLASSES, History, pace_error, simulated_remaining_s, size_class
from service.scheduling.policy import POLICIES as BASE_POLICIES
from service.scheduling.policy import RULES, Policy, Rules, decayed_usage, dominant_share
from service.scheduling.share_first import decide_share_first

COLUMNS = (
    "job_id",
    "submit_s",
    "queue",
    "owner",
    "priority",
    "num_workers",
    "cpu_per_worker",
    "gpu_per_worker",
    "duration_s",
    "checkpoint_every_s",
    "max_runtime_s",
)
END, STOP, ARRIVAL, WAKE, SPOT = 0, 1, 2, 3, 4


# The policies the simulator runs: the live two-queue policy, the baselines and share-first.
POLICIES: dict[str, Policy] = {**BASE_POLICIES, "share-first": decide_share_first}


class TraceError(ValueError):
    """The trace cannot be read."""


@dataclass(frozen=True, kw_only=True)
class TraceJob:
    job_id: int
    submit_s: float
    queue: str
    owner: str
    priority: int
    num_workers: int
    cpu_per_worker: float
    gpu_per_worker: float
    duration_s: float
    checkpoint_every_s: float
    max_runtime_s: float | None = None

    def gang(self) -> Gang:
        per_worker = {"CPU": self.cpu_per_worker}
        if self.gpu_per_worker:
            per_worker["GPU"] = self.gpu_per_worker
        return Gang(
            job_id=self.job_id,
            queue=self.queue,
            priority=self.priority,
            num_workers=self.num_workers,
            per_worker=per_worker,
            owner=self.owner,
            submitted_at=self.submit_s,
            max_runtime_s=self.max_runtime_s,
        )


# Bounds of each numeric column: (kind, low, low inclusive, high). Beyond them a value is absurd.
YEAR_S = 366 * 86_400.0
_BOUNDS: dict[str, tuple[type, float, bool, float]] = {
    "job_id": (int, 0, True, 2**53),
    "submit_s": (float, 0, True, 100 * YEAR_S),
    "priority": (int, -100, True, 100),
    "num_workers": (int, 1, True, 100_000),
    "cpu_per_worker": (float, 0, True, 1e5),
    "gpu_per_worker": (float, 0, True, 1e4),
    "duration_s": (float, 0, False, YEAR_S),
    "checkpoint_every_s": (float, 0, False, YEAR_S),
    "max_runtime_s": (float, 0, False, YEAR_S),
}


def _number(text: str, column: str) -> float:
    """One numeric cell, or ValueError saying what is wrong with it (the caller adds row and column)."""
    kind, low, inclusive, high = _BOUNDS[column]
    try:
        value: float = int(text) if kind is int else float(text)
    except ValueError:
        raise ValueError(f"must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {text!r}")
    if value < low or (value == low and not inclusive) or value > high:
        relation = ">=" if inclusive else ">"
        raise ValueError(f"must be {relation} {low:g} and <= {high:g}, got {text!r}")
    return value


def _job_from_row(row: dict[str | None, Any], width: int) -> TraceJob:
    values: dict[str, Any] = {}
    for column in COLUMNS:
        text = row.get(column)
        if text is None:
            if column == "max_runtime_s" and column not in row:
                continue  # the optional column is absent from the header
            given = sum(1 for key, value in row.items() if key is not None and value is not None)
            raise _CellError(column, f"missing (the row has {given} fields, the header {width})")
        text = text.strip()
        try:
            if column in ("queue", "owner"):
                if column == "queue" and text not in ("research", "full-scale"):
                    raise ValueError(f"must be research or full-scale, got {text!r}")
                values[column] = text
            elif column == "max_runtime_s" and not text:
                values[column] = None
            else:
                values[column] = _number(text, column)
        except ValueError as err:
            raise _CellError(column, str(err)) from None
    if values["cpu_per_worker"] == 0 and values["gpu_per_worker"] == 0:
        raise _CellError("gpu_per_worker", "with cpu_per_worker 0 too the job asks for nothing")
    return TraceJob(**values)


class _CellError(ValueError):
    def __init__(self, column: str, message: str) -> None:
        super().__init__(message)
        self.column = column


def read_trace(
    source: TextIO, *, nodes: int | None = None, node: Mapping[str, float] | None = None
) -> list[TraceJob]:
    """The jobs of a trace CSV, in submission order; `TraceError` names the first bad row and column
    (the header is row 1). A leading byte-order mark is skipped. Given `nodes` x `node`, a job whose
    gang fits no node layout of that cluster is refused too."""
    reader = csv.DictReader(source)
    fieldnames = list(reader.fieldnames or [])
    if fieldnames and fieldnames[0].startswith("\ufeff"):
        fieldnames[0] = fieldnames[0].removeprefix("\ufeff")
        reader.fieldnames = fieldnames
    missing = [column for column in COLUMNS[:-1] if column not in fieldnames]
    if missing:
        raise TraceError(f"the trace lacks the column(s) {', '.join(missing)}")
    cluster = node_cluster(nodes, node) if nodes is not None and node is not None else None
    jobs: list[TraceJob] = []
    first_row: dict[int, int] = {}
    for row_number, row in enumerate(reader, start=2):
        if row.get(None):  # DictReader files extra fields under None
            raise TraceError(
                f"trace row {row_number}: {len(fieldnames) + len(row[None])} fields, "
                f"more than the header's {len(fieldnames)}"
            )
        try:
            job = _job_from_row(row, len(fieldnames))
        except _CellError as err:
            raise TraceError(f"trace row {row_number}, column {err.column}: {err}") from None
        if job.job_id in first_row:
            raise TraceError(
                f"trace row {row_number}, column job_id: job {job.job_id} appears again "
                f"(first on row {first_row[job.job_id]})"
            )
        first_row[job.job_id] = row_number
        if cluster is not None and not fits_empty_cluster(cluster, job.gang()):
            raise TraceError(
                f"trace row {row_number}, columns num_workers, gpu_per_worker, cpu_per_worker: a gang of "
                f"{job.num_workers} x (GPU {job.gpu_per_worker:g}, CPU {job.cpu_per_worker:g}) fits no node "
                f"layout of {nodes} x {_node_text(node or {})}"
            )
        jobs.append(job)
    return sorted(jobs, key=lambda job: (job.submit_s, job.job_id))


def write_trace(jobs: Iterable[TraceJob], out: TextIO) -> None:
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for job in jobs:
        row = asdict(job)
        row["max_runtime_s"] = "" if job.max_runtime_s is None else f"{job.max_runtime_s:.0f}"
        writer.writerow(row)


def parse_node(text: str) -> dict[str, float]:
    """`"CPU=32,GPU=8"` -> {"CPU": 32.0, "GPU": 8.0}; every amount finite and >= 0, one of them > 0."""
    try:
        pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
        resources = {key.strip(): float(value) for key, value in pairs}
    except ValueError:
        raise TraceError(f"--node {text!r} must look like CPU=32,GPU=8") from None
    if not resources or any(not math.isfinite(amount) or amount < 0 for amount in resources.values()):
        raise TraceError(f"--node {text!r} must look like CPU=32,GPU=8 (finite amounts, none negative)")
    if not any(resources.values()):
        raise TraceError(f"--node {text!r} has nothing to offer: some amount must be > 0")
    return resources


def _node_text(node: Mapping[str, float]) -> str:
    return ",".join(f"{key}={amount:g}" for key, amount in node.items())


def node_cluster(nodes: int, node: Mapping[str, float]) -> ClusterSnapshot:
    return ClusterSnapshot(
        nodes=tuple(NodeCapacity(node_id=f"n{i}", resources=dict(node)) for i in range(nodes))
    )


# ---------------------------------------------------------------------------------------------------
# The simulation
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SimCosts:
    """What stopping and resuming a job costs, as on the live path."""

    # Told to stop at once, a job checkpoints at its next step boundary: its checkpoint's size over
    # the storage bandwidth (the planner's checkpoint estimate), GPUs held and no progress.
    checkpoint_s: float = 60.0
    # A resumed job starts its workers and loads its checkpoint before it makes progress again.
    restart_s: float = 120.0
    # The seed of the per-job pace errors (`service.scheduling.estimates.pace_error`).
    seed: int = 0


COSTS = SimCosts()


@dataclass(frozen=True, kw_only=True)
class SimPricing:
    """What the simulation prices, and which jobs may wait for cheaper hours."""

    # The price or carbon signal (`service.contract.signal`), in its own (Unix) times; None: no cost.
    signal: Signal | None = None
    # The trace's time 0 as a Unix time; None: the signal's first start.
    start_at: float | None = None
    rates: Rates = field(default_factory=Rates)
    # Rule 0 of `decide` on (the service with APIARY_PRICE_SIGNAL) or off (the same jobs, not deferred).
    defer: bool = True
    # This share of research jobs, drawn with `seed`, is `deferrable: {within_h: within_h}`: of those
    # whose run-time limit (declared, else the queue's default) fits in it (no one asks for the impossible).
    deferrable_share: float = 0.0
    within_h: float = 12.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.deferrable_share <= 1:
            raise ValueError(f"--deferrable-share must be in [0, 1], got {self.deferrable_share:g}")
        if not (math.isfinite(self.within_h) and self.within_h > 0):
            raise ValueError(f"--within-h must be a number > 0, got {self.within_h:g}")


@dataclass(frozen=True, kw_only=True)
class SimSpot:
    """Spot nodes: a share of the nodes, each interrupted by a Poisson process.

    At an interruption every job with a worker on the node stops and is requeued. With a notice at
    least as long as `SimCosts.checkpoint_s`, it checkpoints at its next step boundary (a step is
    taken as short against the checkpoint interval: it keeps its progress) and stops after the
    checkpoint; with a shorter notice (0: none) it keeps only its last periodic checkpoint and holds
    the node until it goes. The node is replaced at once (capacity stays constant): what this
    measures is the work lost, not the capacity."""

    share: float = 0.0
    rate_per_node_h: float = 0.0  # interruptions per spot node-hour
    notice_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 1:
            raise ValueError(f"--spot-share must be in [0, 1], got {self.share:g}")
        if not (math.isfinite(self.rate_per_node_h) and 0 <= self.rate_per_node_h <= 10):
            raise ValueError(f"--spot-rate must be in [0, 10] per node-hour, got {self.rate_per_node_h:g}")
        if not (math.isfinite(self.notice_s) and 0 <= self.notice_s <= 3600):
            raise ValueError(f"--spot-notice-s must be in [0, 3600], got {self.notice_s:g}")


NO_PRICING = SimPricing()
NO_SPOT = SimSpot()


def in_trace_time(signal: Signal, *, start_at: float | None) -> Signal:
    """The signal shifted so that `start_at` (default: its first start) is the trace's time 0."""
    offset = start_at if start_at is not None else (signal.points[0].start if signal.points else 0.0)
    return Signal(points=tuple(Point(p.start - offset, p.end - offset, p.value) for p in signal.points))


class InvariantError(AssertionError):
    """The simulation broke one of its invariants (a bug, never bad input)."""


@dataclass
class _Run:
    """A job's state in the simulation."""

    job: TraceJob
    gang: Gang
    work_s: float  # what it runs: its duration, cut at its max_runtime_s (the live service stops it)
    error: float  # the factor by which its measured pace errs
    done_s: float = 0.0  # work kept (up to its last checkpoint when it stopped)
    started_at: float | None = None  # admission of the current run; None while waiting
    resume_s: float = 0.0  # the restart the current run pays before progress (0 on a first start)
    frozen_at: float | None = None  # told to stop at once: no progress after this
    stop_at: float | None = None  # a stopping run's stop time
    keep_s: float = 0.0  # the work a stopping run keeps
    expected_s: float | None = None  # what the service expected of the job when the current run began
    placement: tuple[int, ...] = ()
    first_start: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    held_s: float = 0.0  # seconds holding its gang, every run
    queued_s: float = 0.0  # every second spent waiting, before the first start and after preemptions
    queued_since: float | None = None
    version: int = 0  # bumped on each start, so stale events are recognised
    deadline: float | None = None  # a deferrable job's
    deferred: bool = False  # it waited for a cheaper window at least once
    interrupted: bool = False  # the current stop is a spot interruption
    interrupt_lost_s: float = 0.0  # progress discarded by interruptions
    interruptions: int = 0
    cost: float = 0.0
    priced_h: float = 0.0  # resource-hours the signal priced

    def progress(self, now: float) -> float:
        if self.started_at is None:
            return self.done_s
        until = now if self.frozen_at is None else min(now, self.frozen_at)
        return self.done_s + min(self.work_s - self.done_s, max(0.0, until - self.started_at - self.resume_s))

    @property
    def lost_s(self) -> float:
        """Seconds it held its gang without keeping the progress: restarts, checkpoints at a stop."""
        return max(0.0, self.held_s - self.done_s) if self.started_at is None else 0.0


@dataclass(frozen=True, kw_only=True)
class WaitStats:
    jobs: int
    p50: float
    p95: float
    p99: float
    mean: float
    max: float


@dataclass(frozen=True, kw_only=True)
class QueueStats:
    wait: WaitStats  # first start - submission
    queued: WaitStats  # all time queued, preemptions included
    preemptions_per_job: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    policy: str
    jobs: int
    unfinished: int
    utilization: float
    preemptions: int
    lost_work_s: float  # held without progress kept (restarts, stop checkpoints), in job-seconds
    lost_gpu_s: float  # the same in GPU-seconds
    lost_gpu_hours: float
    busy_gpu_s: float  # GPU-seconds held by jobs, start to end
    makespan_s: float
    queues: dict[str, QueueStats]
    size_classes: dict[str, WaitStats]
    decisions: int = 0
    refused: int = 0  # jobs the queues' limits refuse at submission (too many workers, too long)
    cut_at_limit: int = 0  # jobs stopped at their max_runtime_s (declared, else the queue's default)
    rules: dict[str, bool] = field(default_factory=dict)
    # Money and carbon (SimPricing, SimSpot): cost in the signal's unit over every held hour.
    cost: float = 0.0
    cost_unit: str = "price"
    priced_hours: float = 0.0  # GPU-hours (CPU-hours without GPUs) the signal priced
    deferrable: int = 0
    deferrable_cost: float = 0.0  # the deferrable jobs' share of `cost`
    deferred: int = 0  # deferrable jobs that waited for a cheaper window
    deadlines_missed: int = 0  # deferrable jobs that ended after their deadline (or never)
    deferrable_wait: WaitStats | None = None
    spot_nodes: int = 0
    interruptions: int = 0  # runs stopped by a spot interruption
    interrupt_lost_gpu_hours: float = 0.0  # progress those interruptions discarded

    def to_json(self) -> dict[str, Any]:
        def stats(value: WaitStats) -> dict[str, Any]:
            return {"jobs": value.jobs, "wait_s": {k: v for k, v in asdict(value).items() if k != "jobs"}}

        return {
            "policy": self.policy,
            "jobs": self.jobs,
            "unfinished": self.unfinished,
            "refused": self.refused,
            "cut_at_limit": self.cut_at_limit,
            "utilization": round(self.utilization, 4),
            "preemptions": self.preemptions,
            "lost_work_s": round(self.lost_work_s, 1),
            "lost_gpu_s": round(self.lost_gpu_s, 1),
            "lost_gpu_hours": round(self.lost_gpu_hours, 2),
            "busy_gpu_s": round(self.busy_gpu_s, 1),
            "makespan_s": round(self.makespan_s, 1),
            "decisions": self.decisions,
            "rules": self.rules,
            "cost": round(self.cost, 4),
            "cost_unit": self.cost_unit,
            "priced_hours": round(self.priced_hours, 2),
            "deferrable": self.deferrable,
            "deferrable_cost": round(self.deferrable_cost, 4),
            "deferred": self.deferred,
            "deadlines_missed": self.deadlines_missed,
            "deferrable_wait": None if self.deferrable_wait is None else stats(self.deferrable_wait),
            "spot_nodes": self.spot_nodes,
            "interruptions": self.interruptions,
            "interrupt_lost_gpu_hours": round(self.interrupt_lost_gpu_hours, 3),
            "queues": {
                name: {
                    **stats(value.wait),
                    "queued_s": {k: v for k, v in asdict(value.queued).items() if k != "jobs"},
                    "preemptions_per_job": round(value.preemptions_per_job, 4),
                }
                for name, value in self.queues.items()
            },
            "size_classes": {name: stats(value) for name, value in self.size_classes.items()},
        }


def limits(job: TraceJob, queues: QueuesConfig) -> tuple[str | None, float | None]:
    """(why the live service refuses the job at submission or None, the max_runtime_s it runs under)."""
    config = queues.of(job.queue)
    if config.max_workers_per_job is not None and job.num_workers > config.max_workers_per_job:
        return f"more than {config.max_workers_per_job} workers", None
    if (
        config.max_runtime_s is not None
        and job.max_runtime_s is not None
        and job.max_runtime_s > config.max_runtime_s
    ):
        return f"max_runtime_s over {config.max_runtime_s:g}", None
    return None, job.max_runtime_s if job.max_runtime_s is not None else config.default_max_runtime_s


def simulate(
    jobs: Sequence[TraceJob],
    *,
    nodes: int,
    node: dict[str, float],
    policy: str = "two-queue",
    queues: QueuesConfig = DEFAULT_QUEUES,
    rules: Rules = RULES,
    costs: SimCosts = COSTS,
    pricing: SimPricing = NO_PRICING,
    spot: SimSpot = NO_SPOT,
    check: bool = False,
) -> SimResult:
    """Run `jobs` on `nodes` x `node` through `policy` until every job that can ever run has finished.

    The policy knows what the live service knows: history's estimate of a queued job's duration, a
    running job's remaining time from its (erring) pace, and where gangs are placed. With `check`,
    the invariants are verified at every event (`InvariantError`).

    With `pricing`, every held hour is priced by its signal, and deferrable jobs wait for their
    cheaper window by `decide`'s rule 0, from the same duration the service would use (max_runtime_s,
    else history's estimate), never the true one; only the two-queue policy has rule 0. With `spot`,
    some nodes are interrupted (`SimSpot`)."""
    decide = POLICIES[policy]
    check_jobs(jobs)
    cluster = node_cluster(nodes, node)
    totals = {key: amount * nodes for key, amount in node.items()}
    busy_key = "GPU" if totals.get("GPU") else "CPU"
    runs: dict[int, _Run] = {}
    refused = 0
    signal = None if pricing.signal is None else in_trace_time(pricing.signal, start_at=pricing.start_at)
    deferral = Deferral(signal=signal) if signal is not None and pricing.defer else None
    # Each queue's recent admission waits (as the live scheduler keeps them), from joining the line:
    # a deferred job joins it when its window begins.
    recent_waits = RecentWaits()
    window_at: dict[int, float] = {}
    marks = np.random.default_rng([pricing.seed, 1]).random(len(jobs))
    for index, job in enumerate(jobs):
        why, limit = limits(job, queues)
        if why is not None:
            refused += 1
            continue
        deadline = (
            job.submit_s + pricing.within_h * 3600
            if job.queue == "research"
            and marks[index] < pricing.deferrable_share
            and limit is not None
            and limit <= pricing.within_h * 3600
            else None
        )
        gang = replace(job.gang(), max_runtime_s=limit, deadline=deadline)
        work_s = min(job.duration_s, limit) if limit is not None else job.duration_s
        runs[job.job_id] = _Run(
            job=job,
            gang=gang,
            work_s=work_s,
            error=pace_error(job.job_id, seed=costs.seed),
            deadline=deadline,
        )
    cut_at_limit = sum(1 for run in runs.values() if run.work_s < run.job.duration_s)
    # A job that could never fit the empty cluster never runs: counted as unfinished.
    runnable = {job_id for job_id, run in runs.items() if fits_empty_cluster(cluster, run.gang)}
    # (time, kind, job, version); a STOP at the time of a preemption makes the policy decide again.
    events: list[tuple[float, int, int, int]] = []
    for job_id in runnable:
        heapq.heappush(events, (runs[job_id].job.submit_s, ARRIVAL, job_id, 0))
    arrivals_left = len(runnable)
    wakes: set[float] = set()
    spot_rng = np.random.default_rng([spot.seed, 2])
    spot_count = round(spot.share * nodes)
    spot_nodes = sorted(int(i) for i in spot_rng.permutation(nodes)[:spot_count])
    interruptions = 0

    def next_interruption(node_index: int, after: float) -> None:
        if spot.rate_per_node_h > 0:
            at = after + float(spot_rng.exponential(3600 / spot.rate_per_node_h))
            heapq.heappush(events, (at, SPOT, node_index, 0))

    for node_index in spot_nodes:
        next_interruption(node_index, min((job.submit_s for job in jobs), default=0.0))
    waiting: dict[int, _Run] = {}
    running: dict[int, _Run] = {}
    usage: dict[str, float] = {}
    history = History()
    # job -> ((history's version, work done), history's estimate, the gang the policy sees)
    estimates: dict[int, tuple[tuple[int, float], float | None, Gang]] = {}
    history_version = 0
    submits = [job.submit_s for job in jobs]
    clock = min(submits, default=0.0)
    # Utilization counts busy time inside [first arrival, last submission]: the drain tail is left out.
    window = (min(submits, default=0.0), max(submits, default=0.0))
    busy_s = busy_window_s = 0.0
    preemptions = decisions = 0

    def queued_gang(run: _Run) -> Gang:
        """The job as the policy sees it queued: history's estimate of what is left of it."""
        key = (history_version, run.done_s)
        cached = estimates.get(run.job.job_id)
        if cached is not None and cached[0] == key:
            return cached[2]
        expected = history.estimate(
            owner=run.job.owner,
            name=None,
            size=run.gang.totals.get(busy_key, 0.0),
            declared_s=run.gang.max_runtime_s,
        )
        left = None if expected is None else max(0.0, expected - run.done_s)
        if left is not None and run.done_s > 0:
            left += costs.restart_s
        gang = replace(run.gang, estimated_runtime_s=left)
        estimates[run.job.job_id] = (key, expected, gang)
        return gang

    def stop(run: _Run, now: float) -> None:
        assert run.started_at is not None
        run.held_s += now - run.started_at
        if signal is not None:
            accrued = accrue(
                signal, resources=run.gang.total(), start=run.started_at, end=now, rates=pricing.rates
            )
            run.cost += accrued.cost
            run.priced_h += accrued.priced_hours
        run.started_at = run.frozen_at = run.stop_at = None

    def interrupt(run: _Run, now: float) -> None:
        """Its node goes (`SimSpot`): what it keeps, and when it stops."""
        assert run.started_at is not None
        progress = run.progress(now)
        every = run.job.checkpoint_every_s
        saved = max(run.done_s, math.floor(progress / every + 1e-9) * every)
        if now < run.started_at + run.resume_s:
            run.keep_s, run.stop_at = run.done_s, now  # still restarting: nothing to save
        elif spot.notice_s >= costs.checkpoint_s:
            run.keep_s, run.frozen_at, run.stop_at = progress, now, now + costs.checkpoint_s
        else:
            run.keep_s, run.frozen_at, run.stop_at = saved, now, now + spot.notice_s
        run.keep_s = min(run.keep_s, progress)
        run.interrupted = True
        run.interrupt_lost_s += progress - run.keep_s
        heapq.heappush(events, (run.stop_at, STOP, run.job.job_id, run.version))

    while events:
        now = events[0][0]
        # Account for the time since the last event: busy resources and owners' usage.
        elapsed = now - clock
        if elapsed > 0:
            held = sum(run.gang.totals.get(busy_key, 0.0) for run in running.values())
            busy_s += held * elapsed
            busy_window_s += held * max(0.0, min(now, window[1]) - max(clock, window[0]))
            rates: dict[str, float] = {}
            for run in running.values():
                rates[run.job.owner] = rates.get(run.job.owner, 0.0) + dominant_share(run.gang, totals)
            for owner in usage.keys() | rates.keys():
                usage[owner] = decayed_usage(
                    usage.get(owner, 0.0),
                    rate=rates.get(owner, 0.0),
                    elapsed_s=elapsed,
                    half_life_s=queues.fair_share_half_life_s,
                )
        clock = now
        while events and events[0][0] <= now:
            _, kind, job_id, version = heapq.heappop(events)
            if kind == WAKE:
                wakes.discard(now)
                continue
            if kind == SPOT:  # job_id is the node's index
                for hit in [other for other in running.values() if job_id in other.placement]:
                    interrupt(hit, now)
                if arrivals_left or running or waiting:
                    next_interruption(job_id, now)
                continue
            run = runs[job_id]
            if kind == ARRIVAL:
                arrivals_left -= 1
                waiting[job_id] = run
                run.queued_since = now
            elif job_id in running and version == run.version:
                if kind == END and run.progress(now) >= run.work_s - 1e-6:
                    running.pop(job_id)
                    stop(run, now)
                    run.done_s, run.finished_at = run.work_s, now
                    history.record(
                        owner=run.job.owner,
                        name=None,
                        size=run.gang.totals.get(busy_key, 0.0),
                        duration_s=run.work_s,
                    )
                    history_version += 1
                elif kind == STOP and run.stop_at is not None and run.stop_at <= now:
                    running.pop(job_id)
                    run.done_s = run.keep_s
                    stop(run, now)
                    if run.interrupted:
                        interruptions += 1
                        run.interruptions += 1
                        run.interrupted = False
                    else:
                        preemptions += 1
                        run.preemptions += 1
                    run.queued_since = now
                    waiting[job_id] = run
        if check:
            _check_invariants(running, cluster)
        if not waiting:
            continue
        active = [_active_gang(run, now=now) for run in running.values()]
        if deferral is not None:
            deferral = replace(deferral, expected_wait_s=recent_waits.expected())
        result = decide(
            cluster=cluster,
            queued=[queued_gang(run) for run in waiting.values()],
            active=active,
            now=now,
            queues=queues,
            usage=usage,
            rules=rules,
            explain=False,
            deferral=deferral,
        )
        decisions += 1
        for job_id, start_at in result.deferred_until.items():
            window_at[job_id] = start_at
            runs[job_id].deferred = True
            if start_at > now and start_at not in wakes:
                wakes.add(start_at)
                heapq.heappush(events, (start_at, WAKE, 0, 0))
        for victim in result.preempt:
            run = running[victim.job_id]
            if run.stop_at is not None:
                continue  # already stopping (preempted, or its node is going)
            assert run.started_at is not None
            progress = run.progress(now)
            if now < run.started_at + run.resume_s:
                run.keep_s, run.stop_at = run.done_s, now  # still restarting: nothing to save
            elif victim.at_checkpoint:
                every = run.job.checkpoint_every_s
                run.keep_s = min(run.work_s, math.ceil(progress / every - 1e-9) * every)
                run.stop_at = now + (run.keep_s - progress)
            else:
                run.keep_s, run.frozen_at, run.stop_at = progress, now, now + costs.checkpoint_s
            if run.keep_s >= run.work_s:
                run.stop_at = now + (run.work_s - progress)  # it ends before it would stop
            else:
                heapq.heappush(events, (run.stop_at, STOP, run.job.job_id, run.version))
        for job_id in result.admit:
            run = waiting.pop(job_id)
            run.resume_s = costs.restart_s if run.done_s > 0 else 0.0
            run.started_at = now
            queued_gang(run)
            run.expected_s = estimates[job_id][1]
            run.first_start = now if run.first_start is None else run.first_start
            queued_since = run.queued_since if run.queued_since is not None else now
            recent_waits.add(run.job.queue, now - max(queued_since, window_at.pop(job_id, 0.0)))
            run.queued_s += now - queued_since
            run.queued_since = None
            run.placement = result.placements[job_id]
            run.version += 1
            running[job_id] = run
            heapq.heappush(events, (now + run.resume_s + run.work_s - run.done_s, END, job_id, run.version))
    summary = _summarize(
        runs,
        policy=policy,
        rules=rules,
        totals=totals,
        busy_s=busy_s,
        busy_window_s=busy_window_s,
        window=window,
        busy_key=busy_key,
        preemptions=preemptions,
        decisions=decisions,
        jobs=len(jobs),
        refused=refused,
        cut_at_limit=cut_at_limit,
    )
    summary = _priced(summary, runs, pricing=pricing, busy_key=busy_key)
    summary = replace(
        summary,
        spot_nodes=len(spot_nodes),
        interruptions=interruptions,
        interrupt_lost_gpu_hours=sum(
            run.interrupt_lost_s * run.gang.totals.get("GPU", 0.0) for run in runs.values()
        )
        / 3600,
    )
    if check:
        useful = sum(
            run.work_s * run.gang.totals.get(busy_key, 0.0) for run in runs.values() if run.finished_at
        )
        lost = sum(run.lost_s * run.gang.totals.get(busy_key, 0.0) for run in runs.values())
        if not math.isclose(busy_s, useful + lost, rel_tol=1e-9, abs_tol=1e-3):
            raise InvariantError(f"busy {busy_s} != useful {useful} + lost {lost}")
    return summary


def _priced(result: SimResult, runs: Mapping[int, _Run], *, pricing: SimPricing, busy_key: str) -> SimResult:
    """The result with its cost and its deferrable jobs' deadlines and waits."""
    deferrable = [run for run in runs.values() if run.deadline is not None]
    missed = sum(
        1
        for run in deferrable
        if run.deadline is not None and (run.finished_at is None or run.finished_at > run.deadline + 1e-6)
    )
    return replace(
        result,
        cost=sum(run.cost for run in runs.values()),
        cost_unit=pricing.rates.unit,
        priced_hours=sum(run.priced_h for run in runs.values()),
        deferrable=len(deferrable),
        deferrable_cost=sum(run.cost for run in deferrable),
        deferred=sum(1 for run in deferrable if run.deferred),
        deadlines_missed=missed,
        deferrable_wait=wait_stats([_wait(run) for run in deferrable if run.first_start is not None]),
    )


def _check_invariants(running: Mapping[int, _Run], cluster: ClusterSnapshot) -> None:
    """No node over capacity; every running gang whole (a placement for each of its bundles)."""
    free = [node.free() for node in cluster.nodes]
    for run in running.values():
        bundles = run.gang.bundles()
        if len(run.placement) != len(bundles):
            raise InvariantError(f"job {run.job.job_id} runs {len(run.placement)} of {len(bundles)} bundles")
        for index, bundle in zip(run.placement, bundles, strict=True):
            for key, amount in bundle.items():
                free[index][key] = free[index].get(key, 0.0) - amount
    for index, left in enumerate(free):
        if any(amount < -1e-6 for amount in left.values()):
            raise InvariantError(f"node {index} is over capacity: {left}")


def _active_gang(run: _Run, *, now: float) -> Gang:
    """The running job as the service sees it: no true end, but its pace's estimate."""
    started = run.started_at if run.started_at is not None else now
    progress = run.progress(now)
    if run.stop_at is not None:
        return replace(
            run.gang, started_at=started, stopping=True, stops_at=run.stop_at, placement=run.placement
        )
    ran_s = now - started - run.resume_s
    remaining = simulated_remaining_s(
        true_remaining_s=run.work_s - progress,
        error=run.error,
        ran_s=max(0.0, ran_s),
        expected_s=run.expected_s,
        done_s=progress,
    )
    every = run.job.checkpoint_every_s
    saved = math.floor(progress / every + 1e-9) * every
    return replace(
        run.gang,
        started_at=started,
        # The last periodic checkpoint of this run, as a time (None before its first one).
        last_checkpoint_at=started + run.resume_s + saved - run.done_s if saved > run.done_s else None,
        expected_end_at=None if remaining is None else now + max(0.0, -ran_s) + remaining,
        placement=run.placement,
    )


def _summarize(
    runs: dict[int, _Run],
    *,
    policy: str,
    rules: Rules,
    totals: dict[str, float],
    busy_s: float,
    busy_window_s: float,
    window: tuple[float, float],
    busy_key: str,
    preemptions: int,
    decisions: int,
    jobs: int,
    refused: int,
    cut_at_limit: int,
) -> SimResult:
    finished = [run for run in runs.values() if run.finished_at is not None]
    start = window[0]
    end = max((run.finished_at or 0.0 for run in finished), default=start)
    makespan = max(end - start, 1e-9)
    capacity = totals.get(busy_key, 0.0)
    span = window[1] - window[0]
    if not capacity:
        utilization = 0.0
    elif span > 0:
        utilization = busy_window_s / (capacity * span)
    else:  # every job was submitted at once: the window is empty, so count to the last end
        utilization = busy_s / (capacity * makespan)
    by_queue: dict[str, list[_Run]] = {queue: [] for queue in ("full-scale", "research")}
    by_size: dict[str, list[float]] = {}
    for run in finished:
        by_queue.setdefault(run.job.queue, []).append(run)
        by_size.setdefault(size_class(run.gang.totals.get(busy_key, 0.0)), []).append(_wait(run))
    lost_s = sum(run.lost_s for run in runs.values())
    lost_gpu_s = sum(run.lost_s * run.gang.totals.get("GPU", 0.0) for run in runs.values())
    return SimResult(
        policy=policy,
        jobs=jobs,
        unfinished=jobs - refused - len(finished),
        utilization=utilization,
        preemptions=preemptions,
        lost_work_s=lost_s,
        lost_gpu_s=lost_gpu_s,
        lost_gpu_hours=lost_gpu_s / 3600,
        busy_gpu_s=busy_s if busy_key == "GPU" else 0.0,
        makespan_s=makespan,
        queues={name: queue_stats(members, wait=_wait) for name, members in sorted(by_queue.items())},
        size_classes={name: wait_stats(by_size[name]) for _, name in SIZE_CLASSES if name in by_size},
        decisions=decisions,
        refused=refused,
        cut_at_limit=cut_at_limit,
        rules=asdict(rules),
    )


def _wait(run: _Run) -> float:
    return (run.first_start if run.first_start is not None else run.job.submit_s) - run.job.submit_s


def check_jobs(jobs: Sequence[TraceJob]) -> None:
    """ValueError naming the job and field of the first value `read_trace` would refuse."""
    seen: set[int] = set()
    for job in jobs:
        for column in _BOUNDS:
            value = getattr(job, column)
            if value is None and column == "max_runtime_s":
                continue
            try:
                _number(str(value), column)
            except ValueError as err:
                raise ValueError(f"job {job.job_id}, {column}: {err}") from None
        if job.job_id in seen:
            raise ValueError(f"job {job.job_id}, job_id: appears twice")
        seen.add(job.job_id)


class Waited(Protocol):
    """A job as the wait statistics see it (a simulated run, or a job that really ran)."""

    @property
    def queued_s(self) -> float: ...

    @property
    def preemptions(self) -> int: ...


W = TypeVar("W", bound=Waited)


def queue_stats(members: Sequence[W], *, wait: Callable[[W], float]) -> QueueStats:
    """A queue's waits (`wait`: first start - submission), all time queued, and preemptions per job."""
    return QueueStats(
        wait=wait_stats([wait(member) for member in members]),
        queued=wait_stats([member.queued_s for member in members]),
        preemptions_per_job=sum(member.preemptions for member in members) / max(1, len(members)),
    )


def wait_stats(waits: list[float]) -> WaitStats:
    ordered = sorted(waits)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0

    return WaitStats(
        jobs=len(ordered),
        p50=round(pct(0.50), 1),
        p95=round(pct(0.95), 1),
        p99=round(pct(0.99), 1),
        mean=round(statistics.fmean(ordered), 1) if ordered else 0.0,
        max=round(ordered[-1], 1) if ordered else 0.0,
    )


# ---------------------------------------------------------------------------------------------------
# Trace generation
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TraceShape:
    """The shape of a generated trace. Defaults follow what the Philly, PAI and Helios studies report
    for GPU clusters, scaled to `nodes` x `gpus_per_node`."""

    nodes: int = 8
    gpus_per_node: int = 8
    cpus_per_gpu: int = 4
    # The work submitted over the trace, as a fraction of the cluster's GPU-seconds over its span.
    offered_load: float = 0.9
    # Research jobs are most jobs, small and short; full-scale jobs are few, large and long.
    research_fraction: float = 0.85
    # GPUs per job and their weights, per queue (a job takes whole nodes above one node's GPUs).
    research_gpus: tuple[tuple[int, float], ...] = ((1, 0.55), (2, 0.2), (4, 0.15), (8, 0.1))
    full_scale_gpus: tuple[tuple[int, float], ...] = ((8, 0.3), (16, 0.35), (32, 0.25), (64, 0.1))
    # Log-normal durations: median seconds and sigma (a heavy tail), capped.
    research_median_s: float = 75 * 60
    research_sigma: float = 1.5
    research_cap_s: float = 4 * 3600
    full_scale_median_s: float = 2 * 3600
    full_scale_sigma: float = 0.8
    full_scale_cap_s: float = 24 * 3600
    # A job declares a max_runtime_s this many times its true duration (users overestimate), at most its cap.
    runtime_overestimate: tuple[float, float] = (1.2, 3.0)
    # Whether jobs declare a max_runtime_s at all (the published traces have none).
    declare_runtimes: bool = True
    checkpoint_every_s: tuple[float, float] = (600, 1800)  # research, full-scale
    owners: int = 20
    # Arrivals follow a daily cycle: the rate swings by this fraction around its mean.
    daily_swing: float = 0.6
    high_priority_fraction: float = 0.05


def generate(count: int, *, seed: int, shape: TraceShape = TraceShape()) -> list[TraceJob]:
    """`count` jobs drawn from `shape`, submitted over a span that makes the offered load
    `shape.offered_load`."""
    rng = np.random.default_rng(seed)
    capacity_gpus = shape.nodes * shape.gpus_per_node
    research = rng.random(count) < shape.research_fraction
    owner_weights = 1.0 / np.arange(1, shape.owners + 1)  # a few owners submit most (Zipf)
    owner_weights /= owner_weights.sum()
    drafts: list[dict[str, Any]] = []
    for index in range(count):
        is_research = bool(research[index])
        sizes, weights = zip(*(shape.research_gpus if is_research else shape.full_scale_gpus), strict=True)
        gpus = min(int(rng.choice(sizes, p=np.asarray(weights) / sum(weights))), capacity_gpus)
        median, sigma, cap = (
            (shape.research_median_s, shape.research_sigma, shape.research_cap_s)
            if is_research
            else (shape.full_scale_median_s, shape.full_scale_sigma, shape.full_scale_cap_s)
        )
        duration = float(min(cap, max(60.0, rng.lognormal(math.log(median), sigma))))
        workers = max(1, gpus // shape.gpus_per_node) if gpus > shape.gpus_per_node else 1
        per_worker = gpus // workers
        low, high = shape.runtime_overestimate
        drafts.append(
            {
                "queue": "research" if is_research else "full-scale",
                "owner": f"user{int(rng.choice(shape.owners, p=owner_weights)):02d}",
                "priority": 10 if rng.random() < shape.high_priority_fraction else 0,
                "num_workers": workers,
                "cpu_per_worker": float(per_worker * shape.cpus_per_gpu),
                "gpu_per_worker": float(per_worker),
                "duration_s": round(duration, 1),
                "checkpoint_every_s": shape.checkpoint_every_s[0 if is_research else 1],
                "max_runtime_s": round(min(cap, duration * rng.uniform(low, high)), 0)
                if shape.declare_runtimes
                else None,
            }
        )
    work = sum(d["num_workers"] * d["gpu_per_worker"] * d["duration_s"] for d in drafts)
    span = work / (shape.offered_load * capacity_gpus)
    times = _daily_arrivals(count, span=span, swing=shape.daily_swing, rng=rng)
    return [
        TraceJob(job_id=index + 1, submit_s=round(float(at), 1), **draft)
        for index, (at, draft) in enumerate(zip(times, drafts, strict=True))
    ]


def _daily_arrivals(count: int, *, span: float, swing: float, rng: np.random.Generator) -> np.ndarray:
    """`count` arrival times over [0, span): a Poisson process whose rate follows a daily sine."""
    # Draw on a fine grid by thinning: accept t with probability (1 + swing sin(2 pi t / day)) / (1 + swing).
    day = 86_400.0
    accepted: list[float] = []
    while len(accepted) < count:
        candidates = rng.uniform(0, span, size=count * 2)
        keep = rng.random(candidates.size) < (1 + swing * np.sin(2 * math.pi * candidates / day)) / (
            1 + swing
        )
        accepted.extend(candidates[keep].tolist())
    return np.sort(np.asarray(accepted[:count]))


def trace_csv(jobs: Iterable[TraceJob]) -> str:
    out = io.StringIO()
    write_trace(jobs, out)
    return out.getvalue()
