"""Replay a job trace in simulated time through a scheduling policy (`service.scheduling.policy`), and make
traces.

    apiary simulate TRACE.csv --nodes 8 --node "CPU=32,GPU=8" --policy two-queue|fifo|greedy [--json]
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
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TextIO

import numpy as np

from service.capacity import ClusterSnapshot, Gang, NodeCapacity, fits_empty_cluster
from service.contract.queues import DEFAULT_QUEUES, QueuesConfig
from service.scheduling.policy import POLICIES, RULES, Rules, decayed_usage, dominant_share

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
END, ARRIVAL, DECIDE = 0, 1, 2
# Size classes by the GPUs a job holds (CPUs on a cluster without GPUs): upper bounds.
SIZE_CLASSES = ((1, "1"), (8, "2-8"), (32, "9-32"), (math.inf, "33+"))


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


def read_trace(source: TextIO) -> list[TraceJob]:
    """The jobs of a trace CSV, in submission order; `TraceError` names the first bad row."""
    reader = csv.DictReader(source)
    missing = [column for column in COLUMNS[:-1] if column not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(f"the trace lacks the column(s) {', '.join(missing)}")
    jobs = []
    for line, row in enumerate(reader, start=2):
        try:
            job = TraceJob(
                job_id=int(row["job_id"]),
                submit_s=float(row["submit_s"]),
                queue=row["queue"],
                owner=row["owner"],
                priority=int(row["priority"]),
                num_workers=int(row["num_workers"]),
                cpu_per_worker=float(row["cpu_per_worker"]),
                gpu_per_worker=float(row["gpu_per_worker"]),
                duration_s=float(row["duration_s"]),
                checkpoint_every_s=float(row["checkpoint_every_s"]),
                max_runtime_s=float(row["max_runtime_s"]) if row.get("max_runtime_s") else None,
            )
        except (TypeError, ValueError) as err:
            raise TraceError(f"trace line {line}: {err}") from None
        if job.queue not in ("research", "full-scale"):
            raise TraceError(f"trace line {line}: queue must be research or full-scale, got {job.queue!r}")
        if job.num_workers < 1 or job.duration_s <= 0 or job.checkpoint_every_s <= 0:
            raise TraceError(f"trace line {line}: num_workers, duration_s and checkpoint_every_s must be > 0")
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
    """`"CPU=32,GPU=8"` -> {"CPU": 32.0, "GPU": 8.0}."""
    try:
        pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
        resources = {key.strip(): float(value) for key, value in pairs}
    except ValueError:
        raise TraceError(f"--node {text!r} must look like CPU=32,GPU=8") from None
    if not resources or any(amount < 0 for amount in resources.values()):
        raise TraceError(f"--node {text!r} must look like CPU=32,GPU=8")
    return resources


# ---------------------------------------------------------------------------------------------------
# The simulation
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """A job's state in the simulation."""

    job: TraceJob
    gang: Gang
    done_s: float = 0.0  # work completed and kept (up to the last checkpoint when preempted)
    started_at: float | None = None  # of the current run; None while waiting
    first_start: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    lost_work_s: float = 0.0
    version: int = 0  # bumped on each start, so stale end events are recognised

    def progress(self, now: float) -> float:
        return self.done_s + (now - self.started_at if self.started_at is not None else 0.0)

    def last_checkpoint(self, now: float) -> float:
        """Work saved at the last periodic checkpoint of the current run."""
        every = self.job.checkpoint_every_s
        return math.floor(self.progress(now) / every + 1e-9) * every


@dataclass(frozen=True, kw_only=True)
class WaitStats:
    jobs: int
    p50: float
    p95: float
    p99: float
    mean: float
    max: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    policy: str
    jobs: int
    unfinished: int
    utilization: float
    preemptions: int
    lost_work_s: float  # work thrown away by preemptions, in job-seconds
    lost_gpu_hours: float
    makespan_s: float
    queues: dict[str, WaitStats]
    size_classes: dict[str, WaitStats]
    decisions: int = 0
    rules: dict[str, bool] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        def stats(value: WaitStats) -> dict[str, Any]:
            return {"jobs": value.jobs, "wait_s": {k: v for k, v in asdict(value).items() if k != "jobs"}}

        return {
            "policy": self.policy,
            "jobs": self.jobs,
            "unfinished": self.unfinished,
            "utilization": round(self.utilization, 4),
            "preemptions": self.preemptions,
            "lost_work_s": round(self.lost_work_s, 1),
            "lost_gpu_hours": round(self.lost_gpu_hours, 2),
            "makespan_s": round(self.makespan_s, 1),
            "decisions": self.decisions,
            "rules": self.rules,
            "queues": {name: stats(value) for name, value in self.queues.items()},
            "size_classes": {name: stats(value) for name, value in self.size_classes.items()},
        }


