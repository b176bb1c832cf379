"""Where the steady-state gap to plain DDP goes: one long Apiary job, its neighbours paused or moved.

    .venv/bin/python benchmarks/overhead_breakdown.py                  # 20 s windows, ~13 minutes
    .venv/bin/python benchmarks/overhead_breakdown.py --window-s 30

`benchmarks/overhead.py` measures the gap; this one splits it. Same workload and baseline (plain
`torch.distributed` DDP with the machine to itself, `benchmarks/plain_ddp.py`, run before and after),
then a real `apiary serve` (SQLite, its own local Ray), a warm-up job, and one job long enough for
these windows, in this order:

- `baseline`: nothing paused;
- `job helpers paused`: the job's own processes other than its ranks, SIGSTOPped: its Ray job driver
  and JobSupervisor, Ray Train's controller, synchronization actor, placement-group cleaner and
  dataset manager, Ray Data's stats and autoscaling actors, idle pool workers;
- `cluster paused`: the resident Ray cluster: GCS, raylet, dashboard (and its module processes),
  dashboard and runtime-env agents, log monitor, autoscaler monitor, Ray client server, `ray start`;
- `all paused`: both, and `apiary serve` itself: the ranks run alone, in Ray Train worker processes;
- `isolated`: nothing paused, but the cores split: the ranks on every core but the last, everything
  else (cluster, job helpers, `apiary serve`) on the last one. That emulates a node with a core to
  spare for the orchestrator, as every GPU node has. Its baseline is plain DDP pinned to the ranks'
  cores (run before and after, like the unpinned one), so the ratio is what Apiary's own path costs
  when Ray's processes do not compete with the ranks for cores.

A `baseline` window sits between each of the others. Every paused process gets SIGCONT at the end of
its window, and every moved one its own cores back (also on any error or Ctrl-C). Only descendants
of the benchmark's own `apiary serve` are ever touched, never another Ray on the machine. This pauses
Ray's processes on purpose: it is a measurement, not something to run beside real work. A window's
rate is rank 0's samples/s between its first and last step (from `GET /jobs/{id}/metrics`), its first
`--settle-s` seconds left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from overhead import (  # noqa: E402
    Serve,
    add_common_args,
    build_spec,
    data_wait_share,
    load,
    run_job,
    run_plain,
    steady_state,
    write_dataset,
)

from api.client import ApiaryClient  # noqa: E402
from service.contract.states import TERMINAL_STATES  # noqa: E402

# Process titles (Ray sets `ray::<Class>` on its worker processes) that are the resident cluster's.
CLUSTER_RAY_TITLES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
RANK_TITLE = "ray::RayTrainWorker"
DRIVER_MARKER = "-m trainers.launch"
PLAN = ("baseline", "job", "baseline", "cluster", "baseline", "all", "baseline", "isolated", "baseline")
# What each window pauses: the job's helpers, the resident cluster, or both and the API ('api');
# `isolated` pauses nothing but moves processes between cores (see `isolated`).
PAUSES: dict[str, set[str]] = {
    "baseline": set(),
    "job": {"job"},
    "cluster": {"cluster"},
    "all": {"job", "cluster", "api"},
}
LABELS = {
    "baseline": "baseline (nothing paused)",
    "job": "job helpers paused",
    "cluster": "cluster paused",
    "all": "all paused (ranks alone)",
    "isolated": "isolated (ranks on their own cores)",
}


@dataclass(frozen=True)
class Proc:
    pid: int
    title: str


def descendants(root: int) -> list[Proc]:
    """Every live process under `root` (not `root` itself), from /proc."""
    children: dict[int, list[int]] = {}
    titles: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
            titles[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    found: list[Proc] = []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(Proc(pid, titles.get(pid, "").strip()))
        stack.extend(children.get(pid, []))
    return found


def classify(proc: Proc) -> str:
    """'rank', 'job' (this job's other processes) or 'cluster' (the resident Ray)."""
    if proc.title.startswith(RANK_TITLE):
        return "rank"
    if DRIVER_MARKER in proc.title or (
        proc.title.startswith("ray::") and not proc.title.startswith(CLUSTER_RAY_TITLES)
    ):
        return "job"
    return "cluster"


@contextlib.contextmanager
def paused(serve_pid: int, kinds: set[str]) -> Iterator[list[Proc]]:
    """SIGSTOP the serve's descendants of these kinds (and the serve itself for 'api'); SIGCONT after."""
    targets = [proc for proc in descendants(serve_pid) if classify(proc) in kinds]
    if "api" in kinds:
        targets.append(Proc(serve_pid, "apiary serve"))
    stopped: list[Proc] = []
    try:
        for proc in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGSTOP)
                stopped.append(proc)
        yield stopped
    finally:
        for proc in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)


