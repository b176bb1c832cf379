"""Auth flood: the liveness probe while clients without a credential post 8 MiB bodies (issue 25).

    PYTHONPATH=. .venv/bin/python benchmarks/auth_flood.py        # ~1 minute

The service runs in its own process (`auth_flood.py serve`: uvicorn, the real app on SQLite with auth
required, a fake cluster), as `apiary serve` runs it. In one run:
1. baseline: `GET /healthz`, one request at a time for `--seconds`, alone;
2. flood: the same probe for as long while `--clients` threads of another process (`auth_flood.py flood`) each
   post `--body-mib` MiB bodies to `/internal/jobs/1/telemetry` (the largest body a route accepts)
   without a token, one after another, as fast as they are answered;
the two phases alternate for `--rounds` rounds (the machine's other load then weighs on both).

`--pin` stands for a deployment where the clients are other machines: the flooding process runs on
the last CPU, the service and the probe on the others (`os.sched_setaffinity`; needs 2 CPUs or more).
Without it all three share every core, and on a 2-core VM the p99 follows the flood's own CPU use.

Printed: the probe's p50/p99 in both phases and their ratio (goal: p99 within 2x of the baseline's,
and under 100 ms), and how many flood posts were answered, with which statuses and how fast. Before
api.gate, each such post was read and parsed before its 401: four 7.5 MiB posts took `/healthz` from
6 ms to a 1.9 s median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from _common import command, machine  # noqa: E402

from service.cluster import free_port  # noqa: E402


def split_cpus() -> tuple[set[int], set[int]]:
    """(the service's and the probe's CPUs, the flood's): the last CPU for the flood."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least 2 CPUs")
    return set(cpus[:-1]), {cpus[-1]}


def serve(*, port: int, data_dir: Path) -> None:
    import uvicorn

    from api.app import create_app
    from service.runtime import Runtime
    from service.settings import Settings
    from tests.support.fakes import FakeBackend

    settings = Settings(
        data_dir=data_dir,
        database_url=f"sqlite:///{data_dir / 'apiary.db'}",
        port=port,
        auth_required=True,
        data_roots=str(data_dir),
    )
    app = create_app(runtime=Runtime(settings, backend=FakeBackend.running()))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def flood(*, url: str, clients: int, body_mib: float, seconds: float) -> None:
    """Post bodies without a token from `clients` threads for `seconds`; print what came back (JSON)."""
    body = b'{"attempt": 1, "points": [], "pad": "' + b"x" * int(body_mib * 1024 * 1024 - 64) + b'"}'
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    status = str(
                        http.post(
                            "/internal/jobs/1/telemetry",
                            content=body,
                            headers={"Content-Type": "application/json"},
                        ).status_code
                    )
                except httpx.HTTPError as err:
                    status = type(err).__name__
                with lock:
                    statuses[status] += 1
                    latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"statuses": statuses, "latencies": latencies}))


def probe(http: httpx.Client, seconds: float) -> list[float]:
    """`GET /healthz` one at a time for `seconds`: each latency, in seconds."""
    latencies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        assert http.get("/healthz").status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.01)
    return latencies


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--body-mib", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase of a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--pin", action="store_true", help="the flood on the last CPU, the service and probe on the others"
    )
    args = parser.parse_args()
    service_cpus, flood_cpus = split_cpus() if args.pin else (None, None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        server = subprocess.Popen([sys.executable, __file__, "serve", str(port), folder])
        if service_cpus:
            os.sched_setaffinity(server.pid, service_cpus)
            os.sched_setaffinity(0, service_cpus)  # the probe
        try:
            with httpx.Client(base_url=url, timeout=30) as http:
                for _ in range(300):
                    try:
                        if http.get("/healthz").status_code == 200:
                            break
                    except httpx.HTTPError:
                        time.sleep(0.1)
                assert http.get("/jobs").status_code == 401, "auth must be required"
                # Alternating rounds, so that the machine's other load weighs on both phases alike.
                alone: list[float] = []
                flooded: list[float] = []
                posts: dict[str, Any] = {"statuses": Counter(), "latencies": []}
                for _ in range(args.rounds):
                    alone += probe(http, args.seconds)
                    flood_args = [url, str(args.clients), str(args.body_mib), str(args.seconds + 2)]
                    flooder = subprocess.Popen(
                        [sys.executable, __file__, "flood", *flood_args],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    if flood_cpus:
                        os.sched_setaffinity(flooder.pid, flood_cpus)
                    time.sleep(1.0)  # the flood is under way
                    flooded += probe(http, args.seconds)
                    out, _ = flooder.communicate(timeout=args.seconds + 120)
                    answered = json.loads(out)
                    posts["statuses"].update(answered["statuses"])
                    posts["latencies"] += answered["latencies"]
        finally:
            server.terminate()
            server.wait(30)
    p99_alone, p99_flooded = percentile(alone, 99), percentile(flooded, 99)
    print(f"# {machine()}")
    print(f"# {command()}")
    if args.pin:
        print(
            f"# pinned: service and probe on CPUs {sorted(service_cpus or ())}, "
            f"flood on {sorted(flood_cpus or ())}"
        )
    print(f"/healthz alone:   p50 {1000 * statistics.median(alone):.1f} ms, p99 {1000 * p99_alone:.1f} ms")
    print(
        f"/healthz flooded: p50 {1000 * statistics.median(flooded):.1f} ms, p99 {1000 * p99_flooded:.1f} ms "
        f"({args.clients} clients, {args.body_mib:g} MiB bodies without a token)"
    )
    print(f"p99 flooded / alone: {p99_flooded / p99_alone:.2f}x (goal <= 2x and < 100 ms)")
    latencies = posts["latencies"]
    print(
        f"flood posts answered: {sum(posts['statuses'].values())} {dict(posts['statuses'])}, "
        f"median {1000 * statistics.median(latencies):.1f} ms each"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(port=int(sys.argv[2]), data_dir=Path(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "flood":
        flood(
            url=sys.argv[2], clients=int(sys.argv[3]), body_mib=float(sys.argv[4]), seconds=float(sys.argv[5])
        )
    else:
        main()
