"""Export cost: the steady state of a job while the service exports it to TensorBoard and MLflow,
against the same job without the export, in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/export_cost.py              # 4 rounds, ~10 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/export_cost.py --smoke      # 1 round of a few steps

The export is the service's (service.tracking): the replica that holds the scheduler lease reads rank
0's stored points every `export_interval_s` (2 s) and writes them as TensorBoard event files beside the
job's checkpoints and to the MLflow tracking server; a trainer never waits for it. What it can cost a
job is CPU taken from the cores the ranks train on: here one 2-core machine holds the ranks, Ray, the
service and the MLflow server.

One run: a local Ray (started here as `apiary serve` starts its own: `service.cluster.LocalRay`), a
real MLflow tracking server (SQLite backend, `tests/support/mlflow_server.py`, from `.venv-mlflow`),
and two configurations of `apiary serve` on that Ray, each with its own data dir and SQLite database:

- `on`: TensorBoard event files (the default) and `APIARY_MLFLOW_TRACKING_URI` set;
- `off`: `APIARY_TENSORBOARD=false`, no MLflow.

One `apiary serve` runs at a time, started for its job and stopped after it (the `on` one once the
exporter has finished the job's MLflow run: the export is checked complete). Each of `--rounds` rounds
runs the same `gpt` job (2 workers x 1 CPU) under both, in alternating order (off-on, on-off, ...), so
that a drift of the machine's load falls on both sides; a short warm-up job runs first. The MLflow
server runs throughout (idle for `off`).

Figures, per job, over the steady state (steps after `--warmup-steps`):
- step time: the median of `step_time_s`, which every rank records for every step (the service's stored
  metrics, read back over `GET /jobs/{id}/metrics`);
- wall time per step: from the end of rank 0's step `--warmup-steps` to the end of its last step, over
  the steps between (everything a step waits for, the telemetry posts included);
- CPU, in % of one core over the same window: the `apiary serve` process (the telemetry's ingest, the
  scheduler, and the export when on), the MLflow server's processes, and the whole machine.
Then the median of each side, the ratio on / off (goal: within noise, <= 1.02), each round's own ratio,
and the noise: the spread (max / min) of the jobs of one side. Ends with a markdown section for
`benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import command, machine  # noqa: E402
from overhead import CpuClock as MachineClock  # noqa: E402
from overhead_breakdown import descendants  # noqa: E402

from api.client import ApiaryClient  # noqa: E402
from api.demo import token_table, write_shards  # noqa: E402
from service.cluster import LocalRay  # noqa: E402
from service.contract.handoff import job_prefix  # noqa: E402
from service.contract.storage import resolve_uri  # noqa: E402
from service.tracking import TENSORBOARD_DIR  # noqa: E402
from tests.e2e.conftest import Served, start_serve, stop_serve  # noqa: E402
from tests.support.mlflow_server import MLFLOW, mlflow_server  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402

GOAL_RATIO = 1.02
SIDES = ("off", "on")
JOB_NAME = "export-cost"
SEQ_LEN = 129
VOCAB = 256


def side_env(side: str, *, mlflow_url: str) -> dict[str, str]:
    """What sets the export on or off: the service's settings (service.settings), nothing else."""
    if side == "on":
        return {"APIARY_TENSORBOARD": "true", "APIARY_MLFLOW_TRACKING_URI": mlflow_url}
    if side == "off":
        return {"APIARY_TENSORBOARD": "false", "APIARY_MLFLOW_TRACKING_URI": ""}
    raise ValueError(f"side must be one of {SIDES}, not {side!r}")


def build_spec(args: argparse.Namespace, *, dataset_uri: str, max_steps: int) -> dict[str, Any]:
    return {
        "name": JOB_NAME,
        "trainer": "gpt",
        "num_workers": 2,
        "resources_per_worker": {"CPU": 1},
        "dataset": {"uri": dataset_uri},
        "max_steps": max_steps,
        "batch_size": args.batch_size,
        "seed": 0,
        "config": {
            "vocab_size": VOCAB,
            "d_model": args.d_model,
            "n_layers": args.n_layers,
            "n_heads": 4,
            "lr": 1e-3,
            "warmup_steps": 10,
        },
    }


# -- CPU of processes ------------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its reaped children; 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def mlflow_pids() -> list[int]:
    """The MLflow server's processes: the child of this process that runs `mlflow`, and its own."""
    for proc in descendants(os.getpid()):
        if str(MLFLOW) in proc.title:
            return [proc.pid, *(child.pid for child in descendants(proc.pid))]
    raise RuntimeError("no MLflow server process found under this one")


