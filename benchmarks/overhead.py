"""Orchestration overhead: an Apiary job versus plain `torch.distributed` DDP, same model, data and workers.

    .venv/bin/python benchmarks/overhead.py                  # 150 steps, 3 Apiary jobs
    .venv/bin/python benchmarks/overhead.py --steps 300 --repeats 5
    .venv/bin/python benchmarks/overhead.py --trainer hf-gpt2 --custom-repeats 0   # the GPT-2 recipe

One run does both sides on one synthetic token dataset (parquet, `api.demo.token_table`) and one
JobSpec (built-in `gpt`, or with `--trainer hf-gpt2` the Hugging Face GPT-2 recipe of
`examples/hf_gpt2` at the same sizes; 2 workers, 1 CPU each; plain DDP builds the same recipe's model,
loss and optimizer):

1. plain DDP with the machine to itself: `benchmarks/plain_ddp.py`, 2 processes, gloo, pyarrow reads
   the shards into memory;
2. Apiary: a real `apiary serve` (SQLite, its own local Ray) in a temporary data dir; a short
   warm-up job first, so that the measured jobs run on an already running cluster, then `--repeats`
   times: one measured job submitted over HTTP (per-step metrics read back from
   `GET /jobs/{id}/metrics`), then plain DDP again beside the idle Apiary cluster;
3. plain DDP with the machine to itself again: load from other work drifts, and these bracket it.

Figures, from the unix time at which rank 0 finished each step (both sides record it there):
- steady-state samples/s over steps (warmup, max_steps], and the ratio of the medians Apiary / plain
  (goal >= 0.95). The ratio Apiary / plain-beside-the-idle-cluster splits the overhead into what the
  job's own path costs and what the cluster's resident processes (raylet, GCS, dashboard, the API)
  take from the same cores;
- fixed cost: from submission (POST /jobs; for plain DDP the process start) to the end of step 1
  (goal < 15 s for Apiary on a running cluster), split into milestones from the job's events, the
  driver's log and rank 0's "ready" log line.
The machine's load average is printed beside each side: other work on the machine skews both. The
report ends with a markdown section (figures, machine, command) for `benchmarks/RESULTS.md`.
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
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.client import ApiaryClient  # noqa: E402
from api.demo import token_table, write_shards  # noqa: E402
from service.cluster import RayBackend, free_port  # noqa: E402
from trainers import startup  # noqa: E402

GOAL_RATIO = 0.95
GOAL_FIXED_COST_S = 8.0
# Issue 16: submission to the end of step 1 at most plain DDP's process start to its step 1 plus this.
GOAL_OVER_PLAIN_S = 3.0
CUSTOM_TRAINER = "benchmarks.startup_trainer:train"
# --trainer: the built-in gpt, or the Hugging Face GPT-2 recipe (examples/hf_gpt2) on the same tokens.
TRAINERS = {"gpt": "gpt", "hf-gpt2": "examples.hf_gpt2.hf_gpt2:GPT2LM"}


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min, {os.cpu_count()} cores)"


def build_spec(args: argparse.Namespace, *, dataset_uri: str, max_steps: int, name: str) -> dict[str, Any]:
    trainer = getattr(args, "trainer", "gpt")
    config = (
        {
            "vocab_size": args.vocab_size,
            "d_model": args.d_model,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "lr": 1e-3,
            "warmup_steps": 10,
        }
        if trainer == "gpt"
        else {
            "vocab_size": args.vocab_size,
            "n_embd": args.d_model,
            "n_layer": args.n_layers,
            "n_head": args.n_heads,
            "lr": 1e-3,
            "warmup_steps": 10,
        }
    )
    return {
        "name": name,
        "queue": "research",
        "trainer": TRAINERS[trainer],
        "num_workers": args.workers,
        "resources_per_worker": {"CPU": 1},
        "dataset": {"uri": dataset_uri, "format": "parquet"},
        "max_steps": max_steps,
        "batch_size": args.batch_size,
        "seed": 0,
        "config": config,
    }


class CpuClock:
    """The machine's busy CPU seconds (all cores, /proc/stat), sampled every 0.1 s in a thread, so
    that the CPU work of a start-up (from submission, or process start, to the end of step 1) can be
    read after the fact: on a machine with few cores, that work divided by the cores is a floor under
    the start-up's wall time, whatever runs in parallel."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-clock", daemon=True)

    @staticmethod
    def busy_s() -> float:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
        idle, iowait = fields[3], fields[4]
        return (sum(fields[:8]) - idle - iowait) / os.sysconf("SC_CLK_TCK")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.busy_s()))
            self._stop.wait(0.1)

    def __enter__(self) -> CpuClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, when: float) -> float:
        """Busy CPU seconds at `when` (the nearest sample)."""
        return min(self.samples, key=lambda sample: abs(sample[0] - when))[1]

    def between(self, start: float, end: float) -> float:
        return self.at(end) - self.at(start)


