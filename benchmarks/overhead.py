"""Orchestration overhead: an Apiary job versus plain `torch.distributed` DDP, same model, data and workers.

    .venv/bin/python benchmarks/overhead.py --steps 100

One run does both sides, one after the other, on one synthetic token dataset (parquet, written with
`service.datasets.write_token_dataset`) and one JobSpec (built-in `gpt`, 2 workers, 1 CPU each):

1. plain DDP: `benchmarks/plain_ddp.py`, 2 processes, gloo, pyarrow reads the shards into memory;
2. Apiary: a real `apiary serve` (SQLite, its own local Ray) in a temporary data dir; a short
   warm-up job first, so that the measured job runs on an already running cluster (Ray workers,
   Train's controller code and torch imported once), then the measured job, submitted over HTTP;
   its per-step metrics are read back from `GET /jobs/{id}/metrics`;
3. plain DDP again (unless `--no-bracket`): other work on a shared machine drifts, and the mean of
   the runs before and after Apiary is fairer than either alone.

Figures, from the unix time at which rank 0 finished each step (both sides record it there):
- steady-state samples/s over steps (warmup, max_steps], and the ratio Apiary / plain (goal >= 0.95);
- fixed cost: from submission (POST /jobs; for plain DDP the process start) to the end of step 1
  (goal < 15 s for Apiary on a running cluster), with Apiary's split from its job events.
The machine's load average is printed beside each side: other work on the machine skews both.
`--results benchmarks/RESULTS.md` appends the figures as a markdown section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.client import ApiaryClient  # noqa: E402
from service.cluster import free_port  # noqa: E402
from service.datasets import write_token_dataset  # noqa: E402

GOAL_RATIO = 0.95
GOAL_FIXED_COST_S = 15.0


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min, {os.cpu_count()} cores)"


def build_spec(args: argparse.Namespace, *, dataset_uri: str, max_steps: int, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "queue": "research",
        "trainer": "gpt",
        "num_workers": args.workers,
        "resources_per_worker": {"CPU": 1},
        "dataset": {"uri": dataset_uri, "format": "parquet"},
        "max_steps": max_steps,
        "batch_size": args.batch_size,
        "seed": 0,
        "config": {
            "vocab_size": args.vocab_size,
            "d_model": args.d_model,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "lr": 1e-3,
            "warmup_steps": 10,
        },
    }


def steady_state(step_end_times: dict[int, float], *, warmup: int, samples_per_step: int) -> float:
    """Samples/s over steps (warmup, last]: the wall time between the ends of step `warmup` and the last."""
    last = max(step_end_times)
    if warmup >= last:
        raise ValueError(f"--warmup-steps {warmup} leaves no steady-state steps (max step {last})")
    return (last - warmup) * samples_per_step / (step_end_times[last] - step_end_times[warmup])


def median_step_s(step_end_times: dict[int, float], *, warmup: int) -> float:
    steps = sorted(s for s in step_end_times if s > warmup)
    return statistics.median(
        step_end_times[s] - step_end_times[s - 1] for s in steps if s - 1 in step_end_times
    )


# -- plain DDP ---------------------------------------------------------------------------------------


def run_plain(spec: dict[str, Any], *, workdir: Path, samples_per_step: int, warmup: int) -> dict[str, Any]:
    spec_file, out = workdir / "plain-spec.json", workdir / "plain-result.json"
    spec_file.write_text(json.dumps(spec))
    before = load()
    started = time.time()
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "plain_ddp.py"),
            "--spec",
            str(spec_file),
            "--out",
            str(out),
        ],
        check=True,
        cwd=ROOT,
    )
    wall_s = time.time() - started
    result = json.loads(out.read_text())
    times = {step + 1: t for step, t in enumerate(result["step_end_times"])}
    return {
        "samples_per_s": steady_state(times, warmup=warmup, samples_per_step=samples_per_step),
        "median_step_s": median_step_s(times, warmup=warmup),
        "first_step_s": times[1] - started,
        "wall_s": wall_s,
        "final_loss": result["losses"][-1],
        "threads_per_worker": result["threads"],
        "load_before": before,
        "load_after": load(),
    }


# -- Apiary ------------------------------------------------------------------------------------------


class Serve:
    """`apiary serve` in its own data dir (SQLite, local Ray), stopped with SIGTERM as a supervisor does."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.log = data_dir / "serve.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "APIARY_DATA_DIR": str(data_dir), "RAY_USAGE_STATS_ENABLED": "0"}
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).parent / "apiary"), "serve", "--port", str(self.port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_healthy(self, timeout_s: float = 180) -> float:
        started = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"apiary serve exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).json().get("status") == "ok":
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"apiary serve is not healthy after {timeout_s:.0f} s; see {self.log}")
            time.sleep(0.5)

    def ray_job_logs(self, submission_id: str) -> str:
        """The Ray job's driver log, read from the local Ray's Jobs API (with its token)."""
        state = json.loads((self.data_dir / "ray_cluster.json").read_text())
        token = Path(state["auth_token_path"]).read_text().strip()
        response = httpx.get(
            f"{state['dashboard_url']}/api/jobs/{submission_id}/logs",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        response.raise_for_status()
        return str(response.json().get("logs", ""))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(90)
            except subprocess.TimeoutExpired:
                self.process.kill()


def run_job(client: ApiaryClient, spec: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    submitted = time.time()
    job = client.submit(spec)
    job = client.wait(job["id"], timeout_s=timeout_s, poll_s=0.5)
    if job["state"] != "succeeded":
        raise RuntimeError(f"Apiary job {job['id']} ended {job['state']}: {job.get('message')}")
    points = client.metrics(job["id"], rank=0)
    events = client.events(job["id"])
    return {"submitted": submitted, "job": job, "points": points, "events": events}


def event_offsets(events: list[dict[str, Any]], *, since: float) -> dict[str, float]:
    """Seconds from submission to each state the job entered (the service's own timestamps)."""
    offsets: dict[str, float] = {}
    for event in events:
        if event["to_state"]:
            at = datetime.fromisoformat(event["at"])
            at = at if at.tzinfo else at.replace(tzinfo=UTC)
            offsets.setdefault(event["to_state"], at.timestamp() - since)
    return offsets


def run_apiary(
    spec: dict[str, Any], warmup_spec: dict[str, Any], *, workdir: Path, samples_per_step: int, warmup: int
) -> dict[str, Any]:
    serve = Serve(workdir / "apiary")
    try:
        startup_s = serve.wait_healthy()
        with ApiaryClient(serve.url, user="benchmark") as client:
            warm = run_job(client, warmup_spec, timeout_s=900)
            before = load()
            measured = run_job(client, spec, timeout_s=1800)
            after = load()
        # Kept for reading where the fixed cost went (driver start, dataset check, worker group start).
        driver_log = workdir / "apiary-measured-job.log"
        driver_log.write_text(serve.ray_job_logs(measured["job"]["ray_submission_id"]))
    finally:
        serve.stop()
    times = {point["step"]: point["time"] for point in measured["points"]}
    values = [point["values"] for point in measured["points"] if point["step"] > warmup]
    data_wait_share = sum(v["data_wait_s"] for v in values) / sum(v["step_time_s"] for v in values)
    warm_times = {point["step"]: point["time"] for point in warm["points"]}
    return {
        "samples_per_s": steady_state(times, warmup=warmup, samples_per_step=samples_per_step),
        "median_step_s": median_step_s(times, warmup=warmup),
        "first_step_s": times[1] - measured["submitted"],
        "first_step_cold_s": warm_times[1] - warm["submitted"],
        "events": event_offsets(measured["events"], since=measured["submitted"]),
        "data_wait_share": data_wait_share,
        "final_loss": measured["points"][-1]["values"]["loss"],
        "service_startup_s": startup_s,
        "driver_log": str(driver_log),
        "load_before": before,
        "load_after": after,
    }


# -- report ------------------------------------------------------------------------------------------


def report(
    args: argparse.Namespace, *, plains: list[dict[str, Any]], apiary: dict[str, Any], command: str
) -> str:
    # Plain DDP runs before and after Apiary: their mean brackets a load that drifted meanwhile.
    plain = {
        key: statistics.mean(run[key] for run in plains)
        for key in ("samples_per_s", "median_step_s", "first_step_s", "final_loss")
    }
    per_run = ", ".join(f"{run['samples_per_s']:.1f} ({run['load_after']})" for run in plains)
    ratio = apiary["samples_per_s"] / plain["samples_per_s"]
    events = ", ".join(f"{state} +{offset:.1f} s" for state, offset in apiary["events"].items())
    ratio_verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
    fixed_verdict = "met" if apiary["first_step_s"] < GOAL_FIXED_COST_S else "NOT met"
    return "\n".join(
        [
            f"## Orchestration overhead, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} cores, "
            f"{platform.python_implementation()} {platform.python_version()}, no GPU",
            f"- command: `{command}`",
            f"- workload: gpt d_model={args.d_model} n_layers={args.n_layers} n_heads={args.n_heads} "
            f"vocab={args.vocab_size} seq_len={args.seq_len}, "
            f"{args.workers} workers x batch {args.batch_size}, "
            f"{args.steps} steps (steady state = steps {args.warmup_steps + 1}..{args.steps})",
            "",
            "| | plain DDP | Apiary | ratio |",
            "| --- | --- | --- | --- |",
            f"| steady-state samples/s | {plain['samples_per_s']:.1f} | {apiary['samples_per_s']:.1f} | "
            f"**{ratio:.3f}** (goal >= {GOAL_RATIO}: {ratio_verdict}) |",
            f"| median step time | {plain['median_step_s'] * 1000:.0f} ms | "
            f"{apiary['median_step_s'] * 1000:.0f} ms | |",
            f"| submission to end of step 1 | {plain['first_step_s']:.1f} s (process start) | "
            f"{apiary['first_step_s']:.1f} s (running cluster; goal < {GOAL_FIXED_COST_S:.0f} s: "
            f"{fixed_verdict}) | |",
            f"| final loss | {plain['final_loss']:.3f} | {apiary['final_loss']:.3f} | |",
            f"| load at the end of the side | {plains[-1]['load_after']} | {apiary['load_after']} | |",
            "",
            f"- Apiary, measured job after submission: {events}; first step +{apiary['first_step_s']:.1f} s. "
            f"The warm-up job on the freshly started cluster took {apiary['first_step_cold_s']:.1f} s to its "
            f"first step; `apiary serve` itself was healthy after {apiary['service_startup_s']:.1f} s.",
            f"- Apiary data-wait share of step time (steady state): {100 * apiary['data_wait_share']:.1f}%.",
            f"- plain DDP: {plains[0]['threads_per_worker']} torch thread(s) per process (Ray gives a 1-CPU "
            f"worker OMP_NUM_THREADS=1); {len(plains)} run(s), samples/s and load after each: {per_run}. "
            f"Apiary load before the measured job: {apiary['load_before']}.",
            f"- Apiary driver log of the measured job: {apiary['driver_log']}.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps of each side")
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the steady state")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument(
        "--seq-len", type=int, default=129, help="tokens per row (the model sees seq_len - 1)"
    )
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--warmup-job-steps", type=int, default=3, help="steps of the job that warms Ray up")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed")
    parser.add_argument(
        "--no-bracket", action="store_true", help="run plain DDP only before Apiary, not also after it"
    )
    parser.add_argument("--results", type=Path, default=None, help="append the figures to this markdown file")
    args = parser.parse_args()
    command = shlex.join(["python", "benchmarks/overhead.py", *sys.argv[1:]])

    with tempfile.TemporaryDirectory(prefix="apiary-overhead-") as temporary:
        workdir = (args.workdir or Path(temporary)).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        samples_per_step = args.workers * args.batch_size
        # One epoch covers the whole run, rounded up to whole shards: no side pays an epoch boundary
        # more than the other.
        num_shards = 4
        rows_per_shard = -(-args.steps * samples_per_step // num_shards)
        dataset_uri = (workdir / "tokens").as_uri()
        write_token_dataset(
            dataset_uri,
            num_shards=num_shards,
            rows_per_shard=rows_per_shard,
            seq_len=args.seq_len,
            vocab_size=args.vocab_size,
        )
        spec = build_spec(args, dataset_uri=dataset_uri, max_steps=args.steps, name="overhead")
        warmup_spec = build_spec(
            args, dataset_uri=dataset_uri, max_steps=args.warmup_job_steps, name="warmup"
        )
        print(f"dataset: {num_shards} x {rows_per_shard} rows at {dataset_uri}; {load()}", flush=True)

        plains = []
        print("plain DDP ...", flush=True)
        plains.append(
            run_plain(spec, workdir=workdir, samples_per_step=samples_per_step, warmup=args.warmup_steps)
        )
        print(json.dumps(plains[-1], indent=1), flush=True)
        print("Apiary ...", flush=True)
        apiary = run_apiary(
            spec, warmup_spec, workdir=workdir, samples_per_step=samples_per_step, warmup=args.warmup_steps
        )
        print(json.dumps(apiary, indent=1), flush=True)
        if not args.no_bracket:
            print("plain DDP again (brackets the Apiary run against load drift) ...", flush=True)
            plains.append(
                run_plain(spec, workdir=workdir, samples_per_step=samples_per_step, warmup=args.warmup_steps)
            )
            print(json.dumps(plains[-1], indent=1), flush=True)

    text = report(args, plains=plains, apiary=apiary, command=command)
    print()
    print(text)
    ratio = apiary["samples_per_s"] / statistics.mean(run["samples_per_s"] for run in plains)
    print(f"ratio Apiary / plain DDP (steady-state samples/s): {ratio:.3f}")
    if args.results is not None:
        with args.results.open("a") as results:
            results.write("\n" + text)


if __name__ == "__main__":
    main()
