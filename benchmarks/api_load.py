"""API load: 1,000 concurrent job submissions as an SDK sends them (retries, `Idempotency-Key`), each
persisted exactly once, on SQLite and on PostgreSQL.

    PYTHONPATH=. .venv/bin/python benchmarks/api_load.py        # ~2-3 minutes here; needs PostgreSQL

For each database (SQLite: a new file; PostgreSQL: a fresh database, dropped after):
1. the service runs in its own process (`api_load.py serve`: uvicorn on a free port, the real app and
   scheduler loop, a fake cluster of 4 CPUs that runs what it admits: Ray is not measured), so the
   client's event loop does not share its interpreter;
2. `--jobs` logical submissions start at once (asyncio, raw httpx, one connection each; at most
   `--concurrency` in flight if given), each with its own `Idempotency-Key` and spec. As an SDK
   does, a request that times out, cannot connect or gets a 5xx is sent again with the same key
   (backoff 0.1 s x 2^n, at most 6 tries). On purpose: `--repeat` of them are sent twice at the same
   time (the same key and body from two clients), and `--timeout-retry` of them first go out with a
   5 ms read timeout, so the client gives up while the server still works, then retry;
3. the check: every logical submission got one job id from all its answers, and the database holds
   exactly one job per submission (counted by name, which is unique per submission) and one
   idempotency key per submission, pointing at that job.

Printed: submissions/s (logical submissions over the wall time from the first request to the last
answer), and p50/p99 latency of a submission as its caller sees it (first send to the final answer,
retries included) and of one HTTP request that got an answer. With every submission in flight at
once, the latency is mostly waiting in the server's queue (about jobs / throughput at worst).

PostgreSQL: `APIARY_BENCH_PG_URL` (default postgresql+psycopg://postgres@127.0.0.1:5432/postgres).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from _common import command, machine, postgres_database  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from service.cluster import free_port  # noqa: E402
from service.store.db import Database  # noqa: E402
from service.store.models import IdempotencyKey, Job  # noqa: E402
from tests.support.fakes import FakeBackend  # noqa: E402

MAX_TRIES = 6
SHORT_READ_TIMEOUT_S = 0.005


# -- the service (its own process) ------------------------------------------------------------------


def serve(*, database_url: str, port: int, data_dir: Path) -> None:
    """The real app and scheduler loop over `database_url`, with the fake cluster (`api_load.py serve`)."""
    import uvicorn

    from api.app import create_app
    from service.runtime import Runtime
    from service.settings import Settings

    # The dataset lies beside the data dir, in the benchmark's work folder.
    settings = Settings(
        data_dir=data_dir, database_url=database_url, port=port, data_roots=str(data_dir.parent)
    )
    app = create_app(runtime=Runtime(settings, backend=FakeBackend.running()))
    # One process, as `apiary serve` runs; no access log (a line per request is not what is measured).
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@contextmanager
def served(database_url: str, *, workdir: Path) -> Iterator[str]:
    port = free_port()
    log = workdir / f"serve-{port}.log"
    command = [sys.executable, __file__, "serve", "--database-url", database_url, "--port", str(port)]
    command += ["--data-dir", str(workdir / f"data-{port}")]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the service exited with {process.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service did not answer in 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- the clients ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One logical submission: what its caller saw."""

    index: int
    job_ids: set[int] = field(default_factory=set)
    latency_s: float = 0.0
    tries: int = 0
    replayed: int = 0  # answers of 200 (a repeat of the key)
    error: str | None = None


@dataclass
class Load:
    requests_s: list[float] = field(default_factory=list)  # each HTTP request that got an answer
    client_timeouts: int = 0
    transport_errors: dict[str, int] = field(default_factory=dict)  # other than timeouts, by class
    server_errors: int = 0