def idle_cpu_rate(seconds: float = 5.0) -> float:
    """Busy CPU seconds per second of what already runs (an idle cluster, the API): subtracted from
    a start-up's CPU work."""
    with CpuClock() as clock:
        time.sleep(seconds)
    (first, busy_first), (last, busy_last) = clock.samples[0], clock.samples[-1]
    return (busy_last - busy_first) / (last - first)


def steady_state(step_end_times: dict[int, float], *, warmup: int, samples_per_step: int) -> float:
    """Samples/s over steps (warmup, last]: the wall time between the ends of step `warmup` and the last."""
    last = max(step_end_times)
    if warmup >= last:
        raise ValueError(f"--warmup-steps {warmup} leaves no steady-state steps (max step {last})")
    return (last - warmup) * samples_per_step / (step_end_times[last] - step_end_times[warmup])


def data_wait_share(values: list[dict[str, float]]) -> float:
    """The share of step time spent waiting for data, over these per-step metric values."""
    return sum(v["data_wait_s"] for v in values) / sum(v["step_time_s"] for v in values)


def median_step_s(step_end_times: dict[int, float], *, warmup: int) -> float:
    steps = sorted(s for s in step_end_times if s > warmup)
    return statistics.median(
        step_end_times[s] - step_end_times[s - 1] for s in steps if s - 1 in step_end_times
    )


# -- plain DDP ---------------------------------------------------------------------------------------


def run_plain(
    spec: dict[str, Any],
    *,
    workdir: Path,
    samples_per_step: int,
    warmup: int,
    cpus: set[int] | None = None,
) -> dict[str, Any]:
    """One plain DDP run; with `cpus`, its processes (and all they start) run on those cores only."""
    spec_file, out = workdir / "plain-spec.json", workdir / "plain-result.json"
    spec_file.write_text(json.dumps(spec))
    before = load()
    idle_rate = idle_cpu_rate()
    with CpuClock() as clock:
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
            preexec_fn=None if cpus is None else (lambda: os.sched_setaffinity(0, cpus)),
        )
        wall_s = time.time() - started
    result = json.loads(out.read_text())
    times = {step + 1: t for step, t in enumerate(result["step_end_times"])}
    return {
        "startup_cpu_s": clock.between(started, times[1]) - idle_rate * (times[1] - started),
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

    def __init__(self, data_dir: Path, *, data_root: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.log = data_dir / "serve.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "APIARY_DATA_DIR": str(data_dir),
            "APIARY_DATA_ROOTS": data_root.as_uri(),
            # The custom trainer below (benchmarks.startup_trainer): the local Ray's processes, the
            # job's driver and workers among them, inherit this path from `apiary serve`.
            "APIARY_TRAINER_MODULES": "benchmarks,examples",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray folds log lines that look alike across a job's processes (numbers masked) into one:
            # rank 0's step-1 start-up mark, next to rank 1's, never reached the driver's log.
            "RAY_DEDUP_LOGS": "0",
        }
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
                if httpx.get(f"{self.url}/readyz", timeout=2).json().get("status") == "ok":
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"apiary serve is not healthy after {timeout_s:.0f} s; see {self.log}")
            time.sleep(0.5)

    def ray_backend(self) -> RayBackend:
        """The service's own Ray client (with the local Ray's token)."""
        state = json.loads((self.data_dir / "ray_cluster.json").read_text())
        return RayBackend(state["dashboard_url"], auth_token_path=Path(state["auth_token_path"]))

    def ray_job_logs(self, submission_id: str) -> str:
        """The Ray job's driver log: every process of the job forwards its output there."""
        return self.ray_backend().job_logs(submission_id)

    def ray_job_submitted_at(self, submission_id: str) -> float:
        """When Ray accepted the submission (its Jobs API's start_time), unix seconds."""
        started = self.ray_backend()._jobs.get_job_info(submission_id).start_time
        if started is None:
            raise RuntimeError(f"Ray reports no start time for job {submission_id}")
        return started / 1000

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
    # Every figure comes from the job's own timestamps (metrics, events), not from this poll: poll
    # rarely, so that the benchmark's requests take next to nothing from the job's cores.
    job = client.wait(job.id, timeout_s=timeout_s, poll_s=5)
    if job.state != "succeeded":
        raise RuntimeError(f"Apiary job {job.id} ended {job.state}: {job.message}")
    # Plain JSON from here: the figures below read the API's fields by name.
    points = [point.model_dump(mode="json") for point in client.metrics(job.id, rank=0)]
    events = [event.model_dump(mode="json") for event in client.events(job.id)]
    return {"submitted": submitted, "job": job.model_dump(mode="json"), "points": points, "events": events}


