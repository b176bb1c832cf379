"""The web queue view's server time with 10,000 jobs stored, on SQLite and PostgreSQL.

    PYTHONPATH=. .venv/bin/python benchmarks/queue_page.py        # ~1 minute here; needs PostgreSQL

Stores 10,000 jobs in bulk (4,000 queued with their position, reason and ETA, 100 running, 5,900
finished), then times, in process (FastAPI's TestClient, so the figures include its own small
overhead and no network), the median of `--repeats` requests after two warm-ups, in wall time and in
this process's CPU time (what the request costs, whatever else shares the cores), of:
`GET /` (the queue page's first page, as a browser asks for it), `GET /queues` and `GET /jobs?limit=100`.
Goal: the first page under 100 ms.

PostgreSQL: `APIARY_BENCH_PG_URL` (default postgresql+psycopg://postgres@127.0.0.1:5432/postgres)
is the server; each run uses a fresh database and drops it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import command, machine, postgres_database  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from sqlalchemy import insert  # noqa: E402

from api.app import create_app  # noqa: E402
from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.runtime import Runtime  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store.db import Database  # noqa: E402
from service.store.models import Job  # noqa: E402
from tests.support.fakes import FakeBackend  # noqa: E402

JOBS, QUEUED, RUNNING = 10_000, 4_000, 100
GOAL_MS = 100.0
PATHS = {"/ (first page)": "/", "/queues": "/queues", "/jobs?limit=100": "/jobs?limit=100"}


def store_jobs(db: Database) -> None:
    rng = random.Random(1)
    now = datetime.now(UTC)
    finished = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
    positions = {"research": 0, "full-scale": 0}
    rows = []
    for index in range(JOBS):
        queue = "research" if rng.random() < 0.8 else "full-scale"
        spec = JobSpec.model_validate(
            {
                "name": f"bench-{index}",
                "queue": queue,
                "trainer": "gpt",
                "num_workers": rng.choice([1, 2, 4]),
                "resources_per_worker": {"CPU": 4.0, "GPU": 1.0},
                "dataset": {"uri": "file:///tmp/none"},
                "max_steps": 1000,
                "batch_size": 8,
                "config": {"vocab_size": 64},
            }
        ).model_dump(mode="json")
        state = (
            JobState.QUEUED
            if index < QUEUED
            else JobState.RUNNING
            if index < QUEUED + RUNNING
            else rng.choice(finished)
        )
        row = {
            "name": spec["name"],
            "queue": queue,
            "priority": rng.choice([0, 0, 5]),
            "owner": f"user{rng.randrange(50)}",
            "state": state,
            "spec": spec,
            "attempt": 0 if state is JobState.QUEUED else 1,
            "created_at": now - timedelta(seconds=rng.uniform(0, 86400)),
            "updated_at": now,
            "preemptions": 0,
            "restarts": 0,
            "failures": 0,
            "queue_position": None,
            "waiting_reason": None,
            "eta_at": None,
            "latest_step": None,
            "seconds_per_step": None,
            "ray_submission_id": None,
            "finished_at": None,
        }
        if state is JobState.QUEUED:
            positions[queue] += 1
            row |= {
                "queue_position": positions[queue],
                "waiting_reason": "needs 4 worker(s) x 1 GPU; free now 0 GPU",
                "eta_at": now + timedelta(minutes=positions[queue]),
            }
        elif state is JobState.RUNNING:
            row |= {
                "latest_step": rng.randrange(1000),
                "seconds_per_step": 0.1,
                "ray_submission_id": f"b-{index}",
            }
        else:
            row["finished_at"] = now - timedelta(seconds=rng.uniform(0, 3600))
        rows.append(row)
    with db.session() as session:
        session.execute(insert(Job), rows)


def bench(database_url: str, *, workdir: Path, repeats: int) -> dict[str, float]:
    db = Database(database_url)
    db.upgrade()
    started = time.perf_counter()
    store_jobs(db)
    print(f"  stored {JOBS} jobs in {time.perf_counter() - started:.1f} s", flush=True)
    db.dispose()
    settings = Settings(data_dir=workdir / "data", database_url=database_url)
    runtime = Runtime(
        settings, backend=FakeBackend.running(nodes=64, node={"CPU": 32.0, "GPU": 8.0}), run_scheduler=False
    )
    figures = {}
    with TestClient(create_app(runtime=runtime)) as client:
        for label, path in PATHS.items():
            headers = {"Accept": "text/html"} if path == "/" else {}
            times, cpu = [], []
            for attempt in range(repeats + 2):
                begun, begun_cpu = time.perf_counter(), time.process_time()
                response = client.get(path, headers=headers)
                elapsed, elapsed_cpu = time.perf_counter() - begun, time.process_time() - begun_cpu
                assert response.status_code == 200, response.text[:500]
                if attempt >= 2:
                    times.append(elapsed)
                    cpu.append(elapsed_cpu)
            figures[label] = statistics.median(times) * 1000
            figures[f"{label} cpu"] = statistics.median(cpu) * 1000
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"- machine: {machine()}")
    print(f"- command: `{command()}`")
    results = {}
    with tempfile.TemporaryDirectory() as tmp, postgres_database() as pg_url:
        workdir = Path(tmp)
        for name, url in (("sqlite", f"sqlite:///{workdir / 'bench.db'}"), ("postgresql", pg_url)):
            print(f"{name}:", flush=True)
            results[name] = bench(url, workdir=workdir / name, repeats=args.repeats)
            for label in PATHS:
                ms, cpu_ms = results[name][label], results[name][f"{label} cpu"]
                print(f"  {label:<18} {ms:7.1f} ms wall, {cpu_ms:6.1f} ms CPU (median of {args.repeats})")
    worst = max(figures["/ (first page)"] for figures in results.values())
    print(
        f"first page: worst {worst:.1f} ms wall; goal < {GOAL_MS:g} ms: "
        f"{'met' if worst < GOAL_MS else 'NOT met'}"
    )
    print(f"- machine after: {machine()}")


if __name__ == "__main__":
    main()
