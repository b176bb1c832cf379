"""The Prometheus metrics' own rules (service.observability): one registry per service, gauges that never
fail a scrape, a bound on per-job series. The scrape through the API is in
tests/integration/test_prometheus.py."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from service import observability
from service.contract.states import JobState
from service.observability import MAX_JOB_SERIES, Gauges, Metrics, RankFigures, RunningJob


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }


def test_each_service_counts_in_its_own_registry() -> None:
    one, two = Metrics(), Metrics()
    one.points_ingested(5)
    one.job_restarted(queue="research")
    assert samples(one)[("apiary_metric_points_ingested_total", ())] == 5
    assert samples(two)[("apiary_metric_points_ingested_total", ())] == 0
    assert samples(one)[("apiary_restarts_total", (("queue", "research"),))] == 1
    assert samples(two)[("apiary_restarts_total", (("queue", "research"),))] == 0


def test_a_database_that_cannot_be_read_gives_database_up_0() -> None:
    metrics = Metrics()

    def broken() -> Gauges:
        raise OSError("connection refused")

    metrics.watch_database(broken)
    found = samples(metrics)
    assert found[("apiary_database_up", ())] == 0
    assert not any(name == "apiary_jobs" for name, _ in found)
    assert found[("apiary_scheduler_pass_seconds_count", ())] == 0  # the event metrics still answer


def test_per_job_series_are_bounded_and_every_queue_and_state_has_a_series() -> None:
    metrics = Metrics()
    running = [
        RunningJob(job_id=i, queue="research", step=i, samples_per_s=None) for i in range(MAX_JOB_SERIES + 50)
    ]
    metrics.watch_database(
        lambda: Gauges(
            jobs={("research", JobState.RUNNING): len(running)}, workers={}, in_use={}, running=running
        )
    )
    found = samples(metrics)
    steps = [labels for name, labels in found if name == "apiary_job_step"]
    assert len(steps) == MAX_JOB_SERIES
    assert ("job_id", str(MAX_JOB_SERIES)) not in {label for labels in steps for label in labels}
    assert not any(name == "apiary_job_samples_per_second" for name, _ in found)
    jobs = {labels: value for (name, labels), value in found.items() if name == "apiary_jobs"}
    assert len(jobs) == 2 * len(JobState)
    assert jobs[(("queue", "research"), ("state", "running"))] == len(running)
    assert jobs[(("queue", "full-scale"), ("state", "queued"))] == 0


def test_per_rank_series_are_bounded_over_all_jobs_and_the_rest_counted(monkeypatch: Any) -> None:
    monkeypatch.setattr(observability, "MAX_RANK_SERIES", 4)
    figures = {"cpu_percent": 50.0, "rss_bytes": 1e9, "data_read_bytes": 10, "gpu_memory_bytes": None}

    def job(job_id: int) -> RunningJob:
        ranks = [
            RankFigures(rank=rank, system=figures, outliers=("rss_bytes",) * (rank == 2))
            for rank in (2, 0, 1)
        ]
        return RunningJob(job_id=job_id, queue="research", step=1, samples_per_s=None, ranks=ranks)

    metrics = Metrics()
    metrics.watch_database(lambda: Gauges(jobs={}, workers={}, in_use={}, running=[job(8), job(7)]))
    found = samples(metrics)
    shown = sorted(
        (dict(labels)["job_id"], dict(labels)["rank"])
        for name, labels in found
        if name == "apiary_rank_cpu_percent"
    )
    assert shown == [("7", "0"), ("7", "1"), ("7", "2"), ("8", "0")]  # job id order, then rank order
    assert found[("apiary_rank_series_left_out", ())] == 2
    assert found[("apiary_rank_data_read_bytes_total", (("job_id", "7"), ("rank", "1")))] == 10
    assert not any(name == "apiary_rank_gpu_memory_bytes" for name, _ in found)  # not known: no series
    outliers = [labels for name, labels in found if name == "apiary_rank_outlier"]
    assert outliers == [(("figure", "rss_bytes"), ("job_id", "7"), ("rank", "2"))]