def core_split() -> tuple[set[int], set[int]]:
    """(the ranks' cores, everyone else's) for `isolated`: all this process may use but the last, the last."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError(f"the isolated window needs at least 2 cores; this process may use {cores}")
    return set(cores[:-1]), {cores[-1]}


def _set_cores(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` onto `cores` (threads started later inherit it from their creator)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cores)


@contextlib.contextmanager
def isolated(serve_pid: int, *, rank_cores: set[int], other_cores: set[int]) -> Iterator[list[Proc]]:
    """The serve's ranks onto `rank_cores`, its other processes and itself onto `other_cores`; after,
    every thread of each moved process (also those started meanwhile) gets the process's cores back."""
    targets = [*descendants(serve_pid), Proc(serve_pid, "apiary serve")]
    moved: list[tuple[Proc, set[int]]] = []
    try:
        for proc in targets:
            try:
                before = os.sched_getaffinity(proc.pid)
            except OSError:
                continue  # gone meanwhile
            moved.append((proc, before))
            _set_cores(proc.pid, rank_cores if classify(proc) == "rank" else other_cores)
        yield [proc for proc, _ in moved if classify(proc) != "rank"]
    finally:
        for proc, before in moved:
            _set_cores(proc.pid, before)


def summarize_titles(procs: list[Proc]) -> str:
    """'ray::IDLE x5, gcs_server, ...': what a window paused, by process title (Ray's, or the program)."""
    names: dict[str, int] = {}
    for proc in procs:
        words = proc.title.split()
        name = words[0] if words and words[0].startswith("ray::") else Path(words[0] if words else "?").name
        for marker in (
            "gcs_server",
            "raylet",
            "dashboard",
            "log_monitor",
            "monitor.py",
            "client.server",
            "ray start",
            "multiprocessing",
        ):
            if marker in proc.title:
                name = marker
                break
        if name.startswith("python") and len(words) > 1:
            name = Path(next((w for w in words[1:] if not w.startswith("-")), words[1])).name
        if proc.title.startswith("ray-dashboard-"):
            name = "dashboard module"
        elif DRIVER_MARKER in proc.title:
            name = "job driver (trainers.launch)"
        names[name] = names.get(name, 0) + 1
    return ", ".join(f"{name} x{count}" if count > 1 else name for name, count in sorted(names.items()))


def window_rate(
    points: list[dict[str, Any]], *, start: float, end: float, samples_per_step: int
) -> dict[str, Any]:
    inside = {p["step"]: p for p in points if start <= p["time"] <= end}
    if len(inside) < 2:
        raise RuntimeError(f"no steps between {start:.0f} and {end:.0f}: the job ended early or stalled")
    first = min(inside)
    return {
        "samples_per_s": steady_state(
            {step: p["time"] for step, p in inside.items()}, warmup=first, samples_per_step=samples_per_step
        ),
        "data_wait_share": data_wait_share([p["values"] for step, p in inside.items() if step > first]),
    }


def wait_for_step(client: ApiaryClient, job_id: int, *, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.step >= step for p in client.metrics(job_id, rank=0)):
            return
        job = client.get(job_id)
        if job.state in TERMINAL_STATES:
            raise RuntimeError(f"job {job_id} ended {job.state} before step {step}: {job.message}")
        time.sleep(2)
    raise RuntimeError(f"job {job_id} did not reach step {step} in {timeout_s:.0f} s")


