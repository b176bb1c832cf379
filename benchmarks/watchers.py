"""Watchers: 1,000 SSE clients on one running job plus 200 on `/queues/stream` (issue 28, point 4).

    PYTHONPATH=. .venv/bin/python benchmarks/watchers.py --pin                 # ~2 minutes; PostgreSQL
    git archive 7fdb925 | tar -x -C /tmp/before    # the per-watcher polling, before api.feeds
    PYTHONPATH=. .venv/bin/python benchmarks/watchers.py --pin --before /tmp/before

The service is `api.server.serve`, what `apiary serve` runs (its uvicorn settings, its access log),
over a fresh PostgreSQL database with auth required, and the fake cluster of the tests (a job runs
from its admission on, with no Ray: the trainers are this benchmark's driver). In one run, for each
source tree (this one, then `--before`'s, each with its own database and server):
1. a job is submitted and runs; a driver thread posts its telemetry as an aggregator of its 4 ranks
   does: one post per step (4 points), `--steps-per-s` steps a second, and a trainer event every 10th
   step (a job event);
2. alone: `GET /healthz`, one at a time, for `--seconds`, while the driver posts;
3. with watchers: another process (asyncio + httpx, one event loop) opens `--job-clients` streams of
   the job and `--queue-clients` of `/queues/stream` (tokens of `--users` users, spread over them),
   and the probe runs again for `--seconds` once every stream got its first message. The job
   streams join as the web view's job page does, from the cursor of the history it rendered
   (`?last_event_id=`, read by one stream first): a client from the start would read the whole
   history when it connects, which is that client's cost, not the watching's;
4. the driver stops, the job is cancelled, and each job stream must end with `end` having sent every
   event of the job after its cursor (as `GET /jobs/{id}/events` lists them) and every point posted
   after it, in order, once; each queues stream must have sent the queues after the cancellation.

Printed per tree: `/healthz` p50/p99 alone and with the watchers, their ratio (goal: p99 < 100 ms with
the watchers), the database's transactions per second in both phases (pg_stat_database: each poll is
one), and what the clients received. `--pin` stands for clients on other machines: the clients'
process on the last CPU, the service, probe and driver on the others (`os.sched_setaffinity`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# `serve` runs the tree it is told to (APIARY_BENCH_TREE: an older checkout), the rest this one. (Only
# lazily: auth_flood puts this tree first on sys.path when it is imported.)
sys.path.insert(0, os.environ.get("APIARY_BENCH_TREE", str(ROOT)))

import httpx  # noqa: E402
from _common import command, machine, postgres_database  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402

from service.cluster import free_port  # noqa: E402

RANKS = 4
CONNECT_S = 240.0  # the clients' wait for every stream's first message
END_S = 120.0  # and for every job stream's end, once the job was cancelled


def serve(*, port: int, database_url: str, data_dir: Path) -> None:
    from api.app import create_app
    from api.server import serve as apiary_serve
    from service.runtime import Runtime
    from service.settings import Settings
    from tests.support.fakes import FakeBackend

    settings = Settings(
        data_dir=data_dir,
        database_url=database_url,
        port=port,
        data_roots=str(data_dir.parent),
        auth_required=True,
    )
    backend = FakeBackend.running(node={"CPU": 16.0})  # the job's 4 ranks and its data loading
    apiary_serve(create_app(runtime=Runtime(settings, backend=backend)), settings)


# -- the clients (`watchers.py clients`: their own process, one event loop) -------------------------


async def sse_messages(url: str, path: str, token: str) -> AsyncIterator[tuple[str, str, str]]:
    """(event, id, data) of an event stream, over a bare asyncio connection: HTTP/1.1, chunked, as
    uvicorn sends a stream. httpx's line iterator cost more than the whole client budget of one
    loaded core at 1,200 streams."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
            "Accept: text/event-stream\r\n\r\n"
        )
        writer.write(request.encode())
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        status = head.split(" ", 2)[1]
        if status != "200":
            raise RuntimeError(f"HTTP {status} for {path}")
        buffer = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            buffer += (await reader.readexactly(size + 2))[:-2]
            *whole, buffer = buffer.split(b"\n\n")
            for block in whole:
                fields = dict(line.split(": ", 1) for line in block.decode().split("\n") if ": " in line)
                if "event" in fields:
                    yield fields["event"], fields.get("id", ""), fields.get("data", "")
    finally:
        writer.close()


async def job_client(url: str, path: str, token: str, ready: asyncio.Event) -> dict[str, Any]:
    """One job stream until `end`: a digest of the event ids and points it sent, in its order."""
    events: list[int] = []
    points: list[tuple[int, int]] = []
    ended = False
    try:
        async for event, _, data in sse_messages(url, path, token):
            ready.set()
            if event == "event":
                events.append(json.loads(data)["id"])
            elif event == "metrics":
                points += [(point["step"], point["rank"]) for point in json.loads(data)["data"]]
            elif event == "end":
                ended = True
                break
    finally:
        ready.set()
    return {"ended": ended, "digest": digest(events, points), "events": len(events), "points": len(points)}


