"""API load: 1,000 concurrent job submissions as an SDK sends them (a token, retries, `Idempotency-Key`),
each persisted exactly once, on SQLite and on PostgreSQL, against the stack's own floor measured in the
same run.

    PYTHONPATH=. .venv/bin/python benchmarks/api_load.py        # ~2-3 minutes here; needs PostgreSQL

For each database (SQLite: a new file; PostgreSQL: a fresh database, dropped after), twice:
- the baseline (`api_load.py baseline`): a bare FastAPI + SQLAlchemy app in uvicorn, one sync route that
  validates the body as the same `JobSpec` and inserts one row (its spec as JSON) in one session, on
  its own fresh database of the same kind; the same clients, without repeats or timeouts (it has no
  idempotency: a repeat would be a second row);
- Apiary (`api_load.py serve`): the real app with auth required (each request carries a user's API
  token) and its scheduler loop, a fake cluster of 4 CPUs that runs what it admits (Ray is not
  measured);
each server in its own process, so the clients' event loop does not share its interpreter. Then:
1. `--jobs` logical submissions start at once (asyncio, raw httpx, one connection each; at most
   `--concurrency` in flight if given), each with its own `Idempotency-Key` and spec. As an SDK
   does, a request that times out, cannot connect or gets a 5xx is sent again with the same key
   (backoff 0.1 s x 2^n, at most 6 tries). On purpose: `--repeat` of them are sent twice at the same
   time (the same key and body from two clients), and `--timeout-retry` of them first go out with a
   5 ms read timeout, so the client gives up while the server still works, then retry;
2. the check: every logical submission got one job id from all its answers, and the database holds
   exactly one job per submission (counted by name, which is unique per submission) and one
   idempotency key per submission, pointing at that job.

Printed: submissions/s (logical submissions over the wall time from the first request to the last
answer) of each, Apiary's rate over the baseline's (the figure to read on a shared machine), and
p50/p99 latency of a submission as its caller sees it (first send to the final answer, retries
included) and of one HTTP request that got an answer. With every submission in flight at
once, the latency is mostly waiting in the server's queue (about jobs / throughput at worst).

`--replicas N` (PostgreSQL): then Apiary again with N replicas (`api_load.py serve` processes on one
fresh database, each with its own scheduler loop, as `apiary serve` replicas run), the clients spread
over them as a round-robin balancer would (a logical submission's first try to replica `index % N`,
each retry to the next one, a deliberate repeat to another than the first); printed: the N replicas'
rate over one replica's, and the same exactly-once check.

PostgreSQL: `APIARY_BENCH_PG_URL` (default postgresql+psycopg://postgres@127.0.0.1:5432/postgres).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from _common import command, machine, postgres_database  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from sqlalchemy import JSON, DateTime, String, create_engine, event, func, select, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column  # noqa: E402

from service.auth import Auth  # noqa: E402
from service.cluster import free_port  # noqa: E402
from service.contract.spec import JobSpec  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.sharding import shard_dataset  # noqa: E402
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
        data_dir=data_dir,
        database_url=database_url,
        port=port,
        data_roots=str(data_dir.parent),
        auth_required=True,
    )
    app = create_app(runtime=Runtime(settings, backend=FakeBackend.running()))
    # One process, as `apiary serve` runs; no access log (a line per request is not what is measured).
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


class BaselineBase(DeclarativeBase):
    pass


class BaselineSubmission(BaselineBase):
    """The baseline's one table: a submission's name and spec."""

    __tablename__ = "submissions"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=lambda: datetime.now(UTC))


def baseline_app(database_url: str) -> FastAPI:
    """The stack's floor: FastAPI validates the body as a `JobSpec`, and one SQLAlchemy session inserts
    it as one row, as a bare app of the same stack would."""
    if database_url.startswith("sqlite"):
        engine = create_engine(database_url, connect_args={"check_same_thread": False, "timeout": 30})
        # WAL, as Apiary's engine sets it: the floor should not pay for a rollback journal either.
        event.listen(engine, "connect", lambda connection, _: connection.execute("PRAGMA journal_mode=WAL"))
    else:
        engine = create_engine(database_url)
    BaselineBase.metadata.create_all(engine)
    app = FastAPI()

    @app.get("/readyz")
    def readyz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/jobs", status_code=201)
    def submit(spec: JobSpec) -> dict[str, int]:
        with Session(engine) as session, session.begin():
            row = BaselineSubmission(name=spec.name, spec=spec.model_dump(mode="json"))
            session.add(row)
            session.flush()
            return {"id": row.id}

    return app


def baseline(*, database_url: str, port: int) -> None:
    """The baseline's server (`api_load.py baseline`), as `serve` runs Apiary's."""
    import uvicorn

    uvicorn.run(
        baseline_app(database_url), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )


@contextmanager
def served_replicas(
    database_url: str, replicas: int, *, workdir: Path, kind: str, profile: Path | None
) -> Iterator[list[str]]:
    """`replicas` servers of `kind` on one database, started one after another (the first migrates)."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(served(database_url, workdir=workdir, kind=kind, profile=profile))
            for _ in range(replicas)
        ]


