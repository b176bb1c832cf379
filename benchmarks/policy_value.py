"""Policy value: the two-queue policy against one shared line (fifo, greedy) on one generated trace.

    .venv/bin/python benchmarks/policy_value.py            # 10,000 jobs, ~2-3 minutes here
    .venv/bin/python benchmarks/policy_value.py --jobs 2000 --seed 3

One run: `service.scheduling.simulate.generate` writes a trace (its default shape: most jobs small and short,
a few large and long ones that hold most GPU-hours, some larger than the full-scale share, bursty
daily arrivals, ~90% offered load) for 8 nodes x 8 GPUs, and `service.scheduling.simulate.simulate` replays it
through each policy, in simulated time:

- `fifo`: one line in submission order, strict head of line;
- `greedy`: one line in submission order, any job that fits starts (first-fit);
- `two-queue`: `service.scheduling.policy.decide` with the default queues (research 0.3 / full-scale 0.7);
- the two-queue policy with each protection switched off in turn (`service.scheduling.policy.Rules`):
  jobs larger than their queue's share become preemption victims; no reservations for heads; and
  preemption ignores minimum runtimes and checkpoint age (youngest first).

Wait = first start - submission. Goals (two-queue against the baselines): full-scale mean wait 5x
lower than fifo's and 1.5x lower than greedy's; research p95 wait 5x lower than fifo's and no worse
than greedy's; utilization at least 0.95 of greedy's; every job finishes.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.scheduling.policy import RULES, Rules  # noqa: E402
from service.scheduling.simulate import SimResult, generate, simulate  # noqa: E402

NODE = {"CPU": 32.0, "GPU": 8.0}


@dataclass(frozen=True)
class Variant:
    name: str
    policy: str
    rules: Rules = RULES


VARIANTS = (
    Variant("fifo", "fifo"),
    Variant("greedy", "greedy"),
    Variant("two-queue", "two-queue"),
    Variant(
        "two-queue, larger-than-share jobs preemptible", "two-queue", Rules(protect_larger_than_share=False)
    ),
    Variant("two-queue, no reservations", "two-queue", Rules(reservations=False)),
    Variant(
        "two-queue, no minimum runtime, youngest victims first",
        "two-queue",
        Rules(respect_runtime_and_checkpoints=False),
    ),
)


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=8)
    args = parser.parse_args()

    jobs = generate(args.jobs, seed=args.seed)
    print(f"trace: {len(jobs)} jobs, seed {args.seed}, {args.nodes} nodes x {NODE}", flush=True)
    results: dict[str, SimResult] = {}
    for variant in VARIANTS:
        started = time.perf_counter()
        results[variant.name] = simulate(
            jobs, nodes=args.nodes, node=NODE, policy=variant.policy, rules=variant.rules
        )
        print(f"  {variant.name}: {time.perf_counter() - started:.0f} s", flush=True)

    print()
    print(
        "| policy | full-scale wait mean | full-scale p95 | research wait mean | research p95 | utilization "
        "| preemptions | GPU-hours lost | unfinished |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, result in results.items():
        full, research = result.queues["full-scale"].wait, result.queues["research"].wait
        cells = [
            name,
            *(hours(value) for value in (full.mean, full.p95, research.mean, research.p95)),
            f"{result.utilization:.3f}",
            str(result.preemptions),
            f"{result.lost_gpu_hours:.0f}",
            str(result.unfinished),
        ]
        print("| " + " | ".join(cells) + " |")

    fifo, greedy, two = results["fifo"], results["greedy"], results["two-queue"]
    checks = [
        (
            "full-scale mean wait, fifo / two-queue",
            fifo.queues["full-scale"].wait.mean / two.queues["full-scale"].wait.mean,
            5.0,
        ),
        (
            "full-scale mean wait, greedy / two-queue",
            greedy.queues["full-scale"].wait.mean / two.queues["full-scale"].wait.mean,
            1.5,
        ),
        (
            "research p95 wait, fifo / two-queue",
            fifo.queues["research"].wait.p95 / max(1.0, two.queues["research"].wait.p95),
            5.0,
        ),
        (
            "research p95 wait, greedy / two-queue",
            greedy.queues["research"].wait.p95 / max(1.0, two.queues["research"].wait.p95),
            1.0,
        ),
        ("utilization, two-queue / greedy", two.utilization / greedy.utilization, 0.95),
    ]
    print()
    for label, value, goal in checks:
        print(f"- {label}: **{value:.2f}x** (goal >= {goal:g}: {'met' if value >= goal else 'NOT met'})")
    finished = all(result.unfinished == 0 for result in results.values())
    print(f"- every job finished under every policy: {'yes' if finished else 'NO'}")
    print(f"- machine: {platform.node()}, {platform.machine()}, Python {platform.python_version()}")
    print(f"- command: `{' '.join(['python', 'benchmarks/policy_value.py', *sys.argv[1:]])}`")


if __name__ == "__main__":
    main()