async def queues_client(url: str, token: str, ready: asyncio.Event, stop: asyncio.Event) -> dict[str, Any]:
    """One queues stream until `stop`: the versions it was sent, and when the last one arrived."""
    versions: list[int] = []
    arrived: list[float] = []

    async def read() -> None:
        async for _, version, _ in sse_messages(url, "/queues/stream", token):
            versions.append(int(version))
            arrived.append(time.time())
            ready.set()

    reader = asyncio.ensure_future(read())
    await asyncio.wait([reader, asyncio.ensure_future(stop.wait())], return_when="FIRST_COMPLETED")
    reader.cancel()
    ready.set()
    last_at = arrived[-1] if arrived else 0.0
    return {"versions": len(versions), "increasing": versions == sorted(set(versions)), "last_at": last_at}


async def clients(url: str, path: str, tokens: list[str], job_clients: int, queue_clients: int) -> None:
    """Open every stream (50 connecting at a time), say `ready` on stdout once each got its first
    message, wait for the job streams' ends, then for `stop` on stdin; print a JSON summary."""
    connecting = asyncio.Semaphore(50)
    stop = asyncio.Event()
    readies: list[asyncio.Event] = []

    async def paced(make: Any) -> dict[str, Any]:
        ready = asyncio.Event()
        readies.append(ready)
        async with connecting:
            task = asyncio.ensure_future(make(ready))
            await asyncio.wait([task, asyncio.ensure_future(ready.wait())], return_when="FIRST_COMPLETED")
        result: dict[str, Any] = await task
        return result

    jobs = [
        asyncio.ensure_future(paced(lambda r, i=i: job_client(url, path, tokens[i % len(tokens)], r)))
        for i in range(job_clients)
    ]
    queues = [
        asyncio.ensure_future(paced(lambda r, i=i: queues_client(url, tokens[i % len(tokens)], r, stop)))
        for i in range(queue_clients)
    ]
    tasks = [*jobs, *queues]
    deadline = time.monotonic() + CONNECT_S  # a saturated service may never connect them all
    while time.monotonic() < deadline and (
        len(readies) < len(tasks)
        or not all(r.is_set() or t.done() for r, t in zip(readies, tasks, strict=True))
    ):
        await asyncio.sleep(0.2)
    print(f"ready {sum(ready.is_set() for ready in readies)}", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # `stop`: the job ended and the queues changed by now
    ended, late = await asyncio.wait(jobs, timeout=END_S)
    for task in late:
        task.cancel()
    job_results = [
        task.result() if task in ended else {"ended": False, "digest": "late", "events": 0, "points": 0}
        for task in jobs
    ]
    stop.set()
    queue_results = await asyncio.gather(*queues)
    print(json.dumps({"jobs": job_results, "queues": queue_results}), flush=True)


def digest(events: list[int], points: list[tuple[int, int]]) -> str:
    return hashlib.sha256(json.dumps([events, points]).encode()).hexdigest()[:16]


# -- the run ----------------------------------------------------------------------------------------


def make_tokens(database_url: str, users: int) -> list[str]:
    """Tokens of `users` users (the first submits the job), in a database migrated for the service."""
    from service.auth import Auth
    from service.settings import Settings
    from service.store.db import Database

    db = Database(database_url)
    try:
        db.upgrade()
        auth = Auth(db=db, settings=Settings(database_url=database_url))
        return [auth.create_token(user=f"watcher-{index}").secret for index in range(users)]
    finally:
        db.dispose()


def caught_up(http: httpx.Client, job_id: int) -> tuple[str, int]:
    """A job stream's cursor once it sent the job's history, and the last step it sent."""
    with http.stream("GET", f"/jobs/{job_id}/stream", timeout=httpx.Timeout(30, read=60)) as response:
        fields: dict[str, str] = {}
        for line in response.iter_lines():
            if line:
                name, _, value = line.partition(": ")
                fields[name] = value
            elif fields.get("event") == "metrics":
                return fields["id"], max(point["step"] for point in json.loads(fields["data"])["data"])
            else:
                fields = {}
    raise AssertionError("the job's stream ended before it sent a point")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def transactions(engine: Any, database: str) -> int:
    with engine.connect() as connection:
        connection.execute(text("SELECT pg_stat_clear_snapshot()"))
        found = connection.execute(
            text("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :name"),
            {"name": database},
        ).scalar_one()
    return int(found)


class Driver(threading.Thread):
    """The job's ranks, through one aggregator: a post per step, a trainer event every 10th step."""

    def __init__(self, url: str, job_id: int, token: str, steps_per_s: float) -> None:
        super().__init__(daemon=True)
        self.http = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"})
        self.job_id, self.period_s = job_id, 1 / steps_per_s
        self.steps = 0
        self.late_s = 0.0  # the most a post started behind its cadence
        self.halt = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.halt.is_set():
            step = self.steps
            self.late_s = max(self.late_s, time.monotonic() - (started + step * self.period_s))
            now = time.time()
            body: dict[str, Any] = {
                "attempt": 1,
                "points": [
                    {"step": step, "rank": rank, "time": now, "values": {"loss": 1 / (1 + step)}}
                    for rank in range(RANKS)
                ],
            }
            if step % 10 == 0:
                body["events"] = [
                    {"kind": "bench_mark", "step": step, "rank": 0, "time": now, "message": f"step {step}"}
                ]
            response = self.http.post(f"/internal/jobs/{self.job_id}/telemetry", json=body)
            assert response.status_code == 202, response.text
            self.steps += 1
            self.halt.wait(max(0.0, started + self.steps * self.period_s - time.monotonic()))


def measure(label: str, tree: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from auth_flood import probe, split_cpus

    service_cpus, client_cpus = split_cpus() if args.pin else (None, None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data_dir = workdir / f"data-{label}"
    from api_load import spec_for

    with postgres_database() as database_url:
        env = {**os.environ, "APIARY_BENCH_TREE": str(tree), "PYTHONPATH": str(tree)}
        # Migrated by the tree that serves it: an older service refuses a newer schema.
        made = subprocess.run(
            [sys.executable, __file__, "tokens", database_url, str(args.users)],
            env=env,
            cwd=tree,
            check=True,
            capture_output=True,
            text=True,
        )
        tokens = json.loads(made.stdout.strip().splitlines()[-1])
        with (workdir / f"serve-{label}.log").open("w") as log:
            server = subprocess.Popen(
                [sys.executable, __file__, "serve", str(port), database_url, str(data_dir)],
                env=env,
                cwd=tree,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if service_cpus:
            os.sched_setaffinity(server.pid, service_cpus)
            os.sched_setaffinity(0, service_cpus)  # the probe and the driver
        engine = create_engine(database_url.rsplit("/", 1)[0] + "/postgres")
        database = database_url.rsplit("/", 1)[1]
        try:
            http = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {tokens[0]}"})
            deadline = time.monotonic() + 300  # a loaded machine starts it slowly
            while time.monotonic() < deadline:
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            spec = {**spec_for(0, args.dataset_uri), "name": "watched", "num_workers": RANKS}
            spec["max_steps"] = 1_000_000
            submitted = http.post("/jobs", json=spec)
            assert submitted.status_code == 201, submitted.text
            job_id = submitted.json()["id"]
            report_token = ""
            for _ in range(1800):  # a loaded machine may take minutes
                tokens_found = list(data_dir.rglob(f"job-{job_id}/_apiary/attempt-1/report-token"))
                if tokens_found and http.get(f"/jobs/{job_id}").json()["state"] == "running":
                    report_token = tokens_found[0].read_text()
                    break
                time.sleep(0.1)
            assert report_token, "the job did not start"
            driver = Driver(url, job_id, report_token.strip(), args.steps_per_s)
            driver.start()
            time.sleep(5)  # past the submission's own work
            before = transactions(engine, database)
            rss_alone = rss_mib(server.pid)
            alone = probe(http, args.seconds)
            alone_tps = (transactions(engine, database) - before) / args.seconds

            # The clients join as the web view's job page does: at the cursor of what it rendered.
            cursor, last_step = caught_up(http, job_id)
            path = f"/jobs/{job_id}/stream?last_event_id={cursor}"
            client_args = [url, path, str(args.job_clients), str(args.queue_clients)]
            watchers = subprocess.Popen(
                [sys.executable, __file__, "clients", *client_args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert watchers.stdin is not None and watchers.stdout is not None
            if client_cpus:
                os.sched_setaffinity(watchers.pid, client_cpus)
            watchers.stdin.write(json.dumps(tokens) + "\n")
            watchers.stdin.flush()
            connect_started = time.monotonic()
            connected = int(watchers.stdout.readline().removeprefix("ready "))
            connect_s = time.monotonic() - connect_started
            before = transactions(engine, database)
            watched = probe(http, args.seconds)
            watched_tps = (transactions(engine, database) - before) / args.seconds
            rss_watched = rss_mib(server.pid)

            driver.halt.set()
            driver.join()
            assert http.post(f"/jobs/{job_id}/cancel").status_code == 200
            cancelled_at = time.time()
            time.sleep(3 * 1.0 + 1)  # the queues streams send their change (read once a second)
            out, _ = watchers.communicate("stop\n", timeout=300)
            received = json.loads(out.strip().splitlines()[-1])
            events = [event["id"] for event in http.get(f"/jobs/{job_id}/events").json()["data"]]
        finally:
            server.terminate()
            server.wait(60)
            engine.dispose()
            if service_cpus:
                os.sched_setaffinity(0, service_cpus | (client_cpus or set()))
    after = int(cursor.split(".")[0])
    points = [(step, rank) for step in range(last_step + 1, driver.steps) for rank in range(RANKS)]
    expected = digest([event for event in events if event > after], points)
    job_streams = received["jobs"]
    queue_streams = received["queues"]
    return {
        "alone": alone,
        "watched": watched,
        "alone_tps": alone_tps,
        "watched_tps": watched_tps,
        "connect_s": connect_s,
        "connected": connected,
        "rss_alone": rss_alone,
        "rss_watched": rss_watched,
        "steps": driver.steps,
        "points": len(points),
        "driver_late_s": driver.late_s,
        "events": len([event for event in events if event > after]),
        "job_ok": sum(s["ended"] and s["digest"] == expected for s in job_streams),
        "job_streams": len(job_streams),
        "queues_ok": sum(s["increasing"] and s["last_at"] >= cancelled_at for s in queue_streams),
        "queue_streams": len(queue_streams),
    }


def report(label: str, result: dict[str, Any], args: argparse.Namespace) -> None:
    from auth_flood import percentile

    alone, watched = result["alone"], result["watched"]
    p99_alone, p99_watched = percentile(alone, 99), percentile(watched, 99)
    print(f"{label}:")
    print(
        f"  /healthz alone (driver posting):  p50 {1000 * statistics.median(alone):.1f} ms, "
        f"p99 {1000 * p99_alone:.1f} ms; database {result['alone_tps']:.0f} transactions/s"
    )
    print(
        f"  /healthz with {args.job_clients} + {args.queue_clients} watchers: "
        f"p50 {1000 * statistics.median(watched):.1f} ms, p99 {1000 * p99_watched:.1f} ms "
        f"({p99_watched / p99_alone:.1f}x alone; goal < 100 ms); "
        f"database {result['watched_tps']:.0f} transactions/s"
    )
    print(
        f"  every event and point, in order, once: {result['job_ok']} of {result['job_streams']} job streams "
        f"({result['events']} events, {result['points']} points, from their Last-Event-ID on); "
        f"queues streams with the cancellation: {result['queues_ok']} of {result['queue_streams']}"
    )
    print(
        f"  streams with a first message: {result['connected']} in {result['connect_s']:.1f} s; "
        f"the service's RSS {result['rss_alone']:.0f} MiB alone, {result['rss_watched']:.0f} MiB with "
        f"the watchers; the driver's worst lateness {result['driver_late_s']:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job-clients", type=int, default=1000)
    parser.add_argument("--queue-clients", type=int, default=200)
    parser.add_argument("--users", type=int, default=10, help="distinct tokens the clients present")
    parser.add_argument("--steps-per-s", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=20.0, help="each probe phase")
    parser.add_argument(
        "--pin", action="store_true", help="the clients on the last CPU, the rest on the others"
    )
    parser.add_argument("--before", type=Path, help="also run an older checkout (its per-watcher polling)")
    args = parser.parse_args()
    from api_load import write_dataset

    print(f"# {machine()}", flush=True)
    print(f"# {command()}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        args.dataset_uri = write_dataset(workdir / "dataset")
        now = measure("now", ROOT, args, workdir)
        report("this tree (one poll per job, api.feeds)", now, args)
        if args.before is None:
            return
        before = measure("before", args.before.resolve(), args, workdir)
        report(f"before ({args.before})", before, args)
    from auth_flood import percentile

    print(f"# {machine()}")
    ratio = percentile(before["watched"], 99) / percentile(now["watched"], 99)
    print(f"p99 with the watchers, before / now: {ratio:.1f}x")
    tps = before["watched_tps"] / now["watched_tps"]
    print(f"database transactions/s with the watchers, before / now: {tps:.1f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(port=int(sys.argv[2]), database_url=sys.argv[3], data_dir=Path(sys.argv[4]))
    elif sys.argv[1:2] == ["tokens"]:
        print(json.dumps(make_tokens(sys.argv[2], int(sys.argv[3]))))
    elif sys.argv[1:2] == ["clients"]:
        url, path, job_clients, queue_clients = sys.argv[2:6]
        tokens = json.loads(sys.stdin.readline())
        asyncio.run(clients(url, path, tokens, int(job_clients), int(queue_clients)))
    else:
        main()