def run_windows(
    args: argparse.Namespace,
    *,
    workdir: Path,
    dataset_uri: str,
    max_steps: int,
    samples_per_step: int,
    cores: tuple[set[int], set[int]],
) -> dict[str, Any]:
    """`cores`: (the ranks', everyone else's) for the isolated window, from `core_split`."""
    rank_cores, other_cores = cores
    serve = Serve(workdir / "apiary", data_root=workdir)
    windows: list[dict[str, Any]] = []
    try:
        serve.wait_healthy()
        with ApiaryClient(serve.url) as client:
            run_job(
                client,
                build_spec(args, dataset_uri=dataset_uri, max_steps=args.warmup_job_steps, name="warmup"),
                timeout_s=900,
            )
            spec = build_spec(args, dataset_uri=dataset_uri, max_steps=max_steps, name="breakdown")
            job = client.submit(spec)
            wait_for_step(client, job.id, step=args.warmup_steps)
            # Per window, the processes it paused or moved off the ranks' cores.
            touched: dict[str, list[Proc]] = {}
            for phase in PLAN:
                print(f"window: {LABELS[phase]} ...", flush=True)
                arrangement = (
                    isolated(serve.process.pid, rank_cores=rank_cores, other_cores=other_cores)
                    if phase == "isolated"
                    else paused(serve.process.pid, PAUSES[phase])
                )
                with arrangement as procs:
                    started = time.time()
                    time.sleep(args.window_s)
                    ended = time.time()
                if procs:
                    touched[phase] = procs
                windows.append({"phase": phase, "start": started + args.settle_s, "end": ended})
            done = client.wait(job.id, timeout_s=1800, poll_s=5)
            if done.state != "succeeded":
                raise RuntimeError(f"job {job.id} ended {done.state}: {done.message}")
            points = [point.model_dump(mode="json") for point in client.metrics(job.id, rank=0)]
    finally:
        serve.stop()
    for window in windows:
        window.update(
            window_rate(points, start=window["start"], end=window["end"], samples_per_step=samples_per_step)
        )
    return {"windows": windows, "touched": touched}


def _cores(cores: set[int]) -> str:
    return ",".join(map(str, sorted(cores)))


