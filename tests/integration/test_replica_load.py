"""Two replicas on one PostgreSQL take submissions and telemetry at the same time (issue 28 point 5):
a client's retried submission reaches the other replica and finds its job, every job is admitted once,
and a batch a rank posts twice, once to each replica, is stored once. Both replicas run their
scheduler loop, as `apiary serve` does; one holds the lease. The throughput of one replica against two
is measured by benchmarks/api_load.py --replicas."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.server import BackgroundServer
from service.cluster import RayJobStatus, free_port
from service.runtime import Runtime
from tests.integration.conftest import Service
from tests.support.wait import wait_until

# Replicas share a database server: PostgreSQL (SQLite is one process's database).
pytestmark = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)

JOBS = 24
STEPS = 40
RANKS = 2
POINTS_PER_POST = 10


@pytest.fixture
def replicas(start_service: Callable[..., Service], tmp_path: Path) -> Iterator[tuple[Service, httpx.Client]]:
    """The first replica (the fixture's service) and an HTTP client of a second one: its own process
    state and data dir, the same database, the same cluster (one fake backend: one Ray)."""
    first = start_service(nodes=[{"CPU": 1000.0}], run_scheduler=True)  # every job fits at once
    settings = first.runtime.settings.model_copy(
        update={"port": free_port(), "data_dir": tmp_path / "second"}
    )
    runtime = Runtime(settings, backend=first.backend, run_scheduler=True)
    server = BackgroundServer(create_app(runtime=runtime), host="127.0.0.1", port=settings.port)
    server.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{settings.port}", timeout=30) as second:
            yield first, second
    finally:
        server.stop()


def test_two_replicas_take_submissions_and_telemetry_at_once_and_store_nothing_twice(
    replicas: tuple[Service, httpx.Client], spec: dict[str, Any]
) -> None:
    service, second = replicas
    sides = (service.http, second)

    def submit(index: int) -> tuple[int, int]:
        # The client's first try goes to one replica, its retry (same key: the answer was lost) to the
        # other, as a balancer would send them.
        key = {"Idempotency-Key": f"job-{index}"}
        body = {**spec, "name": f"job-{index}"}
        first = sides[index % 2].post("/jobs", json=body, headers=key)
        retried = sides[1 - index % 2].post("/jobs", json=body, headers=key)
        assert first.status_code == 201 and retried.status_code in (200, 201), (first.text, retried.text)
        return first.json()["id"], retried.json()["id"]

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(submit, range(JOBS)))
    assert all(first == retried for first, retried in ids), ids
    job_ids = sorted(first for first, _ in ids)
    assert len(set(job_ids)) == JOBS

    backend = service.backend
    wait_until(lambda: len({launch.job_id for _, launch in backend.submitted}) == JOBS, timeout_s=60)
    time.sleep(1.0)  # a few more passes of both loops: nothing is admitted again
    admitted = Counter(launch.job_id for _, launch in backend.submitted)
    assert admitted == Counter(dict.fromkeys(job_ids, 1)), admitted
    for submission_id, _ in backend.submitted:
        backend.statuses[submission_id] = RayJobStatus.RUNNING
    wait_until(lambda: all(service.job(job_id)["state"] == "running" for job_id in job_ids), timeout_s=60)

    # Each job's ranks post their points in batches, alternately to either replica; every third batch
    # is posted again to the other one (a rank that lost the answer retries through the balancer).
    posts = []
    for job_id in job_ids:
        for rank in range(RANKS):
            for first_step in range(1, STEPS + 1, POINTS_PER_POST):
                points = [
                    {"step": step, "rank": rank, "time": time.time(), "values": {"loss": 1.0 / step}}
                    for step in range(first_step, first_step + POINTS_PER_POST)
                ]
                posts.append((job_id, {"attempt": 1, "points": points}))

    def post(item: tuple[int, tuple[int, dict[str, Any]]]) -> list[int]:
        index, (job_id, batch) = item
        headers = backend.report_headers(job_id)
        targets = [sides[index % 2]] + ([sides[1 - index % 2]] if index % 3 == 0 else [])
        return [
            side.post(f"/internal/jobs/{job_id}/telemetry", json=batch, headers=headers).status_code
            for side in targets
        ]

    with ThreadPoolExecutor(16) as pool:
        statuses = [status for answered in pool.map(post, enumerate(posts)) for status in answered]
    assert set(statuses) == {202}, Counter(statuses)
    assert len(statuses) > len(posts)  # the duplicates were sent

    for job_id in job_ids:
        side = sides[job_id % 2]  # either replica reads the same rows
        stored = side.get(f"/jobs/{job_id}/metrics").json()["data"]
        keys = [(point["step"], point["rank"]) for point in stored]
        assert sorted(keys) == [(step, rank) for step in range(1, STEPS + 1) for rank in range(RANKS)]
        assert service.job(job_id)["latest_step"] == STEPS
