"""Prometheus metrics of the service: the one module that imports `prometheus_client`.

Two kinds, in one `CollectorRegistry` per `Metrics` (a process may run several services, as the tests
do, and each scrape must see only its own):

- events, counted where they happen (`Metrics` methods, called by the scheduler loop and the job
  service): admission waits, scheduler passes, worker-group restarts, recoveries, preemptions, metric
  points ingested. They count what this process saw since it started (Prometheus' `rate()` and
  `increase()` take care of restarts);
- state, read from the database at scrape time (`DatabaseCollector`, fed by `JobService.gauges()`):
  jobs by queue and state, queue depth, running workers, resources held per queue, the step and
  samples/s of each running job, and what each of its ranks' processes uses (CPU, memory, GPU, data
  and network bytes: the last `SystemStats` a rank posted) with the figures it stands out in. Cheap
  queries only: grouped counts and the active jobs, never the metric points.

The pure policy and the trainers know nothing of this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.contract.spec import Queue
from service.contract.states import JobState

logger = logging.getLogger(__name__)

# What `GET /metrics` answers with (Prometheus' text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# At most this many running jobs get per-job series (the oldest first): a bound on label cardinality
# whatever the cluster's size. Only running jobs have them, so ended jobs' series disappear.
MAX_JOB_SERIES = 500

# At most this many ranks get per-rank series (`apiary_rank_*`), all jobs together: the running jobs in
# id order, each one's ranks in order, until the bound; the ranks beyond it are counted in
# `apiary_rank_series_left_out`. Each rank has at most 7 series (and one per figure it stands out in).
MAX_RANK_SERIES = 1024

# A job waits seconds in the research queue and hours (or days) in full-scale.
ADMISSION_WAIT_BUCKETS_S = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400, 259200)
SCHEDULER_PASS_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, kw_only=True)
class RankFigures:
    """What one rank's process uses (`service.contract.protocol.SystemStats`), as its series show it."""

    rank: int
    system: Mapping[str, float | None]
    outliers: Sequence[str] = ()  # the figures in which it stands out (service.store.repository)


@dataclass(frozen=True, kw_only=True)
class RunningJob:
    """A running job as its per-job series show it."""

    job_id: int
    queue: str
    step: int | None
    samples_per_s: float | None  # all ranks together
    ranks: Sequence[RankFigures] = ()


# (series name, SystemStats field, help, counter?) of each rank's system figures.
RANK_SERIES = (
    ("apiary_rank_cpu_percent", "cpu_percent", "CPU of a rank's process, in percent of one core.", False),
    ("apiary_rank_rss_bytes", "rss_bytes", "Resident memory of a rank's process.", False),
    (
        "apiary_rank_gpu_utilization_percent",
        "gpu_utilization_percent",
        "Utilization of a rank's GPU (NVML), when it trains on one.",
        False,
    ),
    (
        "apiary_rank_gpu_memory_bytes",
        "gpu_memory_bytes",
        "GPU memory a rank's process holds (torch's caching allocator), when it trains on a GPU.",
        False,
    ),
    (
        "apiary_rank_data_read_bytes",
        "data_read_bytes",
        "Bytes a rank's data pipeline received since its process started.",
        True,
    ),
    (
        "apiary_rank_network_sent_bytes",
        "net_sent_bytes",
        "Bytes the node of a rank sent (its network namespace, loopback left out).",
        True,
    ),
    (
        "apiary_rank_network_received_bytes",
        "net_recv_bytes",
        "Bytes the node of a rank received (its network namespace, loopback left out).",
        True,
    ),
)


@dataclass(frozen=True, kw_only=True)
class Gauges:
    """What the database says at scrape time (`JobService.gauges()`)."""

    jobs: Mapping[tuple[str, JobState], int]  # (queue, state) -> jobs, every state
    workers: Mapping[str, int]  # queue -> workers of its running (and preempting) jobs
    in_use: Mapping[str, Mapping[str, float]]  # queue -> resource -> amount its active jobs hold
    running: Sequence[RunningJob]
    # The spot nodes alive and their resources (None while Ray cannot be read), and the interruptions
    # the scheduler has recorded (service.store.repository.spot_history).
    spot_nodes: int | None = None
    spot_capacity: Mapping[str, float] | None = None
    spot_interruptions: int = 0