async def submit(
    client: httpx.AsyncClient,
    *,
    index: int,
    spec: dict[str, Any],
    outcome: Outcome,
    load: Load,
    first_read_timeout_s: float | None,
) -> None:
    """Send one submission until it is answered, as an SDK does: same key on every try."""
    headers = {"Idempotency-Key": f"bench-{index}"}
    started = time.perf_counter()
    for attempt in range(MAX_TRIES):
        outcome.tries += 1
        # The deliberate timeout: the client gives up reading while the server still works.
        short = attempt == 0 and first_read_timeout_s is not None
        timeout = httpx.Timeout(60.0, read=first_read_timeout_s) if short else httpx.Timeout(60.0)
        sent = time.perf_counter()
        try:
            response = await client.post("/jobs", json=spec, headers=headers, timeout=timeout)
        except httpx.TimeoutException:
            load.client_timeouts += 1
        except httpx.TransportError as err:
            outcome.error = f"{type(err).__name__}: {err}"
            kind = type(err).__name__
            load.transport_errors[kind] = load.transport_errors.get(kind, 0) + 1
        else:
            load.requests_s.append(time.perf_counter() - sent)
            if response.status_code in (200, 201):
                outcome.job_ids.add(int(response.json()["id"]))
                outcome.replayed += response.status_code == 200
                outcome.error = None
                break
            if response.status_code < 500 and response.status_code != 429:
                outcome.error = f"HTTP {response.status_code}: {response.text[:300]}"
                break
            load.server_errors += 1
            outcome.error = f"HTTP {response.status_code}: {response.text[:300]}"
        await asyncio.sleep(0.1 * 2**attempt * (0.5 + random.random()))
    outcome.latency_s = max(outcome.latency_s, time.perf_counter() - started)


async def run_load(
    url: str, *, specs: list[dict[str, Any]], repeated: set[int], timed_out: set[int], concurrency: int | None
) -> tuple[list[Outcome], Load, float]:
    outcomes = [Outcome(index) for index in range(len(specs))]
    load = Load()
    sends = len(specs) + len(repeated)
    limits = httpx.Limits(max_connections=sends, max_keepalive_connections=sends)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        tasks = [
            submit(
                client,
                index=index,
                spec=spec,
                outcome=outcomes[index],
                load=load,
                first_read_timeout_s=SHORT_READ_TIMEOUT_S if index in timed_out else None,
            )
            for index, spec in enumerate(specs)
        ]
        # The deliberate repeats: the same key and body from a second client, at the same time.
        tasks += [
            submit(
                client,
                index=index,
                spec=specs[index],
                outcome=outcomes[index],
                load=load,
                first_read_timeout_s=None,
            )
            for index in sorted(repeated)
        ]
        random.Random(3).shuffle(tasks)
        gate = asyncio.Semaphore(concurrency or len(tasks))

        async def gated(task: Coroutine[Any, Any, None]) -> None:
            async with gate:
                await task

        started = time.perf_counter()
        await asyncio.gather(*(gated(task) for task in tasks))
        wall_s = time.perf_counter() - started
    return outcomes, load, wall_s


def spec_for(index: int, dataset_uri: str) -> dict[str, Any]:
    return {
        "name": f"load-{index}",
        "trainer": "mlp",
        "num_workers": 1,
        "dataset": {"uri": dataset_uri},
        "max_steps": 100,
        "batch_size": 8,
        "priority": index % 3,
        "config": {"task": "classification", "num_classes": 3},
    }


# -- the check --------------------------------------------------------------------------------------