@dataclass
class ProcessClock:
    """CPU seconds of named process groups and of the machine, sampled in a thread, so that a window
    known only afterwards (the steady state, from the job's own timestamps) can be read back."""

    groups: Mapping[str, Callable[[], Sequence[int]]]
    interval_s: float = 0.5
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        figures = {name: sum(cpu_s(pid) for pid in pids()) for name, pids in self.groups.items()}
        self.samples.append((time.time(), {**figures, "machine": MachineClock.busy_s()}))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    @contextmanager
    def running(self) -> Iterator[ProcessClock]:
        self.sample()
        thread = threading.Thread(target=self._run, name="cpu-clock", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            self.sample()

    def percent(self, start: float, end: float) -> dict[str, float]:
        """% of one core each group used between `start` and `end` (the nearest samples)."""
        first = min(self.samples, key=lambda sample: abs(sample[0] - start))
        last = min(self.samples, key=lambda sample: abs(sample[0] - end))
        seconds = last[0] - first[0]
        if seconds <= 0:
            raise ValueError("the window is shorter than the CPU clock's sampling interval")
        return {name: 100 * (last[1][name] - first[1][name]) / seconds for name in last[1]}


# -- one job -----------------------------------------------------------------------------------------


def steady_figures(points: Sequence[Mapping[str, Any]], *, warmup: int) -> dict[str, float]:
    """A job's steady state from its stored points (`MetricPublic` as JSON: step, rank, time, values)."""
    steady = [p for p in points if p["step"] > warmup and "step_time_s" in p["values"]]
    rank0 = {p["step"]: p["time"] for p in points if p["rank"] == 0 and "step_time_s" in p["values"]}
    last = max(rank0)
    if warmup not in rank0 or last <= warmup or not steady:
        raise ValueError(f"no steady state after step {warmup} (the job's last step is {last})")
    return {
        "step_time_s": statistics.median(p["values"]["step_time_s"] for p in steady),
        "wall_per_step_s": (rank0[last] - rank0[warmup]) / (last - warmup),
        "start": rank0[warmup],
        "end": rank0[last],
        "steps": float(last),
    }


def mlflow_export(url: str, job_id: int) -> dict[str, Any] | None:
    """The job's MLflow run as the exporter left it: finished?, and how many `train/loss` points."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    experiment = client.get_experiment_by_name(JOB_NAME)
    if experiment is None:
        return None
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`apiary.job_id` = '{job_id}'", max_results=1
    )
    if not runs:
        return None
    run = runs[0]
    return {
        "finished": run.data.tags.get("apiary.finished") == "true",
        "loss_points": len(client.get_metric_history(run.info.run_id, "train/loss")),
    }


def check_exported(served: Served, *, mlflow_url: str, job_id: int, steps: int) -> dict[str, Any]:
    """Wait until the exporter has finished the job's MLflow run; every step of rank 0 must be there,
    and TensorBoard event files beside its checkpoints."""
    run = wait_until(
        lambda: (found := mlflow_export(mlflow_url, job_id)) is not None and found["finished"] and found,
        timeout_s=120,
        interval_s=1,
        what=f"job {job_id}'s MLflow run finished by the exporter",
    )
    if run["loss_points"] != steps:
        raise RuntimeError(f"MLflow has {run['loss_points']} train/loss points of job {job_id}, not {steps}")
    logdir, _ = resolve_uri(job_prefix(str(served.data_dir / "checkpoints"), job_id) + TENSORBOARD_DIR)
    event_files = list(Path(logdir).glob("events.out.tfevents.*"))
    if not event_files:
        raise RuntimeError(f"no TensorBoard event files in {logdir}")
    return {"mlflow_loss_points": run["loss_points"], "event_files": len(event_files)}


@dataclass
class Bench:
    args: argparse.Namespace
    workdir: Path
    ray: LocalRay
    mlflow_url: str
    spec: dict[str, Any]
    warmup_spec: dict[str, Any] | None
    mlflow_pids: list[int] = field(default_factory=mlflow_pids)  # its workers are up once it answers

    def serve(self, side: str) -> Served:
        data_dir = self.workdir / f"serve-{side}"
        database_url = (
            self.args.database_url.replace("{side}", side)
            if self.args.database_url
            else f"sqlite:///{data_dir / 'apiary.db'}"
        )
        env = {
            **side_env(side, mlflow_url=self.mlflow_url),
            "APIARY_RAY_ADDRESS": self.ray.dashboard_url,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.ray.auth_token_path),
            "APIARY_DATA_ROOTS": str(self.workdir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        return start_serve(
            data_dir=data_dir,
            database_url=database_url,
            log=self.workdir / f"serve-{side}.log",
            env=env,
            timeout_s=180,
        )

    def run(self, side: str) -> dict[str, Any]:
        """One `apiary serve` of this side, the job (after the warm-up, the first time), then stopped."""
        started = time.monotonic()
        served = self.serve(side)
        startup_s = time.monotonic() - started
        try:
            with ApiaryClient(served.url) as client:
                if self.warmup_spec is not None:
                    warm = client.wait(client.submit(self.warmup_spec).id, timeout_s=900, poll_s=2)
                    if warm.state != "succeeded":
                        raise RuntimeError(f"the warm-up job ended {warm.state}: {warm.message}")
                    self.warmup_spec = None
                clock = ProcessClock(
                    {"serve": lambda: [served.process.pid], "mlflow": lambda: self.mlflow_pids}
                )
                with clock.running():
                    job = client.submit(self.spec)
                    # Poll rarely: the figures come from the job's own timestamps.
                    job = client.wait(job.id, timeout_s=1800, poll_s=5)
                if job.state != "succeeded":
                    raise RuntimeError(f"{side}: job {job.id} ended {job.state}: {job.message}")
                points = [p.model_dump(mode="json") for p in client.metrics(job.id, limit=100_000)]
            figures = steady_figures(points, warmup=self.args.warmup_steps)
            cpu = clock.percent(figures["start"], figures["end"])
            exported = (
                check_exported(
                    served, mlflow_url=self.mlflow_url, job_id=job.id, steps=self.spec["max_steps"]
                )
                if side == "on"
                else {}
            )
        finally:
            stop_serve(served)
        return {
            "side": side,
            "job": job.id,
            **figures,
            "serve_cpu_percent": cpu["serve"],
            "mlflow_cpu_percent": cpu["mlflow"],
            "machine_cpu_percent": cpu["machine"],
            "serve_startup_s": startup_s,
            "load": os.getloadavg()[0],
            **exported,
        }


# -- report ------------------------------------------------------------------------------------------


def summarize(jobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each side's medians, the ratios on / off, each round's own, and each side's spread."""
    by_side = {side: [job for job in jobs if job["side"] == side] for side in SIDES}
    if not all(by_side.values()):
        raise ValueError("both sides need at least one job")
    medians = {
        side: {
            key: statistics.median(job[key] for job in runs)
            for key in ("step_time_s", "wall_per_step_s", "serve_cpu_percent", "mlflow_cpu_percent")
        }
        for side, runs in by_side.items()
    }
    rounds = [
        on["step_time_s"] / off["step_time_s"] for off, on in zip(by_side["off"], by_side["on"], strict=False)
    ]
    return {
        "medians": medians,
        "step_ratio": medians["on"]["step_time_s"] / medians["off"]["step_time_s"],
        "wall_ratio": medians["on"]["wall_per_step_s"] / medians["off"]["wall_per_step_s"],
        "round_ratios": rounds,
        "paired_ratio": statistics.median(rounds),
        "spread": {
            side: max(job["step_time_s"] for job in runs) / min(job["step_time_s"] for job in runs)
            for side, runs in by_side.items()
        },
    }


def verdict(summary: Mapping[str, Any]) -> str:
    """Judged on the median of the rounds' own ratios: a round's two jobs ran next to each other, so a
    drift of the machine's load cancels in it, not in the ratio of the medians. Within the noise when
    the rounds disagree on which side is faster."""
    ratio, rounds = summary["paired_ratio"], summary["round_ratios"]
    within = "within" if min(rounds) <= 1 <= max(rounds) else "outside"
    met = "met" if ratio <= GOAL_RATIO else "NOT met"
    return (
        f"step time on / off = {ratio:.3f}, the median of the rounds' ratios ({within} the noise: "
        f"{min(rounds):.3f} to {max(rounds):.3f}); goal <= {GOAL_RATIO}: {met}"
    )


def report(args: argparse.Namespace, jobs: Sequence[Mapping[str, Any]], *, started: str) -> str:
    summary = summarize(jobs)
    medians = summary["medians"]

    def each(side: str, key: str, fmt: str, scale: float = 1) -> str:
        return ", ".join(fmt.format(job[key] * scale) for job in jobs if job["side"] == side)

    rows = [
        ("median step time (ms)", "step_time_s", 1000, "{:.1f}"),
        ("wall time per step (ms)", "wall_per_step_s", 1000, "{:.1f}"),
        ("`apiary serve` CPU (% of a core)", "serve_cpu_percent", 1, "{:.1f}"),
        ("MLflow server CPU (% of a core)", "mlflow_cpu_percent", 1, "{:.1f}"),
    ]
    table = [
        "| steady state, median of the jobs (each job) | off | on | on / off |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, key, scale, fmt in rows:
        off, on = medians["off"][key], medians["on"][key]
        ratio = f"{on / off:.3f}" if off else "-"
        table.append(
            f"| {label} | {fmt.format(off * scale)} ({each('off', key, fmt, scale)}) | "
            f"{fmt.format(on * scale)} ({each('on', key, fmt, scale)}) | {ratio} |"
        )
    exported = [job for job in jobs if job["side"] == "on"]
    extra_serve = medians["on"]["serve_cpu_percent"] - medians["off"]["serve_cpu_percent"]
    extra_mlflow = medians["on"]["mlflow_cpu_percent"] - medians["off"]["mlflow_cpu_percent"]
    cores = os.cpu_count() or 1
    rounds = ", ".join(f"{ratio:.3f}" for ratio in summary["round_ratios"])
    loads = ", ".join(f"{job['side']} {job['load']:.1f}" for job in jobs)
    return "\n".join(
        [
            f"## Export cost, {started} UTC",
            "",
            f"- machine: {machine()}",
            f"- command: `{command()}`",
            f"- workload: `gpt` d_model={args.d_model} n_layers={args.n_layers}, 2 workers x batch "
            f"{args.batch_size}, {args.steps} steps "
            f"(steady state: steps {args.warmup_steps + 1}..{args.steps}); "
            f"{args.rounds} round(s) in the order off-on, on-off, ...",
            f"- load (1 min) at each job's end: {loads}",
            "",
            *table,
            "",
            f"- **{verdict(summary)}**. Each round's: {rounds}; "
            f"the ratio of the medians: {summary['step_ratio']:.3f} (wall time per step "
            f"{summary['wall_ratio']:.3f}); the jobs of one side spread up to "
            f"{max(summary['spread'].values()):.3f}x.",
            f"- what the export itself takes (on - off, % of a core): `apiary serve` {extra_serve:+.1f}, the "
            f"MLflow server {extra_mlflow:+.1f}; of the {cores} cores the ranks fill, "
            f"{(extra_serve + extra_mlflow) / cores:.1f}% (what it would cost a step if all of it came out "
            "of the ranks' time).",
            f"- exported (checked after each `on` job): {exported[0]['mlflow_loss_points']} `train/loss` "
            f"points in MLflow per job, {', '.join(str(job['event_files']) for job in exported)} TensorBoard "
            "event files.",
            f"- whole machine CPU (% of a core; {os.cpu_count()} cores = {100 * (os.cpu_count() or 1)}): "
            f"off {each('off', 'machine_cpu_percent', '{:.0f}')}; "
            f"on {each('on', 'machine_cpu_percent', '{:.0f}')}.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4, help="jobs of each side, in alternating order")
    parser.add_argument("--steps", type=int, default=600, help="steps of each job")
    parser.add_argument("--warmup-steps", type=int, default=50, help="steps left out of the steady state")
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument(
        "--database-url",
        default=None,
        help="each side's database ('{side}' is replaced by on or off); default: SQLite in its data dir",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed")
    parser.add_argument("--smoke", action="store_true", help="1 round of 30 steps: the benchmark still works")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.warmup_steps = 1, 30, 10
    if not MLFLOW.exists():
        parser.error(f"no MLflow server at {MLFLOW}: make .venv-mlflow as .ci/run does")
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    print(f"start: {machine()}", flush=True)

    with tempfile.TemporaryDirectory(prefix="apiary-export-cost-") as temporary:
        workdir = (args.workdir or Path(temporary)).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        # One epoch covers the job: no side pays an epoch boundary the other does not.
        rows = -(-args.steps * 2 * args.batch_size // 4) * 4
        dataset_uri = (workdir / "tokens").as_uri()
        write_shards(token_table(num_rows=rows, seq_len=SEQ_LEN, vocab_size=VOCAB), dataset_uri, num_shards=4)
        ray = LocalRay.start_or_reuse(data_dir=workdir / "ray", num_cpus=8)
        jobs: list[dict[str, Any]] = []
        try:
            with mlflow_server(workdir / "mlflow") as mlflow_url:
                bench = Bench(
                    args=args,
                    workdir=workdir,
                    ray=ray,
                    mlflow_url=mlflow_url,
                    spec=build_spec(args, dataset_uri=dataset_uri, max_steps=args.steps),
                    warmup_spec=build_spec(args, dataset_uri=dataset_uri, max_steps=5),
                )
                for round_ in range(args.rounds):
                    for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                        print(f"round {round_ + 1}/{args.rounds}: export {side} ...", flush=True)
                        jobs.append(bench.run(side))
                        print(
                            {k: round(v, 4) if isinstance(v, float) else v for k, v in jobs[-1].items()},
                            flush=True,
                        )
        finally:
            ray.stop()
    print()
    print(report(args, jobs, started=started))


if __name__ == "__main__":
    main()