@contextmanager
def served(database_url: str, *, workdir: Path, kind: str, profile: Path | None) -> Iterator[str]:
    port = free_port()
    log = workdir / f"{kind}-{port}.log"
    command = [sys.executable, __file__, kind, "--database-url", database_url, "--port", str(port)]
    if kind == "serve":
        command += ["--data-dir", str(workdir / f"data-{port}")]
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        stacks = profile / f"{make_url(database_url).get_backend_name()}-{kind}-{port}.txt"
        py_spy = str(Path(sys.executable).parent / "py-spy")
        # Collapsed stacks of the thread holding the GIL (on 2 cores, the server's CPU is the limit).
        options = ["--gil", "--format", "raw", "-r", "100", "-o", str(stacks)]
        command = [py_spy, "record", *options, "--", *command]
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
        # py-spy writes its stacks when its child ends (SIGINT: it stops the child first).
        process.send_signal(signal.SIGINT if profile is not None else signal.SIGTERM)
        try:
            process.wait(60)
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
    clients: list[httpx.AsyncClient],
    *,
    index: int,
    spec: dict[str, Any],
    outcome: Outcome,
    load: Load,
    first_read_timeout_s: float | None,
    token: str | None,
) -> None:
    """Send one submission until it is answered, as an SDK does: same key on every try."""
    headers = {"Idempotency-Key": f"bench-{index}"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    started = time.perf_counter()
    for attempt in range(MAX_TRIES):
        outcome.tries += 1
        # The deliberate timeout: the client gives up reading while the server still works.
        short = attempt == 0 and first_read_timeout_s is not None
        timeout = httpx.Timeout(60.0, read=first_read_timeout_s) if short else httpx.Timeout(60.0)
        sent = time.perf_counter()
        client = clients[(index + attempt) % len(clients)]  # a balancer's round robin: a retry moves on
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
    urls: list[str],
    *,
    specs: list[dict[str, Any]],
    repeated: set[int],
    timed_out: set[int],
    concurrency: int | None,
    token: str | None,
) -> tuple[list[Outcome], Load, float]:
    outcomes = [Outcome(index) for index in range(len(specs))]
    load = Load()
    sends = len(specs) + len(repeated)
    limits = httpx.Limits(max_connections=sends, max_keepalive_connections=sends)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits))
            for url in urls
        ]
        tasks = [
            submit(
                clients,
                index=index,
                spec=spec,
                outcome=outcomes[index],
                load=load,
                first_read_timeout_s=SHORT_READ_TIMEOUT_S if index in timed_out else None,
                token=token,
            )
            for index, spec in enumerate(specs)
        ]
        # The deliberate repeats: the same key and body from a second client, at the same time.
        tasks += [
            submit(
                clients[1:] + clients[:1],  # another replica than the first try's, when there are two
                index=index,
                spec=specs[index],
                outcome=outcomes[index],
                load=load,
                first_read_timeout_s=None,
                token=token,
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


def answered_once(outcomes: list[Outcome]) -> list[str]:
    """A submission answered with no id or several."""
    return [
        f"submission {o.index}: ids {sorted(o.job_ids)}, error {o.error}"
        for o in outcomes
        if len(o.job_ids) != 1
    ]


def check_persisted_once(database_url: str, outcomes: list[Outcome]) -> list[str]:
    """What is wrong: a submission answered with no job or several, or not exactly one job and one key
    per submission in the database, or a key pointing at another job."""
    problems = answered_once(outcomes)
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


def check_baseline_once(database_url: str, outcomes: list[Outcome]) -> list[str]:
    """The baseline's check: one id per submission, one row per submission's name, that id."""
    problems = answered_once(outcomes)
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            rows: dict[str, list[int]] = {}
            for row_id, name in connection.execute(text("SELECT id, name FROM submissions")):
                rows.setdefault(name, []).append(row_id)
    finally:
        engine.dispose()
    for outcome in outcomes:
        found = rows.get(f"load-{outcome.index}", [])
        if len(found) != 1 or outcome.job_ids != set(found):
            problems.append(f"submission {outcome.index}: rows {found}, answered {sorted(outcome.job_ids)}")
    if len(rows) != len(outcomes):
        problems.append(f"{len(rows)} names for {len(outcomes)} submissions")
    return problems


def api_token(database_url: str) -> str:
    """A new (non-admin) user's API token, in a database migrated for the service."""
    db = Database(database_url)
    try:
        db.upgrade()
        return Auth(db=db, settings=Settings(database_url=database_url)).create_token(user="bench").secret
    finally:
        db.dispose()


def measure(
    label: str,
    database_url: str,
    *,
    kind: str,
    workdir: Path,
    specs: list[dict[str, Any]],
    repeated: set[int],
    timed_out: set[int],
    args: argparse.Namespace,
    replicas: int = 1,
) -> tuple[float, bool]:
    """Run the load against `replicas` servers (`kind`: serve or baseline); print what it saw. (rate, ok)."""
    token = api_token(database_url) if kind == "serve" else None
    with served_replicas(database_url, replicas, workdir=workdir, kind=kind, profile=args.profile) as urls:
        # Steady state: a first request builds what each server builds once (routes, validators).
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        for url in urls:
            assert httpx.post(f"{url}/jobs", json={}, headers=headers, timeout=60).status_code == 422
        outcomes, load, wall_s = asyncio.run(
            run_load(
                urls,
                specs=specs,
                repeated=repeated,
                timed_out=timed_out,
                concurrency=args.concurrency,
                token=token,
            )
        )
    if kind == "serve":
        problems = check_persisted_once(database_url, outcomes)
    else:
        problems = check_baseline_once(database_url, outcomes)
    latencies = [o.latency_s for o in outcomes]
    replayed = sum(o.replayed for o in outcomes)
    print(
        f"{label}: {len(specs)} submissions ({len(repeated)} sent twice at once, {len(timed_out)} first "
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
    rate = len(specs) / wall_s
    print(
        f"  **{rate:.0f} submissions/s** ({wall_s:.1f} s); submission latency p50 "
        f"**{ms['p50']:.0f} ms**, p99 **{ms['p99']:.0f} ms**; request latency p50 "
        f"{ms['request p50']:.0f} ms, p99 {ms['request p99']:.0f} ms, mean {ms['request mean']:.0f} ms"
    )
    if problems:
        print(f"  NOT persisted exactly once: {len(problems)} problem(s), e.g.", *problems[:10], sep="\n    ")
    else:
        stored = f"{len(specs)} jobs, {len(specs)} keys" if kind == "serve" else f"{len(specs)} rows"
        print(f"  every submission persisted exactly once: {stored}, one id each")
    return rate, not problems


def bench(
    name: str, urls: tuple[str, ...], *, workdir: Path, dataset_uri: str, args: argparse.Namespace
) -> bool:
    """The baseline on `urls[0]`, then Apiary on `urls[1]` (fresh databases of one kind), then with
    `--replicas` on `urls[2]` when given."""
    rng = random.Random(1)
    specs = [spec_for(index, dataset_uri) for index in range(args.jobs)]
    chosen = rng.sample(range(args.jobs), args.repeat + args.timeout_retry)
    repeated, timed_out = set(chosen[: args.repeat]), set(chosen[args.repeat :])
    floor, floor_ok = 0.0, True
    if not args.no_baseline:
        floor, floor_ok = measure(
            f"{name}, baseline",
            urls[0],
            kind="baseline",
            workdir=workdir,
            specs=specs,
            repeated=set(),
            timed_out=set(),
            args=args,
        )
    # Apiary with one replica, then (`--replicas`, on its own database) with several.
    rates: list[float] = []
    ok = True
    for url, replicas in zip(urls[1:], (1, args.replicas), strict=False):
        rate, measured_ok = measure(
            f"{name}, Apiary" + (f", {replicas} replicas" if replicas > 1 else ""),
            url,
            kind="serve",
            workdir=workdir,
            specs=specs,
            repeated=repeated,
            timed_out=timed_out,
            args=args,
            replicas=replicas,
        )
        rates.append(rate)
        ok = ok and measured_ok
    if floor:
        print(
            f"  {name}: Apiary / baseline **{rates[0] / floor:.2f}x** ({rates[0]:.0f} / {floor:.0f} "
            "submissions/s)"
        )
    if len(rates) > 1:
        print(
            f"  {name}: {args.replicas} replicas / 1 **{rates[1] / rates[0]:.2f}x** ({rates[1]:.0f} / "
            f"{rates[0]:.0f} submissions/s)"
        )
    return ok and floor_ok


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
    source = uri_dir.parent / f"{uri_dir.name}-source.parquet"
    pq.write_table(table, source)
    # With a manifest, as `apiary data shard` writes a dataset.
    shard_dataset(str(source), uri_dir.as_uri(), num_shards=2)
    return uri_dir.as_uri()


def main() -> None:
    if sys.argv[1:2] in (["serve"], ["baseline"]):
        parser = argparse.ArgumentParser()
        parser.add_argument("kind")
        parser.add_argument("--database-url", required=True)
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--data-dir", type=Path)
        served_args = parser.parse_args()
        if served_args.kind == "baseline":
            baseline(database_url=served_args.database_url, port=served_args.port)
        else:
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
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="PostgreSQL: also measure Apiary with this many replicas on one database (round robin)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="measure Apiary alone")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="run each server under py-spy (the thread holding the GIL, 100 samples/s) and write its "
        "collapsed stacks (py-spy's raw format: a flame graph's input) into this folder",
    )
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="apiary-load-") as temporary:
        workdir = Path(temporary)
        dataset_uri = write_dataset(workdir / "dataset")
        for name in args.databases.split(","):
            if name == "sqlite":
                urls = (f"sqlite:///{workdir / 'baseline.db'}", f"sqlite:///{workdir / 'load.db'}")
                ok &= bench(name, urls, workdir=workdir, dataset_uri=dataset_uri, args=args)
            else:
                with contextlib.ExitStack() as stack:
                    databases = 3 if args.replicas > 1 else 2
                    pg_urls = tuple(stack.enter_context(postgres_database()) for _ in range(databases))
                    ok &= bench(name, pg_urls, workdir=workdir, dataset_uri=dataset_uri, args=args)
    print(f"- machine: {machine()}, at the end")
    print(f"- command: `{command()}`")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