def event_offsets(events: list[dict[str, Any]], *, since: float) -> dict[str, float]:
    """Seconds from submission to each state the job entered (the service's own timestamps)."""
    offsets: dict[str, float] = {}
    for event in events:
        if event["to_state"]:
            at = datetime.fromisoformat(event["at"])
            at = at if at.tzinfo else at.replace(tzinfo=UTC)
            offsets.setdefault(event["to_state"], at.timestamp() - since)
    return offsets


def startup_offsets(driver_log: str, *, since: float) -> dict[str, float]:
    """Seconds from submission to each start-up mark of the driver, the Train controller and rank 0
    (`trainers.startup`: each process prints its marks, Ray forwards them to the driver's log)."""
    offsets: dict[str, float] = {}
    for record in startup.parse(driver_log):
        role = str(record["role"])
        if role not in ("driver", "controller", "rank 0"):
            continue
        for name, at in dict(record["marks"]).items():  # type: ignore[call-overload]
            offsets.setdefault(f"{role}: {name}", float(at) - since)
    return offsets


# Where the time from submission to the end of rank 0's step 1 goes: (what, from mark, to mark);
# consecutive rows, so they add up to the total.
SPLITS = (
    ("submission to Ray (queue, admission, runtime_env upload)", None, "ray: job submitted"),
    ("Ray job supervisor and the driver's process start", "ray: job submitted", "driver: process_started"),
    ("driver imports (ray.train, ray.data, trainers)", "driver: process_started", "driver: imports_done"),
    ("driver connects to Ray", "driver: imports_done", "driver: connected"),
    ("driver checks the dataset (footers)", "driver: connected", "driver: checked"),
    ("driver builds the trainer", "driver: checked", "driver: fit_called"),
    ("Train controller process start", "driver: fit_called", "controller: process_started"),
    (
        "controller start-up, placement group, worker processes spawned",
        "controller: process_started",
        "rank 0: process_started",
    ),
    (
        "worker process: Ray worker and Train actor start",
        "rank 0: process_started",
        "rank 0: torch_importing",
    ),
    ("worker imports torch (ray.train.torch)", "rank 0: torch_importing", "rank 0: torch_imported"),
    ("process group init (gloo rendezvous)", "rank 0: torch_imported", "controller: process_group_ready"),
    ("Ray Train starts the train function", "controller: process_group_ready", "rank 0: loop_entered"),
    ("train loop imports (trainers.loop and deps)", "rank 0: loop_entered", "rank 0: loop_imported"),
    ("telemetry, group join (a collective)", "rank 0: loop_imported", "rank 0: group_joined"),
    ("checkpoint lookup", "rank 0: group_joined", "rank 0: stream_opening"),
    (
        "data stream open (its reads go on in the background)",
        "rank 0: stream_opening",
        "rank 0: stream_opened",
    ),
    (
        "model build, wrap, optimizer (beside the stream's first reads)",
        "rank 0: stream_opened",
        "rank 0: model_built",
    ),
    ("ready (announce)", "rank 0: model_built", "rank 0: ready"),
    ("step 1", "rank 0: ready", "rank 0: step_1_done"),
)


def split(phases: dict[str, float]) -> list[tuple[str, float | None]]:
    """SPLITS in seconds for one job's phases (None where a mark is missing: a custom trainer has no
    marks after it is entered)."""
    rows: list[tuple[str, float | None]] = []
    for what, start, end in SPLITS:
        begin = 0.0 if start is None else phases.get(start)
        finish = phases.get(end)
        rows.append((what, None if begin is None or finish is None else finish - begin))
    return rows


