"""`GET /metrics` (Prometheus) over real HTTP, on SQLite and PostgreSQL, with a fake cluster: scraped after
submitting, cancelling, admitting, running, restarting, recovering and preempting jobs and posting
telemetry, parsed with prometheus_client's own text parser."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from service.cluster import RayJobStatus
from tests.integration.conftest import Service
from tests.integration.test_scheduler import EVEN, run_to_running

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "job",
    "num_workers": 2,
    "max_steps": 100,
    "max_failures": 2,
}


def scrape(service: Service) -> Samples:
    response = service.http.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def names(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(labels) for sample, labels in samples if sample == name]


def telemetry(service: Service, job_id: int, batch: dict[str, Any]) -> None:
    response = service.report(job_id, batch)
    assert response.status_code == 202, response.text


def points(steps: range, *, step_time_s: float) -> list[dict[str, Any]]:
    return [
        {"step": step, "rank": rank, "time": time.time(), "values": {"loss": 1.0, "step_time_s": step_time_s}}
        for step in steps
        for rank in (0, 1)
    ]


def test_the_scrape_shows_jobs_queues_workers_progress_and_events(
    service: Service, spec: dict[str, Any]
) -> None:
    # 8 CPU: two 2-worker jobs (3 CPU each with their data CPU) run, a third waits, a fourth is cancelled.
    first, second, _waiting, cancelled = (service.submit({**spec, "name": f"j{i}"})["id"] for i in range(4))
    assert service.http.post(f"/jobs/{cancelled}/cancel").status_code == 200
    run_to_running(service, [first, second])  # two scheduler passes

    telemetry(service, first, {"attempt": 1, "segment": 1000, "points": points(range(1, 6), step_time_s=0.5)})
    # Ray Train restarted the group from step 3: a new segment, a restart.
    telemetry(
        service,
        first,
        {
            "attempt": 1,
            "segment": 2000,
            "points": points(range(4, 8), step_time_s=0.5),
            "events": [
                {
                    "kind": "group_started",
                    "step": 3,
                    "rank": 0,
                    "time": time.time(),
                    "message": "worker group started",
                }
            ],
        },
    )
    samples = scrape(service)

    assert value(samples, "apiary_database_up") == 1
    assert value(samples, "apiary_jobs", queue="research", state="running") == 2
    assert value(samples, "apiary_jobs", queue="research", state="queued") == 1
    assert value(samples, "apiary_jobs", queue="research", state="cancelled") == 1
    assert value(samples, "apiary_jobs", queue="full-scale", state="running") == 0
    assert value(samples, "apiary_queue_depth", queue="research") == 1
    assert value(samples, "apiary_queue_depth", queue="full-scale") == 0
    assert value(samples, "apiary_running_workers", queue="research") == 4
    assert value(samples, "apiary_queue_resources_in_use", queue="research", resource="CPU") == 6
    # Per-job series: running jobs only, by id. `first` trained to step 7 at 0.5 s a step, 2 x 8 samples.
    assert value(samples, "apiary_job_step", job_id=str(first), queue="research") == 7
    assert value(samples, "apiary_job_samples_per_second", job_id=str(first), queue="research") == 32
    assert {labels["job_id"] for labels in names(samples, "apiary_job_step")} == {str(first)}
    assert value(samples, "apiary_metric_points_ingested_total") == 18
    assert value(samples, "apiary_restarts_total", queue="research") == 1
    assert value(samples, "apiary_admission_wait_seconds_count", queue="research") == 2
    assert value(samples, "apiary_admission_wait_seconds_count", queue="full-scale") == 0
    assert 0 <= value(samples, "apiary_admission_wait_seconds_sum", queue="research") < 120
    assert value(samples, "apiary_scheduler_pass_seconds_count") == 2
    assert value(samples, "apiary_preemptions_total", queue="research", by="user") == 0

    # A user preempts `first`; Ray loses `second`'s Ray job: a recovery.
    assert service.http.post(f"/jobs/{first}/preempt").status_code == 200
    del service.backend.statuses[service.backend.submission_of(second)]
    service.tick()
    assert service.job(second)["state"] == "recovering"
    samples = scrape(service)
    assert value(samples, "apiary_preemptions_total", queue="research", by="user") == 1
    assert value(samples, "apiary_preemptions_total", queue="research", by="policy") == 0
    assert value(samples, "apiary_recoveries_total", queue="research") == 1
    assert value(samples, "apiary_jobs", queue="research", state="preempting") == 1
    assert value(samples, "apiary_jobs", queue="research", state="recovering") == 1
    assert value(samples, "apiary_running_workers", queue="research") == 2  # the preempting job's
    assert names(samples, "apiary_job_step") == []  # no job is running now
    assert value(samples, "apiary_scheduler_pass_seconds_count") == 3


def test_a_policy_preemption_and_the_requeued_jobs_wait_are_counted(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(queues=EVEN)
    research = [service.submit({**spec, "name": f"r{i}", "num_workers": 1})["id"] for i in range(3)]
    run_to_running(service, research)
    service.submit({**spec, "name": "fs", "queue": "full-scale", "num_workers": 3})  # takes its share back
    service.tick()
    victim = next(job_id for job_id in research if service.job(job_id)["state"] == "preempting")
    samples = scrape(service)
    assert value(samples, "apiary_preemptions_total", queue="research", by="policy") == 1
    assert value(samples, "apiary_preemptions_total", queue="full-scale", by="policy") == 0

    service.backend.statuses[service.job(victim)["ray_submission_id"]] = RayJobStatus.SUCCEEDED
    service.tick()  # the victim is requeued, the full-scale job admitted
    assert service.job(victim)["state"] == "queued"
    time.sleep(1.1)
    service.http.post(f"/jobs/{research[0] if research[0] != victim else research[1]}/cancel")
    service.tick()  # room again: the victim is admitted, having waited since its requeue
    assert service.job(victim)["state"] == "admitted"
    samples = scrape(service)
    assert value(samples, "apiary_admission_wait_seconds_count", queue="research") == 4
    assert value(samples, "apiary_admission_wait_seconds_count", queue="full-scale") == 1
    # The requeued victim waited about 1 s, not since its first submission; it is the one wait >= 1 s.
    assert value(samples, "apiary_admission_wait_seconds_bucket", queue="research", le="1.0") == 3
    assert value(samples, "apiary_admission_wait_seconds_bucket", queue="research", le="5.0") == 4
