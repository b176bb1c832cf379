"""Scheduler speed: one policy pass, one whole scheduler tick, and admission throughput at scale.

    .venv/bin/python benchmarks/scheduler_speed.py          # ~2 minutes here; needs PostgreSQL

In one run:
1. `decide`: one pass of `service.scheduling.policy.decide` over 10,000 queued and 500 running jobs on 64
nodes
   (8 GPUs, 32 CPUs each), with reasons and ETAs for every waiting job; the fifo baseline's pass over
   the same jobs beside it. Goal: under 50 ms.
2. tick: `Scheduler.tick()` against SQLite and PostgreSQL holding those jobs (a fake cluster answers
   that the 500 run): the first tick (it reads every spec once) and the steady ones (bulk reads of
   the unfinished jobs, no per-job round trips, waiting reasons written only where they changed).
3. admission: jobs submitted over REST (`POST /jobs`, 4 client threads) to a service whose scheduler
   loop runs against a fake cluster with room for all of them: submissions per second and jobs
   admitted per second, on SQLite and PostgreSQL.

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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from _common import command, machine, postgres_database  # noqa: E402
from sqlalchemy import insert  # noqa: E402

from api.app import create_app  # noqa: E402
from api.demo import token_table, write_shards  # noqa: E402
from api.server import BackgroundServer  # noqa: E402
from service.capacity import Gang  # noqa: E402
from service.cluster import RayJobStatus, free_port  # noqa: E402
from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.runtime import Runtime  # noqa: E402
from service.scheduling.policy import decide, decide_fifo  # noqa: E402
from service.scheduling.scheduler import Scheduler  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store.db import Database  # noqa: E402
from service.store.models import Job  # noqa: E402
from tests.support.fakes import FakeBackend  # noqa: E402

NODES, NODE = 64, {"CPU": 32.0, "GPU": 8.0}
QUEUED, RUNNING = 10_000, 500
GOAL_DECIDE_MS = 50.0


def spec_json(rng: random.Random, *, dataset_uri: str, running: bool) -> dict[str, object]:
    research = rng.random() < 0.8
    gpus = 1 if running else (rng.choice([1, 1, 1, 2, 4, 8]) if research else rng.choice([8, 16, 32]))
    workers = max(1, gpus // 8)
    return JobSpec.model_validate(
        {
            "name": "bench",
            "queue": "research" if research else "full-scale",
            "priority": rng.choice([0, 0, 0, 5]),
            "trainer": "gpt",
            "num_workers": workers,
            "resources_per_worker": {"CPU": 4.0 * gpus / workers, "GPU": gpus / workers},
            "dataset": {"uri": dataset_uri},
            "max_steps": 1000,
            "batch_size": 8,
            "max_runtime_s": rng.choice([None, 3600.0, 7200.0]),
            "config": {"vocab_size": 64},
        }
    ).model_dump(mode="json")


# -- 1. decide --------------------------------------------------------------------------------------


def bench_decide(repeats: int) -> tuple[float, float]:
    rng = random.Random(0)
    now = time.time()

    def gang(job_id: int, spec: dict[str, object], *, running: bool) -> Gang:
        per_worker: dict[str, float] = dict(spec["resources_per_worker"])  # type: ignore[call-overload]
        return Gang(
            job_id=job_id,
            queue=str(spec["queue"]),
            priority=int(spec["priority"]),  # type: ignore[call-overload]
            num_workers=int(spec["num_workers"]),  # type: ignore[call-overload]
            per_worker=per_worker,
            owner=f"u{rng.randrange(50)}",
            submitted_at=now - rng.uniform(0, 86400),
            max_runtime_s=spec["max_runtime_s"],  # type: ignore[arg-type]
            started_at=now - rng.uniform(0, 7200) if running else None,
            last_checkpoint_at=now - rng.uniform(0, 600) if running else None,
            expected_end_at=now + rng.uniform(60, 36000) if running else None,
        )

    active = [
        gang(i, spec_json(rng, dataset_uri="file:///d", running=True), running=True) for i in range(RUNNING)
    ]
    queued = [
        gang(RUNNING + i, spec_json(rng, dataset_uri="file:///d", running=False), running=False)
        for i in range(QUEUED)
    ]
    usage = {f"u{k}": rng.uniform(0, 5000) for k in range(50)}
    cluster = FakeBackend.running(nodes=NODES, node=dict(NODE)).snapshot()

    def timed(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000

    two = timed(lambda: decide(cluster=cluster, queued=queued, active=active, now=now, usage=usage))
    fifo = timed(lambda: decide_fifo(cluster=cluster, queued=queued, active=active, now=now))
    return two, fifo


# -- 2. tick ----------------------------------------------------------------------------------------


@contextmanager
def databases(workdir: Path) -> Iterator[dict[str, str]]:
    with postgres_database() as postgresql:
        yield {"sqlite": f"sqlite:///{workdir / 'bench.db'}", "postgresql": postgresql}


def bench_tick(database_url: str, *, workdir: Path, dataset_uri: str, ticks: int) -> tuple[float, float]:
    """(first tick s, median steady tick s) with QUEUED queued and RUNNING running jobs."""
    rng = random.Random(1)
    db = Database(database_url)
    db.upgrade()
    cluster = FakeBackend.running(nodes=NODES, node=dict(NODE))
    now = datetime.now(UTC)
    rows = []
    for index in range(QUEUED + RUNNING):
        running = index < RUNNING
        spec = spec_json(rng, dataset_uri=dataset_uri, running=running)
        submission = f"bench-{index}" if running else None
        rows.append(
            {
                "name": "bench",
                "queue": spec["queue"],
                "priority": spec["priority"],
                "owner": f"u{rng.randrange(50)}",
                "state": JobState.RUNNING if running else JobState.QUEUED,
                "spec": spec,
                "attempt": 1 if running else 0,
                "ray_submission_id": submission,
                "created_at": now - timedelta(seconds=rng.uniform(0, 86400)),
                "updated_at": now,
                "started_at": now - timedelta(seconds=rng.uniform(0, 3000)) if running else None,
                "preemptions": 0,
            }
        )
        if submission:
            cluster.statuses[submission] = RayJobStatus.RUNNING
    with db.session() as session:
        session.execute(insert(Job), rows)
    settings = Settings(data_dir=workdir / "data", database_url=database_url)
    scheduler = Scheduler(db=db, backend=cluster, settings=settings)
    started = time.perf_counter()
    scheduler.tick()
    first = time.perf_counter() - started
    steady = []
    for _ in range(ticks):
        started = time.perf_counter()
        scheduler.tick()
        steady.append(time.perf_counter() - started)
    db.dispose()
    return first, statistics.median(steady)


# -- 3. admission -----------------------------------------------------------------------------------


def bench_admission(database_url: str, *, workdir: Path, dataset_uri: str, jobs: int) -> tuple[float, float]:
    """(submissions/s, admissions/s) over REST with the scheduler loop running."""
    port = free_port()
    settings = Settings(
        data_dir=workdir / f"admit-{port}",
        database_url=database_url,
        port=port,
        scheduler_interval_s=0.05,
        data_roots=str(workdir),  # the dataset lies in the work folder
    )
    # Room for every job at once: admission is what is measured.
    cluster = FakeBackend.running(nodes=NODES, node={key: amount * 64 for key, amount in NODE.items()})
    runtime = Runtime(settings, backend=cluster)
    server = BackgroundServer(create_app(runtime=runtime), host="127.0.0.1", port=port)
    server.start()
    rng = random.Random(2)
    specs = [spec_json(rng, dataset_uri=dataset_uri, running=True) for _ in range(jobs)]
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:

            def submit(spec: dict[str, object]) -> None:
                response = client.post("/jobs", json=spec)
                assert response.status_code == 201, response.text

            started = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(submit, specs))
            submitted_s = time.perf_counter() - started
            while client.get("/jobs", params={"state": "queued", "limit": 1}).json()["count"]:
                time.sleep(0.05)
            admitted_s = time.perf_counter() - started
    finally:
        server.stop()
    return jobs / submitted_s, jobs / admitted_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=15, help="decide passes (median)")
    parser.add_argument("--ticks", type=int, default=5, help="steady ticks (median)")
    parser.add_argument("--jobs", type=int, default=500, help="jobs submitted over REST")
    args = parser.parse_args()

    two_ms, fifo_ms = bench_decide(args.repeats)
    verdict = "met" if two_ms < GOAL_DECIDE_MS else "NOT met"
    print(
        f"decide, {QUEUED} queued + {RUNNING} running on {NODES} nodes: two-queue **{two_ms:.1f} ms** "
        f"(goal < {GOAL_DECIDE_MS:.0f} ms: {verdict}); fifo {fifo_ms:.1f} ms; "
        f"two-queue / fifo {two_ms / fifo_ms:.1f}x"
    )
    with tempfile.TemporaryDirectory(prefix="apiary-sched-") as temporary, databases(Path(temporary)) as urls:
        workdir = Path(temporary)
        dataset = workdir / "tokens"
        write_shards(token_table(num_rows=64, seq_len=9, vocab_size=64), dataset.as_uri(), num_shards=1)
        for name, url in urls.items():
            first, steady = bench_tick(
                url, workdir=workdir / name, dataset_uri=dataset.as_uri(), ticks=args.ticks
            )
            print(
                f"tick on {name}, {QUEUED} queued + {RUNNING} running: first {first * 1000:.0f} ms "
                f"(reads every spec once), then **{steady * 1000:.0f} ms** a tick"
            )
        with databases(workdir / "admission") as fresh:
            for name, url in fresh.items():
                if name == "sqlite":
                    url = f"sqlite:///{workdir / 'admission.db'}"
                submitted, admitted = bench_admission(
                    url, workdir=workdir, dataset_uri=dataset.as_uri(), jobs=args.jobs
                )
                print(
                    f"admission on {name}, {args.jobs} jobs over REST: {submitted:.0f} submissions/s, "
                    f"**{admitted:.0f} admitted/s** (submission to the last admission)"
                )
    print(f"- machine: {machine()}")
    print(f"- command: `{command()}`")


if __name__ == "__main__":
    main()