def measure_job(
    serve: Serve, client: ApiaryClient, spec: dict[str, Any], *, samples_per_step: int, warmup: int
) -> dict[str, Any]:
    before = load()
    idle_rate = idle_cpu_rate()
    with CpuClock() as clock:
        measured = run_job(client, spec, timeout_s=1800)
    times = {point["step"]: point["time"] for point in measured["points"]}
    values = [point["values"] for point in measured["points"] if point["step"] > warmup]
    submission_id = measured["job"]["ray_submission_id"]
    driver_log = serve.ray_job_logs(submission_id)
    phases = {
        **event_offsets(measured["events"], since=measured["submitted"]),
        "ray: job submitted": serve.ray_job_submitted_at(submission_id) - measured["submitted"],
        **startup_offsets(driver_log, since=measured["submitted"]),
        "step 1 done": times[1] - measured["submitted"],
    }
    return {
        "samples_per_s": steady_state(times, warmup=warmup, samples_per_step=samples_per_step),
        "median_step_s": median_step_s(times, warmup=warmup),
        "first_step_s": times[1] - measured["submitted"],
        "startup_cpu_s": clock.between(measured["submitted"], times[1])
        - idle_rate * (times[1] - measured["submitted"]),
        "phases": dict(sorted(phases.items(), key=lambda item: item[1])),
        "data_wait_share": data_wait_share(values),
        "final_loss": measured["points"][-1]["values"]["loss"],
        "driver_log": driver_log,
        "load_before": before,
        "load_after": load(),
    }


def measure_custom_job(serve: Serve, client: ApiaryClient, spec: dict[str, Any]) -> dict[str, Any]:
    """One job of the custom trainer (benchmarks.startup_trainer): its start-up marks only (it posts
    no step metrics; it marks the end of its own step 1)."""
    # A Ray Train function gets the spec's `config`: what it needs of the spec goes there.
    config = {
        **spec["config"],
        "max_steps": spec["max_steps"],
        "batch_size": spec["batch_size"],
        "seed": spec["seed"],
    }
    custom = {**spec, "name": "overhead-custom", "trainer": CUSTOM_TRAINER, "config": config}
    measured = run_job(client, custom, timeout_s=900)
    submission_id = measured["job"]["ray_submission_id"]
    phases = {
        **event_offsets(measured["events"], since=measured["submitted"]),
        "ray: job submitted": serve.ray_job_submitted_at(submission_id) - measured["submitted"],
        **startup_offsets(serve.ray_job_logs(submission_id), since=measured["submitted"]),
    }
    return {
        "first_step_s": phases.get("rank 0: step_1_done"),
        "phases": dict(sorted(phases.items(), key=lambda item: item[1])),
    }