def report(
    args: argparse.Namespace,
    *,
    plains: list[dict[str, Any]],
    pinned_plains: list[dict[str, Any]],
    result: dict[str, Any],
    cores: tuple[set[int], set[int]],
    command: str,
) -> str:
    """`plains` ran with the machine to themselves, `pinned_plains` on the ranks' cores of `isolated`."""
    plain_sps = statistics.median(run["samples_per_s"] for run in plains)
    pinned_sps = statistics.median(run["samples_per_s"] for run in pinned_plains)
    rank_cores, other_cores = cores

    def versus(phase: str) -> float:
        return pinned_sps if phase == "isolated" else plain_sps

    windows = result["windows"]
    rows = [
        f"| {i + 1} | {LABELS[w['phase']]} | {len(result['touched'].get(w['phase'], []))} | "
        f"{w['samples_per_s']:.1f} | {w['samples_per_s'] / versus(w['phase']):.3f}"
        f"{' *' if w['phase'] == 'isolated' else ''} | {100 * w['data_wait_share']:.1f} % |"
        for i, w in enumerate(windows)
    ]
    by_phase: dict[str, list[float]] = {}
    for window in windows:
        by_phase.setdefault(window["phase"], []).append(window["samples_per_s"])
    baseline = statistics.mean(by_phase["baseline"])
    summary = ", ".join(
        f"{LABELS[phase]} {statistics.mean(rates) / versus(phase):.3f}" for phase, rates in by_phase.items()
    )
    return "\n".join(
        [
            f"## Orchestration overhead breakdown, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"- machine: {os.uname().nodename}, {os.uname().machine}, {os.cpu_count()} cores, no GPU",
            f"- command: `{command}`",
            f"- workload: gpt d_model={args.d_model} n_layers={args.n_layers} n_heads={args.n_heads} "
            f"vocab={args.vocab_size} seq_len={args.seq_len}, "
            f"{args.workers} workers x batch {args.batch_size}; "
            f"one Apiary job, {args.window_s:.0f} s windows (first {args.settle_s:.0f} s of each left out)",
            f"- plain DDP, machine to itself (before, after): "
            f"{', '.join(format(run['samples_per_s'], '.1f') for run in plains)} samples/s; "
            f"median {plain_sps:.1f}",
            f"- plain DDP on core(s) {_cores(rank_cores)} only (before, after): "
            f"{', '.join(format(run['samples_per_s'], '.1f') for run in pinned_plains)} samples/s; "
            f"median {pinned_sps:.1f}",
            "",
            "| window | what is paused or moved | processes | Apiary samples/s | / plain DDP | data wait |",
            "| ---: | --- | ---: | ---: | ---: | ---: |",
            *rows,
            "",
            f"\\* against plain DDP on the same core(s) {_cores(rank_cores)}; in that window the ranks ran "
            f"on core(s) {_cores(rank_cores)}, every other process on core {_cores(other_cores)}.",
            "",
            f"- mean / plain DDP: {summary}; the baseline windows' mean is {baseline:.1f} samples/s.",
            *[f"- {LABELS[phase]}: {summarize_titles(procs)}" for phase, procs in result["touched"].items()],
            f"- load after: {load()}",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--window-s", type=float, default=20.0, help="length of each window")
    parser.add_argument("--settle-s", type=float, default=2.0, help="start of each window left out")
    parser.add_argument(
        "--plain-steps",
        type=int,
        default=300,
        help="steps of each plain DDP run on the whole machine (half as many on the ranks' cores)",
    )
    add_common_args(parser)
    args = parser.parse_args()
    command = shlex.join(["python", "benchmarks/overhead_breakdown.py", *sys.argv[1:]])
    samples_per_step = args.workers * args.batch_size

    with tempfile.TemporaryDirectory(prefix="apiary-breakdown-") as temporary:
        workdir = (args.workdir or Path(temporary)).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        # Sized from plain DDP's rate so that the job outlasts every window (Apiary is not faster),
        # and one epoch covers the job: no window holds an epoch boundary.
        probe_uri = (workdir / "probe").as_uri()
        write_dataset(
            probe_uri, args, num_rows=4 * -(-args.plain_steps * samples_per_step // 4), num_shards=4
        )
        plain_spec = build_spec(args, dataset_uri=probe_uri, max_steps=args.plain_steps, name="plain")

        def plain(cpus: set[int] | None = None) -> dict[str, Any]:
            where = f"core(s) {_cores(cpus)}" if cpus else "the machine to itself"
            print(f"plain DDP on {where} ...", flush=True)
            spec = plain_spec if cpus is None else {**plain_spec, "max_steps": args.plain_steps // 2}
            result = run_plain(
                spec,
                workdir=workdir,
                samples_per_step=samples_per_step,
                warmup=args.warmup_steps,
                cpus=cpus,
            )
            print(json.dumps(result), flush=True)
            return result

        cores = core_split()
        rank_cores = cores[0]
        plains, pinned_plains = [plain()], [plain(rank_cores)]
        seconds = len(PLAN) * args.window_s + 20
        max_steps = int(plains[0]["samples_per_s"] * seconds * 1.1 / samples_per_step) + args.warmup_steps
        dataset_uri = (workdir / "tokens").as_uri()
        write_dataset(dataset_uri, args, num_rows=4 * -(-max_steps * samples_per_step // 4), num_shards=4)
        result = run_windows(
            args,
            workdir=workdir,
            dataset_uri=dataset_uri,
            max_steps=max_steps,
            samples_per_step=samples_per_step,
            cores=cores,
        )
        pinned_plains.append(plain(rank_cores))
        plains.append(plain())

    print()
    print(
        report(args, plains=plains, pinned_plains=pinned_plains, result=result, cores=cores, command=command)
    )


if __name__ == "__main__":
    main()