def simulate(
    jobs: Sequence[TraceJob],
    *,
    nodes: int,
    node: dict[str, float],
    policy: str = "two-queue",
    queues: QueuesConfig = DEFAULT_QUEUES,
    rules: Rules = RULES,
) -> SimResult:
    """Run `jobs` on `nodes` x `node` through `policy` until every job that can ever run has finished."""
    decide = POLICIES[policy]
    cluster = ClusterSnapshot(
        nodes=tuple(NodeCapacity(node_id=f"n{i}", resources=node) for i in range(nodes))
    )
    totals = {key: amount * nodes for key, amount in node.items()}
    runs = {job.job_id: _Run(job=job, gang=job.gang()) for job in jobs}
    # A job that could never fit the empty cluster never runs: counted as unfinished.
    runnable = {job_id for job_id, run in runs.items() if fits_empty_cluster(cluster, run.gang)}
    # (time, kind, job, version); kinds: END, ARRIVAL, DECIDE (decide again: preempted jobs stopped).
    events: list[tuple[float, int, int, int]] = []
    for job in jobs:
        if job.job_id in runnable:
            heapq.heappush(events, (job.submit_s, ARRIVAL, job.job_id, 0))
    waiting: dict[int, _Run] = {}
    running: dict[int, _Run] = {}
    usage: dict[str, float] = {}
    clock = jobs[0].submit_s if jobs else 0.0
    busy_s = 0.0
    busy_key = "GPU" if totals.get("GPU") else "CPU"
    preemptions = 0
    decisions = 0
    while events:
        now = events[0][0]
        # Account for the time since the last event: busy resources and owners' usage.
        elapsed = now - clock
        if elapsed > 0:
            busy_s += sum(run.gang.totals.get(busy_key, 0.0) for run in running.values()) * elapsed
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
            if kind == ARRIVAL:
                waiting[job_id] = runs[job_id]
            elif kind == END and job_id in running and version == runs[job_id].version:
                run = running.pop(job_id)
                run.done_s, run.started_at, run.finished_at = run.job.duration_s, None, now
        if not waiting:
            continue
        active = [_active_gang(run, now=now) for run in running.values()]
        result = decide(
            cluster=cluster,
            queued=[run.gang for run in waiting.values()],
            active=active,
            now=now,
            queues=queues,
            usage=usage,
            rules=rules,
            explain=False,
        )
        decisions += 1
        for victim in result.preempt:
            run = running.pop(victim.job_id)
            saved = run.last_checkpoint(now)
            run.lost_work_s += run.progress(now) - saved
            run.done_s, run.started_at = saved, None
            run.preemptions += 1
            preemptions += 1
            waiting[victim.job_id] = run
        for job_id in result.admit:
            run = waiting.pop(job_id)
            run.started_at = now
            run.first_start = now if run.first_start is None else run.first_start
            run.version += 1
            running[job_id] = run
            heapq.heappush(events, (now + run.job.duration_s - run.done_s, END, job_id, run.version))
        if result.preempt:
            # Preempted jobs stop at once here: decide again at the same time, with their room free.
            heapq.heappush(events, (now, DECIDE, 0, 0))
    return _summarize(
        runs,
        policy=policy,
        rules=rules,
        totals=totals,
        busy_s=busy_s,
        busy_key=busy_key,
        preemptions=preemptions,
        decisions=decisions,
    )


def _active_gang(run: _Run, *, now: float) -> Gang:
    started = run.started_at if run.started_at is not None else now
    # The last periodic checkpoint of this run, as a time (None before its first one).
    saved = run.last_checkpoint(now)
    return replace(
        run.gang,
        started_at=started,
        last_checkpoint_at=started + saved - run.done_s if saved >= run.done_s else None,
        expected_end_at=started + run.job.duration_s - run.done_s,
    )


def _summarize(
    runs: dict[int, _Run],
    *,
    policy: str,
    rules: Rules,
    totals: dict[str, float],
    busy_s: float,
    busy_key: str,
    preemptions: int,
    decisions: int,
) -> SimResult:
    finished = [run for run in runs.values() if run.finished_at is not None]
    start = min((run.job.submit_s for run in runs.values()), default=0.0)
    end = max((run.finished_at or 0.0 for run in finished), default=start)
    makespan = max(end - start, 1e-9)
    by_queue: dict[str, list[float]] = {}
    by_size: dict[str, list[float]] = {}
    for run in finished:
        wait = (run.first_start or run.job.submit_s) - run.job.submit_s
        by_queue.setdefault(run.job.queue, []).append(wait)
        size = run.gang.totals.get(busy_key, 0.0)
        label = next(name for bound, name in SIZE_CLASSES if size <= bound)
        by_size.setdefault(label, []).append(wait)
    lost_gpu_s = sum(run.lost_work_s * run.gang.totals.get("GPU", 0.0) for run in runs.values())
    return SimResult(
        policy=policy,
        jobs=len(runs),
        unfinished=len(runs) - len(finished),
        utilization=busy_s / (totals.get(busy_key, 0.0) * makespan) if totals.get(busy_key) else 0.0,
        preemptions=preemptions,
        lost_work_s=sum(run.lost_work_s for run in runs.values()),
        lost_gpu_hours=lost_gpu_s / 3600,
        makespan_s=makespan,
        queues={name: _stats(waits) for name, waits in sorted(by_queue.items())},
        size_classes={name: _stats(by_size[name]) for _, name in SIZE_CLASSES if name in by_size},
        decisions=decisions,
        rules=asdict(rules),
    )


def _stats(waits: list[float]) -> WaitStats:
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
                "max_runtime_s": round(min(cap, duration * rng.uniform(low, high)), 0),
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