class DatabaseCollector(Collector):
    """Gauges computed at scrape time from `read()`. A database that cannot be read gives
    `apiary_database_up 0` and no other gauge, never a failed scrape."""

    def __init__(self, read: Callable[[], Gauges]) -> None:
        self._read = read

    def describe(self) -> Iterator[Metric]:
        return iter(())  # registered without a first query; names are not checked for clashes

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("apiary_database_up", "Whether the last scrape could read the database.")
        try:
            gauges = self._read()
        except Exception as err:
            logger.warning("metrics: cannot read the database: %s", err, extra={"action": "metrics_failed"})
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        queues = sorted({queue.value for queue in Queue} | {queue for queue, _ in gauges.jobs})

        jobs = GaugeMetricFamily("apiary_jobs", "Jobs by queue and state.", labels=["queue", "state"])
        depth = GaugeMetricFamily("apiary_queue_depth", "Jobs waiting in the queue.", labels=["queue"])
        for queue in queues:
            for state in JobState:
                jobs.add_metric([queue, state.value], gauges.jobs.get((queue, state), 0))
            depth.add_metric([queue], gauges.jobs.get((queue, JobState.QUEUED), 0))
        yield jobs
        yield depth

        workers = GaugeMetricFamily(
            "apiary_running_workers", "Workers of the running (and preempting) jobs.", labels=["queue"]
        )
        for queue in queues:
            workers.add_metric([queue], gauges.workers.get(queue, 0))
        yield workers

        in_use = GaugeMetricFamily(
            "apiary_queue_resources_in_use",
            "Cluster resources that the queue's active jobs (admitted to preempting) hold, with each "
            "job's data-loading CPUs.",
            labels=["queue", "resource"],
        )
        for queue in queues:
            for resource, amount in sorted(gauges.in_use.get(queue, {}).items()):
                in_use.add_metric([queue, resource], amount)
        yield in_use

        step = GaugeMetricFamily(
            "apiary_job_step", "The latest step of a running job.", labels=["job_id", "queue"]
        )
        speed = GaugeMetricFamily(
            "apiary_job_samples_per_second",
            "Training samples a second of a running job, all ranks together (smoothed).",
            labels=["job_id", "queue"],
        )
        for job in sorted(gauges.running, key=lambda job: job.job_id)[:MAX_JOB_SERIES]:
            labels = [str(job.job_id), job.queue]
            if job.step is not None:
                step.add_metric(labels, job.step)
            if job.samples_per_s is not None:
                speed.add_metric(labels, job.samples_per_s)
        yield step
        yield speed
        yield from _rank_series(gauges.running)
        yield from _spot_series(gauges)


def _spot_series(gauges: Gauges) -> Iterator[Metric]:
    interruptions = CounterMetricFamily(
        "apiary_spot_interruptions",
        "Spot nodes that left the cluster as interruptions (not idle scale-downs), as recorded by the "
        "scheduler in the database (so it survives restarts).",
    )
    interruptions.add_metric([], gauges.spot_interruptions)
    yield interruptions
    if gauges.spot_nodes is None or gauges.spot_capacity is None:
        return
    nodes = GaugeMetricFamily("apiary_spot_nodes", "Alive Ray nodes marked spot.")
    nodes.add_metric([], gauges.spot_nodes)
    yield nodes
    capacity = GaugeMetricFamily(
        "apiary_spot_capacity",
        "Resources of the alive spot nodes (GPU, CPU, ...), summed.",
        labels=["resource"],
    )
    for resource in sorted({"CPU", "GPU", *gauges.spot_capacity}):
        capacity.add_metric([resource], gauges.spot_capacity.get(resource, 0.0))
    yield capacity


