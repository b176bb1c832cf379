"""Policy value: every policy on every trace of the suite (benchmarks/traces/suite.json), in one run.

    nice .venv/bin/python benchmarks/policy_value.py                  # the whole suite (long: ~1 h here)
    nice .venv/bin/python benchmarks/policy_value.py --only itp-c02-d14-fs8 --policies fifo,greedy

The suite (benchmarks/traces/README.md): windows of Microsoft's ITP trace converted by
benchmarks/traces/convert_itp.py, and the generator (`service.scheduling.simulate.generate`) at
several shapes. Each trace names its cluster, its queue limits and its subset: `tune` (the traces the
default configuration was chosen on) or `held-out` (reported, never tuned on).

Each trace is replayed through `service.scheduling.simulate.simulate` (the service's knowledge only:
history estimates, erring pace, persistent placements, preemption costs, queue limits) with:

- `fifo`: one line in submission order, strict head of line;
- `greedy`: one line in submission order, any job that fits starts (first-fit);
- `two-queue`: the live policy (`service.scheduling.policy.decide`);
- `share-first`: `service.scheduling.share_first` (research first within its share, greedy for the
  rest, reclaim at the victim's next checkpoint, best-fit, a 4 h reservation for oversize jobs).

Per trace it prints the table and the goals of issue 27 for share-first against fifo and greedy:
full-scale mean all-queued time <= 1.6x greedy's and fifo's (and <= fifo's / 1.4 where greedy's is);
research p95 wait <= fifo's / 1.5, <= greedy's / 1.2 and <= 12 h; utilization >= 0.98 of greedy's;
lost work <= 0.1% of busy GPU-hours; <= 0.35 preemptions per full-scale job.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import command, machine  # noqa: E402

from service.contract.queues import DEFAULT_QUEUES, QueuesConfig, load  # noqa: E402
from service.scheduling.simulate import (  # noqa: E402
    SimResult,
    TraceJob,
    TraceShape,
    generate,
    parse_node,
    read_trace,
    simulate,
)

TRACES = ROOT / "benchmarks" / "traces"
POLICIES = ("fifo", "greedy", "two-queue", "share-first")
CANDIDATE = "share-first"


def load_trace(entry: dict[str, Any]) -> tuple[list[TraceJob], QueuesConfig]:
    if "generate" in entry:
        spec = dict(entry["generate"])
        shape: dict[str, Any] = {
            key: tuple(tuple(pair) for pair in value) if isinstance(value, list) else value
            for key, value in spec.pop("shape", {}).items()
        }
        nodes = entry["nodes"]
        jobs = generate(spec["count"], seed=spec["seed"], shape=TraceShape(nodes=nodes, **shape))
        return jobs, DEFAULT_QUEUES
    with gzip.open(TRACES / entry["trace"], "rt", newline="") as source:
        jobs = read_trace(source, nodes=entry["nodes"], node=parse_node(entry["node"]))
    return jobs, load(TRACES / entry["queues"])


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def row(name: str, result: SimResult) -> str:
    full, research = result.queues["full-scale"], result.queues["research"]
    lost = result.lost_gpu_s / max(1.0, result.busy_gpu_s)
    cells = [
        name,
        hours(full.queued.mean),
        hours(full.wait.mean),
        hours(research.wait.p50),
        hours(research.wait.p95),
        f"{result.utilization:.3f}",
        f"{full.preemptions_per_job:.3f}",
        f"{100 * lost:.3f}%",
        str(result.unfinished),
    ]
    return "| " + " | ".join(cells) + " |"


def goals(results: dict[str, SimResult]) -> list[tuple[str, bool]]:
    """Issue 27's goals for the candidate against fifo and greedy on one trace."""
    fifo, greedy, cand = results["fifo"], results["greedy"], results[CANDIDATE]

    def fs(result: SimResult) -> float:
        return max(1.0, result.queues["full-scale"].queued.mean)

    def rp95(result: SimResult) -> float:
        return max(1.0, result.queues["research"].wait.p95)

    checks = [
        (
            f"full-scale mean all-queued vs greedy {fs(cand) / fs(greedy):.2f}x (<= 1.6)",
            fs(cand) <= 1.6 * fs(greedy),
        ),
        (
            f"full-scale mean all-queued vs fifo {fs(cand) / fs(fifo):.2f}x (<= 1.6)",
            fs(cand) <= 1.6 * fs(fifo),
        ),
    ]
    if fs(greedy) <= fs(fifo) / 1.4:
        checks.append(
            (
                f"full-scale fifo / share-first {fs(fifo) / fs(cand):.2f}x (>= 1.4: greedy's is)",
                fs(cand) <= fs(fifo) / 1.4,
            )
        )
    lost = cand.lost_gpu_s / max(1.0, cand.busy_gpu_s)
    checks += [
        (
            f"research p95 fifo / share-first {rp95(fifo) / rp95(cand):.2f}x (>= 1.5)",
            rp95(cand) <= rp95(fifo) / 1.5,
        ),
        (
            f"research p95 greedy / share-first {rp95(greedy) / rp95(cand):.2f}x (>= 1.2)",
            rp95(cand) <= rp95(greedy) / 1.2,
        ),
        (f"research p95 {hours(rp95(cand))} (<= 12 h)", rp95(cand) <= 12 * 3600),
        (
            f"utilization vs greedy {cand.utilization / max(1e-9, greedy.utilization):.3f} (>= 0.98)",
            cand.utilization >= 0.98 * greedy.utilization,
        ),
        (f"lost work {100 * lost:.3f}% of busy GPU-hours (<= 0.1%)", lost <= 0.001),
        (
            f"preemptions per full-scale job {cand.queues['full-scale'].preemptions_per_job:.3f} (<= 0.35)",
            cand.queues["full-scale"].preemptions_per_job <= 0.35,
        ),
    ]
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="", help="comma-separated trace names (default: all)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", type=Path, help="also write every result here")
    args = parser.parse_args()
    policies = args.policies.split(",")
    suite = json.loads((TRACES / "suite.json").read_text())["traces"]
    if args.only:
        wanted = set(args.only.split(","))
        suite = [entry for entry in suite if entry["name"] in wanted]
    everything: dict[str, dict[str, Any]] = {}
    held: dict[str, list[bool]] = {}
    for entry in suite:
        jobs, queues = load_trace(entry)
        node = parse_node(entry["node"])
        print(f"\n### {entry['name']} ({entry['subset']})\n", flush=True)
        print(f"{entry['source']}; {len(jobs)} jobs on {entry['nodes']} x {entry['node']}\n")
        results: dict[str, SimResult] = {}
        for policy in policies:
            started = time.perf_counter()
            results[policy] = simulate(jobs, nodes=entry["nodes"], node=node, policy=policy, queues=queues)
            print(f"  {policy}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        print(
            "| policy | full-scale mean all-queued | full-scale mean wait | research p50 | research p95 "
            "| utilization | preemptions / full-scale job | lost / busy GPU-h | unfinished |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for policy, result in results.items():
            print(row(policy, result))
        everything[entry["name"]] = {policy: result.to_json() for policy, result in results.items()}
        if {"fifo", "greedy", CANDIDATE} <= results.keys():
            checks = goals(results)
            held[entry["name"]] = [ok for _, ok in checks]
            print()
            for label, ok in checks:
                print(f"- {label}: {'met' if ok else 'NOT met'}")
    print("\n### Summary\n")
    for subset in ("tune", "held-out"):
        names = [entry["name"] for entry in suite if entry["subset"] == subset and entry["name"] in held]
        met = [name for name in names if all(held[name])]
        print(f"- {subset}: every goal met on {len(met)} of {len(names)} traces ({', '.join(met) or 'none'})")
    print(f"- machine: {machine()}")
    print(f"- command: `{command()}`")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1, allow_nan=False))


if __name__ == "__main__":
    main()
