"""What each rank's process uses, from its telemetry to the job's record, its page and `GET /metrics`, over
real HTTP on SQLite and PostgreSQL with a fake cluster; a rank that stands out is marked (and an event
says so) after three posts in a row, and unmarked after three that do not."""

from __future__ import annotations

import re
import time
from typing import Any

from tests.integration.conftest import Service
from tests.integration.test_prometheus import scrape, value
from tests.integration.test_recovery import post, reasons, status
from tests.integration.test_scheduler import run_to_running

GIB = 1024**3
SPEC_FIELDS = {"name": "job", "num_workers": 2}
HTML = {"accept": "text/html"}  # the job page (the same path answers JSON by default)


def system(*, rss_bytes: int, gpu_utilization_percent: float) -> dict[str, Any]:
    return {
        "sampled_at": time.time(),
        "cpu_percent": 95.0,
        "rss_bytes": rss_bytes,
        "gpu_utilization_percent": gpu_utilization_percent,
        "gpu_memory_bytes": 2 * GIB,
        "data_read_bytes": 7_000_000,
        "data_read_bytes_per_s": 1_500_000.0,
        "net_sent_bytes": 123_456,
        "net_recv_bytes": 654_321,
        "net_sent_bytes_per_s": 10.0,
        "net_recv_bytes_per_s": 20.0,
    }


def report(service: Service, job_id: int, step: int, *, rank1_rss: int, rank1_gpu: float) -> None:
    for rank, figures in (
        (0, system(rss_bytes=GIB, gpu_utilization_percent=90.0)),
        (1, system(rss_bytes=rank1_rss, gpu_utilization_percent=rank1_gpu)),
    ):
        rank_status = {**status(rank, step=step, step_at=time.time(), phase="compute"), "system": figures}
        post(service, job_id, {"attempt": 1, "status": rank_status})


def rank_row(page: str, rank: int) -> str:
    found = re.search(rf'<tr data-rank="{rank}".*?</tr>', page, re.S)
    assert found, page
    return found.group(0)


def test_each_ranks_system_figures_are_stored_shown_and_scraped_and_outliers_stand_out(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    for step in (1, 2):  # rank 1 holds 3 GiB against 1 GiB, its GPU idles at 10% against 90%
        report(service, job_id, step, rank1_rss=3 * GIB, rank1_gpu=10.0)
    assert not service.job(job_id)["ranks"]["1"]["outliers"]  # two posts in a row: not yet
    report(service, job_id, 3, rank1_rss=3 * GIB, rank1_gpu=10.0)

    ranks = service.job(job_id)["ranks"]
    assert (
        ranks["1"]["system"]["rss_bytes"] == 3 * GIB and ranks["0"]["system"]["data_read_bytes"] == 7_000_000
    )
    assert ranks["1"]["outliers"] == ["gpu_utilization_percent", "rss_bytes"] and ranks["0"]["outliers"] == []
    said = [r for r in reasons(service, job_id) if "stands out" in r]
    assert said == [
        "rank 1 on node 10.0.0.2 (node1) stands out in memory (RSS): 3.0 GiB against 1.0 GiB for the other "
        "ranks at step 3",
        "rank 1 on node 10.0.0.2 (node1) stands out in GPU utilization: 10% against 90% for the other ranks "
        "at step 3",
    ], said

    page = service.http.get(f"/jobs/{job_id}", headers=HTML).text
    row1, row0 = rank_row(page, 1), rank_row(page, 0)
    assert '<td data-figure="rss_bytes" class="outlier"' in row1 and ">3.0 GiB</td>" in row1
    assert '<td data-figure="gpu_utilization_percent" class="outlier"' in row1 and "outlier-mark" in row1
    assert 'class="outlier"' not in row0 and ">1.0 GiB</td>" in row0 and ">1.4 MiB/s</td>" in row0

    samples = scrape(service)
    labels = {"job_id": str(job_id), "rank": "1"}
    assert value(samples, "apiary_rank_rss_bytes", **labels) == 3 * GIB
    assert value(samples, "apiary_rank_gpu_utilization_percent", **labels) == 10
    assert value(samples, "apiary_rank_cpu_percent", **labels) == 95
    assert value(samples, "apiary_rank_data_read_bytes_total", **labels) == 7_000_000
    assert value(samples, "apiary_rank_network_received_bytes_total", **labels) == 654_321
    assert value(samples, "apiary_rank_outlier", figure="rss_bytes", **labels) == 1
    assert not [key for key in samples if key[0] == "apiary_rank_outlier" and ("rank", "0") in key[1]]
    assert value(samples, "apiary_rank_series_left_out") == 0

    for step in (4, 5, 6):  # rank 1 is back in line
        report(service, job_id, step, rank1_rss=GIB, rank1_gpu=85.0)
    assert service.job(job_id)["ranks"]["1"]["outliers"] == []
    assert len([r for r in reasons(service, job_id) if "no longer stands out" in r]) == 2
    assert 'class="outlier"' not in service.http.get(f"/jobs/{job_id}", headers=HTML).text