def run_apiary(
    spec: dict[str, Any],
    warmup_spec: dict[str, Any],
    *,
    workdir: Path,
    samples_per_step: int,
    warmup: int,
    repeats: int,
    custom_repeats: int,
    plain_beside: Any,
) -> dict[str, Any]:
    """A warm-up job, then `repeats` x (measured Apiary job, plain DDP beside the idle cluster)."""
    serve = Serve(workdir / "apiary", data_root=workdir)
    jobs: list[dict[str, Any]] = []
    beside: list[dict[str, Any]] = []
    custom: list[dict[str, Any]] = []
    try:
        startup_s = serve.wait_healthy()
        with ApiaryClient(serve.url) as client:
            warm = run_job(client, warmup_spec, timeout_s=900)
            for repeat in range(repeats):
                print(f"Apiary job {repeat + 1}/{repeats} ...", flush=True)
                jobs.append(
                    measure_job(serve, client, spec, samples_per_step=samples_per_step, warmup=warmup)
                )
                print(
                    json.dumps({k: v for k, v in jobs[-1].items() if k != "driver_log"}, indent=1), flush=True
                )
                print(f"plain DDP beside the idle Apiary cluster {repeat + 1}/{repeats} ...", flush=True)
                beside.append(plain_beside())
                print(json.dumps(beside[-1], indent=1), flush=True)
            for repeat in range(custom_repeats):
                print(f"Apiary job of a custom trainer {repeat + 1}/{custom_repeats} ...", flush=True)
                custom.append(measure_custom_job(serve, client, spec))
                print(json.dumps(custom[-1], indent=1), flush=True)
    finally:
        serve.stop()
    # Kept for reading where the fixed cost went: the driver log of the job with the median first step.
    median_job = sorted(jobs, key=lambda job: job["first_step_s"])[len(jobs) // 2]
    driver_log = workdir / "apiary-measured-job.log"
    driver_log.write_text(median_job["driver_log"])
    warm_times = {point["step"]: point["time"] for point in warm["points"]}
    return {
        "jobs": jobs,
        "beside": beside,
        "custom": custom,
        "median_job": median_job,
        "first_step_cold_s": warm_times[1] - warm["submitted"],
        "service_startup_s": startup_s,
        "driver_log": str(driver_log),
    }


# -- report ------------------------------------------------------------------------------------------


def _figures(values: list[float], fmt: str = "{:.1f}") -> str:
    return ", ".join(fmt.format(value) for value in values)


def split_table(jobs: list[dict[str, Any]], custom: list[dict[str, Any]]) -> list[str]:
    """Markdown: the median seconds of each SPLITS row, for the built-in trainer's and the custom
    trainer's jobs, with each job's figure."""

    def cell(runs: list[dict[str, Any]], row: int) -> str:
        values = [value for run in runs if (value := split(run["phases"])[row][1]) is not None]
        if not values:
            return "-"
        return f"{statistics.median(values):.2f} ({_figures(values, '{:.2f}')})"

    lines = [
        "| from submission to the end of step 1 | built-in `gpt`: median s (each job) | custom trainer |",
        "| --- | ---: | ---: |",
    ]
    for row, (what, _, _) in enumerate(SPLITS):
        lines.append(f"| {what} | {cell(jobs, row)} | {cell(custom, row)} |")
    own = [
        run["phases"]["rank 0: step_1_done"] - run["phases"]["rank 0: loop_entered"]
        for run in custom
        if {"rank 0: step_1_done", "rank 0: loop_entered"} <= run["phases"].keys()
    ]
    if own:
        lines.append(
            f"| the custom trainer's own code, entered to the end of its step 1 | - | "
            f"{statistics.median(own):.2f} ({_figures(own, '{:.2f}')}) |"
        )
    total = [job["first_step_s"] for job in jobs]
    custom_total = [run["first_step_s"] for run in custom if run["first_step_s"] is not None]
    lines.append(
        f"| **total** | **{statistics.median(total):.2f}** | "
        + (f"**{statistics.median(custom_total):.2f}** |" if custom_total else "- |")
    )
    return lines


def report(
    args: argparse.Namespace, *, plains: list[dict[str, Any]], apiary: dict[str, Any], command: str
) -> str:
    jobs, beside = apiary["jobs"], apiary["beside"]
    plain_sps = statistics.median(run["samples_per_s"] for run in plains)
    beside_sps = statistics.median(run["samples_per_s"] for run in beside)
    apiary_sps = statistics.median(job["samples_per_s"] for job in jobs)
    first_step = statistics.median(job["first_step_s"] for job in jobs)
    plain_first_step = statistics.median(run["first_step_s"] for run in plains)
    ratio = apiary_sps / plain_sps
    ratio_verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
    fixed_verdict = (
        "met"
        if first_step < GOAL_FIXED_COST_S and first_step <= plain_first_step + GOAL_OVER_PLAIN_S
        else "NOT met"
    )
    return "\n".join(
        [
            f"## Orchestration overhead, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} cores, "
            f"{platform.python_implementation()} {platform.python_version()}, no GPU",
            f"- command: `{command}`",
            f"- workload: {TRAINERS[args.trainer]} d_model={args.d_model} n_layers={args.n_layers} "
            f"n_heads={args.n_heads} "
            f"vocab={args.vocab_size} seq_len={args.seq_len}, "
            f"{args.workers} workers x batch {args.batch_size}, "
            f"{args.steps} steps (steady state = steps {args.warmup_steps + 1}..{args.steps}); "
            f"{len(jobs)} Apiary jobs, medians below",
            "",
            "| | plain DDP, machine to itself | plain DDP beside the idle Apiary cluster | Apiary |",
            "| --- | --- | --- | --- |",
            f"| steady-state samples/s (median) | {plain_sps:.1f} | {beside_sps:.1f} | {apiary_sps:.1f} |",
            f"| each run | {_figures([r['samples_per_s'] for r in plains])} | "
            f"{_figures([r['samples_per_s'] for r in beside])} | "
            f"{_figures([j['samples_per_s'] for j in jobs])} |",
            f"| median step time | {statistics.median(r['median_step_s'] for r in plains) * 1000:.0f} ms | "
            f"{statistics.median(r['median_step_s'] for r in beside) * 1000:.0f} ms | "
            f"{statistics.median(j['median_step_s'] for j in jobs) * 1000:.0f} ms |",
            f"| start to end of step 1 | {statistics.median(r['first_step_s'] for r in plains):.1f} s "
            f"(process start) | | {first_step:.1f} s from submission, running cluster "
            f"(each: {_figures([j['first_step_s'] for j in jobs])}) |",
            f"| CPU work to the end of step 1 (all cores, idle use subtracted) | "
            f"{statistics.median(r['startup_cpu_s'] for r in plains):.1f} CPU-s | | "
            f"{statistics.median(j['startup_cpu_s'] for j in jobs):.1f} CPU-s "
            f"(each: {_figures([j['startup_cpu_s'] for j in jobs])}); / {os.cpu_count()} cores = "
            f"{statistics.median(j['startup_cpu_s'] for j in jobs) / (os.cpu_count() or 1):.1f} s, a floor "
            "under the wall time |",
            "",
            f"- **steady state: Apiary / plain DDP = {ratio:.3f}** (goal >= {GOAL_RATIO}: {ratio_verdict}); "
            f"Apiary / plain DDP beside the idle cluster = {apiary_sps / beside_sps:.3f} (what the job's own "
            f"path costs; the rest is the running cluster's processes sharing the cores).",
            f"- **fixed cost: {first_step:.1f} s** from submission to the end of step 1, against plain "
            f"DDP's {plain_first_step:.1f} s from process start (goal: < {GOAL_FIXED_COST_S:.0f} s and "
            f"<= plain + {GOAL_OVER_PLAIN_S:.0f} s: {fixed_verdict}). Where it goes (each row ends at a "
            "mark of `trainers.startup`):",
            "",
            *split_table(jobs, apiary["custom"]),
            "",
            f"- The warm-up job on the freshly started cluster took "
            f"{apiary['first_step_cold_s']:.1f} s to its first step; "
            f"`apiary serve` itself was healthy after {apiary['service_startup_s']:.1f} s.",
            f"- Apiary data-wait share of step time (steady state): "
            f"{_figures([100 * j['data_wait_share'] for j in jobs])} %.",
            f"- load (1/5/15 min): plain runs after: {'; '.join(r['load_after'] for r in plains)}; "
            f"Apiary jobs after: {'; '.join(j['load_after'] for j in jobs)}.",
            f"- Driver log of the median job: {apiary['driver_log']}.",
            "",
        ]
    )


def write_dataset(uri: str, args: argparse.Namespace, *, num_rows: int, num_shards: int) -> None:
    """The token rows both sides train on, as `num_shards` parquet shards."""
    table = token_table(num_rows=num_rows, seq_len=args.seq_len, vocab_size=args.vocab_size)
    write_shards(table, uri, num_shards=num_shards)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The workload both sides train (`build_spec` reads it); shared with `overhead_breakdown.py`."""
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps of each side")
    parser.add_argument(
        "--trainer", choices=sorted(TRAINERS), default="gpt", help="the model both sides train"
    )
    parser.add_argument("--repeats", type=int, default=3, help="measured Apiary jobs (and plain runs beside)")
    parser.add_argument(
        "--custom-repeats", type=int, default=2, help=f"measured jobs of a custom trainer ({CUSTOM_TRAINER})"
    )
    add_common_args(parser)
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
        write_dataset(dataset_uri, args, num_rows=num_shards * rows_per_shard, num_shards=num_shards)
        spec = build_spec(args, dataset_uri=dataset_uri, max_steps=args.steps, name="overhead")
        warmup_spec = build_spec(
            args, dataset_uri=dataset_uri, max_steps=args.warmup_job_steps, name="warmup"
        )
        print(f"dataset: {num_shards} x {rows_per_shard} rows at {dataset_uri}; {load()}", flush=True)

        def plain() -> dict[str, Any]:
            return run_plain(
                spec, workdir=workdir, samples_per_step=samples_per_step, warmup=args.warmup_steps
            )

        # Plain DDP with the machine to itself before and after the Apiary side: other work on a shared
        # machine drifts, and these bracket it.
        plains = []
        print("plain DDP, machine to itself ...", flush=True)
        plains.append(plain())
        print(json.dumps(plains[-1], indent=1), flush=True)
        apiary = run_apiary(
            spec,
            warmup_spec,
            workdir=workdir,
            samples_per_step=samples_per_step,
            warmup=args.warmup_steps,
            repeats=args.repeats,
            custom_repeats=args.custom_repeats,
            plain_beside=plain,
        )
        print("plain DDP, machine to itself again ...", flush=True)
        plains.append(plain())
        print(json.dumps(plains[-1], indent=1), flush=True)

    print()
    print(report(args, plains=plains, apiary=apiary, command=command))


if __name__ == "__main__":
    main()