def check_persisted_once(database_url: str, outcomes: list[Outcome]) -> list[str]:
    """What is wrong: a submission answered with no job or several, or not exactly one job and one key
    per submission in the database, or a key pointing at another job."""
    problems = [
        f"submission {o.index}: job ids {sorted(o.job_ids)}, error {o.error}"
        for o in outcomes
        if len(o.job_ids) != 1
    ]
    db = Database(database_url)
    try:
        with db.session() as session:
            per_name = {
                name: count
                for name, count in session.execute(select(Job.name, func.count()).group_by(Job.name))
            }
            jobs = {name: job_id for job_id, name in session.execute(select(Job.id, Job.name))}
            keys = {
                key: job_id
                for key, job_id in session.execute(select(IdempotencyKey.key, IdempotencyKey.job_id))
            }
    finally:
        db.dispose()
    for outcome in outcomes:
        name, key = f"load-{outcome.index}", f"bench-{outcome.index}"
        if per_name.get(name) != 1:
            problems.append(f"submission {outcome.index}: {per_name.get(name, 0)} job rows")
        elif keys.get(key) != jobs[name] or outcome.job_ids != {jobs[name]}:
            problems.append(
                f"submission {outcome.index}: key -> {keys.get(key)}, job {jobs[name]}, "
                f"answered {outcome.job_ids}"
            )
    if len(per_name) != len(outcomes) or len(keys) != len(outcomes):
        problems.append(f"{len(per_name)} job names and {len(keys)} keys for {len(outcomes)} submissions")
    return problems


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench(name: str, database_url: str, *, workdir: Path, dataset_uri: str, args: argparse.Namespace) -> bool:
    rng = random.Random(1)
    specs = [spec_for(index, dataset_uri) for index in range(args.jobs)]
    chosen = rng.sample(range(args.jobs), args.repeat + args.timeout_retry)
    repeated, timed_out = set(chosen[: args.repeat]), set(chosen[args.repeat :])
    with served(database_url, workdir=workdir) as url:
        outcomes, load, wall_s = asyncio.run(
            run_load(url, specs=specs, repeated=repeated, timed_out=timed_out, concurrency=args.concurrency)
        )
    problems = check_persisted_once(database_url, outcomes)
    latencies = [o.latency_s for o in outcomes]
    replayed = sum(o.replayed for o in outcomes)
    print(
        f"{name}: {args.jobs} submissions ({args.repeat} sent twice at once, {args.timeout_retry} first "
        f"timed out by the client), {len(load.requests_s)} answered requests, {load.client_timeouts} client "
        f"timeouts, {load.server_errors} 5xx, other transport errors {load.transport_errors or 'none'}, "
        f"{replayed} replays (200)"
    )
    ms = {
        "p50": percentile(latencies, 0.5) * 1000,
        "p99": percentile(latencies, 0.99) * 1000,
        "request p50": percentile(load.requests_s, 0.5) * 1000,
        "request p99": percentile(load.requests_s, 0.99) * 1000,
        "request mean": statistics.fmean(load.requests_s) * 1000,
    }
    print(
        f"  **{args.jobs / wall_s:.0f} submissions/s** ({wall_s:.1f} s); submission latency p50 "
        f"**{ms['p50']:.0f} ms**, p99 **{ms['p99']:.0f} ms**; request latency p50 "
        f"{ms['request p50']:.0f} ms, p99 {ms['request p99']:.0f} ms, mean {ms['request mean']:.0f} ms"
    )
    if problems:
        print(f"  NOT persisted exactly once: {len(problems)} problem(s), e.g.", *problems[:10], sep="\n    ")
    else:
        print(
            f"  every submission persisted exactly once: {args.jobs} jobs, {args.jobs} keys, one job id each"
        )
    return not problems


def write_dataset(uri_dir: Path) -> str:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(64, 8)).astype(np.float32)
    table = pa.table(
        {
            "id": pa.array(np.arange(64), pa.int64()),
            "features": pa.array(list(features), pa.list_(pa.float32())),
            "label": pa.array(rng.integers(0, 3, size=64), pa.int64()),
        }
    )
    uri_dir.mkdir(parents=True)
    pq.write_table(table, uri_dir / "shard-00000.parquet")
    return uri_dir.as_uri()


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("serve")
        parser.add_argument("--database-url", required=True)
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--data-dir", type=Path, required=True)
        served_args = parser.parse_args()
        serve(database_url=served_args.database_url, port=served_args.port, data_dir=served_args.data_dir)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=1000, help="logical submissions, all started at once")
    parser.add_argument("--repeat", type=int, default=100, help="of them, sent twice at the same time")
    parser.add_argument(
        "--timeout-retry", type=int, default=50, help="of them, first timed out by the client"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="at most this many submissions in flight (default: all at once); a latency not made of queueing",
    )
    parser.add_argument("--databases", default="sqlite,postgresql")
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="apiary-load-") as temporary:
        workdir = Path(temporary)
        dataset_uri = write_dataset(workdir / "dataset")
        for name in args.databases.split(","):
            if name == "sqlite":
                ok &= bench(
                    name,
                    f"sqlite:///{workdir / 'load.db'}",
                    workdir=workdir,
                    dataset_uri=dataset_uri,
                    args=args,
                )
            else:
                with postgres_database() as url:
                    ok &= bench(name, url, workdir=workdir, dataset_uri=dataset_uri, args=args)
    print(f"- machine: {machine()}, at the end")
    print(f"- command: `{command()}`")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