def _rank_series(running: Sequence[RunningJob]) -> Iterator[Metric]:
    """Each rank's system figures, for at most `MAX_RANK_SERIES` ranks (labels: job_id, rank)."""
    families = {
        name: (CounterMetricFamily if counter else GaugeMetricFamily)(name, text, labels=["job_id", "rank"])
        for name, _, text, counter in RANK_SERIES
    }
    outlier = GaugeMetricFamily(
        "apiary_rank_outlier",
        "1 for each system figure in which a rank stands out from the other ranks of its job.",
        labels=["job_id", "rank", "figure"],
    )
    left_out = 0
    shown = 0
    for job in sorted(running, key=lambda job: job.job_id):
        for rank in sorted(job.ranks, key=lambda rank: rank.rank):
            if shown >= MAX_RANK_SERIES:
                left_out += 1
                continue
            shown += 1
            labels = [str(job.job_id), str(rank.rank)]
            for name, field, _, _ in RANK_SERIES:
                value = rank.system.get(field)
                if value is not None:
                    families[name].add_metric(labels, value)
            for figure in rank.outliers:
                outlier.add_metric([*labels, figure], 1)
    yield from families.values()
    yield outlier
    missing = GaugeMetricFamily(
        "apiary_rank_series_left_out",
        f"Ranks of running jobs without apiary_rank_* series (beyond {MAX_RANK_SERIES} ranks in all).",
    )
    missing.add_metric([], left_out)
    yield missing


class Metrics:
    """The service's metric objects, in their own registry. Events are counted through the methods;
    `watch_database` adds the scrape-time gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.admission_wait = Histogram(
            "apiary_admission_wait_seconds",
            "From entering the queue (submitted or requeued) to admission.",
            ["queue"],
            buckets=ADMISSION_WAIT_BUCKETS_S,
            registry=self.registry,
        )
        self.scheduler_pass = Histogram(
            "apiary_scheduler_pass_seconds",
            "One scheduler pass by the leader: reconcile, enforce, schedule, retain.",
            buckets=SCHEDULER_PASS_BUCKETS_S,
            registry=self.registry,
        )
        self.restarts = Counter(
            "apiary_restarts",
            "Worker groups restarted by Ray Train from their checkpoint (seen in the telemetry).",
            ["queue"],
            registry=self.registry,
        )
        self.recoveries = Counter(
            "apiary_recoveries",
            "Jobs resubmitted from their checkpoint after losing their driver, Ray job or cluster, or "
            "hanging.",
            ["queue"],
            registry=self.registry,
        )
        self.preemptions = Counter(
            "apiary_preemptions",
            "Running jobs told to checkpoint and requeue, by the policy or by a user.",
            ["queue", "by"],
            registry=self.registry,
        )
        self.metric_points = Counter(
            "apiary_metric_points_ingested",
            "Metric points received from trainer ranks (a re-posted point counts again).",
            registry=self.registry,
        )
        self.export_dropped_points = Counter(
            "apiary_export_dropped_points",
            "Metric points a tracker (TensorBoard, MLflow) could not take for too long, and dropped.",
            ["sink"],
            registry=self.registry,
        )
        for sink in ("tensorboard", "mlflow"):
            self.export_dropped_points.labels(sink)
        for queue in Queue:  # every series from the start: a dashboard sees 0, not nothing
            self.admission_wait.labels(queue.value)
            self.restarts.labels(queue.value)
            self.recoveries.labels(queue.value)
            for by in ("policy", "user"):
                self.preemptions.labels(queue.value, by)

    def watch_database(self, read: Callable[[], Gauges]) -> None:
        """Serve the gauges that `read` computes at each scrape."""
        self.registry.register(DatabaseCollector(read))

    def render(self) -> bytes:
        """The text exposition of everything (what `GET /metrics` answers)."""
        return generate_latest(self.registry)

    # -- events ---------------------------------------------------------------------------------

    def job_admitted(self, *, queue: str, waited_s: float) -> None:
        self.admission_wait.labels(queue).observe(max(0.0, waited_s))

    def scheduler_passed(self, *, duration_s: float) -> None:
        self.scheduler_pass.observe(duration_s)

    def job_restarted(self, *, queue: str) -> None:
        self.restarts.labels(queue).inc()

    def job_recovered(self, *, queue: str) -> None:
        self.recoveries.labels(queue).inc()

    def job_preempted(self, *, queue: str, by: str) -> None:
        self.preemptions.labels(queue, by).inc()

    def export_dropped(self, sink: str, count: int) -> None:
        self.export_dropped_points.labels(sink).inc(count)

    def points_ingested(self, count: int) -> None:
        if count:
            self.metric_points.inc(count)
