"""Signal value: what deferral to cheaper hours saves, and what spot interruptions lose, in one run.

    nice .venv/bin/python benchmarks/signal_value.py                       # ~3 min here
    nice .venv/bin/python benchmarks/signal_value.py --signal my.csv --unit price --seeds 5

Each workload is replayed by `service.scheduling.simulate.simulate` on the vendored signal
(benchmarks/data/gb-carbon-intensity-2023-03.csv: GB grid carbon intensity, hourly, March 2023; its
source and licence in benchmarks/data/README.md), the trace's time 0 at the signal's first hour:

- every policy without deferral (the cost of the same jobs run as soon as the queues allow);
- the two-queue policy with deferral (rule 0 of `decide`): a share of the research jobs (drawn by
  seed) is `deferrable: {within_h: N}`; the same jobs carry the same deadlines in the run without
  deferral, so both count the deadlines they miss;
- the two-queue policy with deferral and spot nodes (half the nodes, a stated interruption rate),
  without notice and with a 120 s notice.

The traces' time 0 is 2023-03-21 04:00 UTC, the start of the signal's 9 days without a gap. The
workloads: the generator (`simulate.generate`) at 8 nodes x 8 GPUs over ~7 days at loads 0.8 and
0.5, and the first 7 days of the suite's ITP trace itp-c02-d14-fs8 (benchmarks/traces). Figures are
means over the seeds (which research jobs are deferrable), with the range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import command, machine  # noqa: E402
from policy_value import load_trace  # noqa: E402

from service.contract.queues import DEFAULT_QUEUES, QueuesConfig  # noqa: E402
from service.contract.signal import Signal, parse_time  # noqa: E402
from service.costs import Rates, read_signal  # noqa: E402
from service.scheduling import simulate as sim  # noqa: E402

SIGNAL = ROOT / "benchmarks" / "data" / "gb-carbon-intensity-2023-03.csv"
TRACES = ROOT / "benchmarks" / "traces"
NODE = "CPU=32,GPU=8"
# The traces' time 0: the start of the signal's 9 days without a gap; the traces submit over 7 of them.
START_AT = "2023-03-21T04:00:00Z"
DAYS = 7


def workloads() -> list[tuple[str, list[sim.TraceJob], int, QueuesConfig]]:
    generated = sim.generate(770, seed=7, shape=sim.TraceShape(nodes=8, offered_load=0.8))
    light = sim.generate(480, seed=7, shape=sim.TraceShape(nodes=8, offered_load=0.5))
    entry = next(
        e for e in json.loads((TRACES / "suite.json").read_text())["traces"] if e["name"] == "itp-c02-d14-fs8"
    )
    jobs, queues = load_trace(entry)
    itp = [job for job in jobs if job.submit_s < DAYS * 86_400]
    return [
        (f"generated, {len(generated)} jobs, 8 nodes, load 0.8", generated, 8, DEFAULT_QUEUES),
        (f"generated, {len(light)} jobs, 8 nodes, load 0.5", light, 8, DEFAULT_QUEUES),
        (
            f"ITP c02 days 14-{14 + DAYS:g}, {len(itp)} jobs, 11 nodes",
            itp,
            11,
            queues,
        ),
    ]


@dataclass(frozen=True, kw_only=True)
class Workload:
    jobs: list[sim.TraceJob]
    nodes: int
    queues: QueuesConfig
    signal: Signal
    rates: Rates
    share: float
    start_at: float

    def run(
        self, policy: str, *, seed: int, within_h: float, defer: bool, spot: sim.SimSpot = sim.NO_SPOT
    ) -> sim.SimResult:
        pricing = sim.SimPricing(
            signal=self.signal,
            start_at=self.start_at,
            rates=self.rates,
            defer=defer,
            deferrable_share=self.share,
            within_h=within_h,
            seed=seed,
        )
        return sim.simulate(
            self.jobs,
            nodes=self.nodes,
            node=sim.parse_node(NODE),
            policy=policy,
            queues=self.queues,
            pricing=pricing,
            spot=spot,
        )


def line(label: str, results: list[sim.SimResult]) -> None:
    """One row of the table: means over the seeds."""

    def mean(values: list[float]) -> float:
        return statistics.fmean(values)

    research = [r.queues["research"].wait for r in results]
    cells = [
        label,
        f"{mean([r.cost for r in results]):,.1f}",
        f"{mean([r.priced_hours for r in results]):,.0f}",
        f"{mean([r.deferrable_cost for r in results]):,.1f}",
        f"{mean([r.deferred for r in results]):.0f} of {mean([r.deferrable for r in results]):.0f}",
        f"{mean([r.deadlines_missed for r in results]):.1f}",
        f"{mean([w.p50 for w in research]) / 3600:.2f} / {mean([w.p95 for w in research]) / 3600:.2f} h",
        f"{mean([r.interruptions for r in results]):.1f}",
        f"{mean([r.interrupt_lost_gpu_hours for r in results]):.2f} GPU-h",
    ]
    print(f"| {' | '.join(cells)} |")


def percent(values: list[float]) -> str:
    return f"{100 * statistics.fmean(values):.1f}% ({100 * min(values):.1f} to {100 * max(values):.1f}%)"


def report(workload: Workload, *, unit: str, within: list[float], seeds: range, spot_rate: float) -> None:
    print(
        f"| run | {unit} | priced GPU-h | deferrable jobs' {unit} | deferred | deadlines missed "
        "| research p50 / p95 wait | interruptions | progress lost |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for policy in ("fifo", "greedy", "share-first", "two-queue"):
        line(
            f"{policy}, no deferral",
            [workload.run(policy, seed=s, within_h=within[0], defer=False) for s in seeds],
        )
    savings: list[str] = []
    for within_h in within:
        plain = [workload.run("two-queue", seed=s, within_h=within_h, defer=False) for s in seeds]
        deferred = [workload.run("two-queue", seed=s, within_h=within_h, defer=True) for s in seeds]
        line(f"two-queue, deferral within_h {within_h:g}", deferred)
        if not all(p.deferrable_cost for p in plain):
            savings.append(
                f"- within_h {within_h:g}: no deferrable job (no run-time limit fits in {within_h:g} h)"
            )
            continue
        total = [1 - d.cost / p.cost for d, p in zip(deferred, plain, strict=True)]
        own = [1 - d.deferrable_cost / p.deferrable_cost for d, p in zip(deferred, plain, strict=True)]
        missed = (
            statistics.fmean(p.deadlines_missed for p in plain),
            statistics.fmean(d.deadlines_missed for d in deferred),
        )
        savings.append(
            f"- within_h {within_h:g}: {unit} of the whole trace {percent(total)} lower, of the deferrable "
            f"jobs {percent(own)} lower; deadlines missed without / with deferral: "
            f"{missed[0]:.1f} / {missed[1]:.1f}"
        )
    for notice_s in (0.0, 120.0):
        spot = [
            workload.run(
                "two-queue",
                seed=s,
                within_h=within[0],
                defer=True,
                spot=sim.SimSpot(share=0.5, rate_per_node_h=spot_rate, notice_s=notice_s, seed=s),
            )
            for s in seeds
        ]
        line(f"two-queue, deferral, half the nodes spot ({spot_rate:g}/node-h), notice {notice_s:g} s", spot)
    print()
    print("\n".join(savings))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--signal", type=Path, default=SIGNAL)
    parser.add_argument("--unit", choices=("price", "carbon"), default="carbon")
    parser.add_argument("--start-at", default=START_AT, help="the traces' time 0 (ISO 8601 or Unix seconds)")
    parser.add_argument("--share", type=float, default=0.5, help="share of research jobs deferrable")
    parser.add_argument("--within-h", type=float, nargs="+", default=[12.0, 24.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--spot-rate", type=float, default=0.05, help="interruptions per spot node-hour")
    args = parser.parse_args()
    signal = read_signal(str(args.signal), timeout_s=0)
    rates = Rates(unit=args.unit)
    unit = "kg CO2e" if args.unit == "carbon" else "cost"
    started = time.perf_counter()
    print("## Signal value\n")
    print(f"- machine: {machine()}")
    print(f"- command: `{command()}`")
    print(
        f"- signal: {args.signal.name}, {len(signal.points)} hours, unit {args.unit}, "
        f"time 0 at {args.start_at}"
    )
    for name, jobs, nodes, queues in workloads():
        print(f"\n### {name}\n")
        workload = Workload(
            jobs=jobs,
            nodes=nodes,
            queues=queues,
            signal=signal,
            rates=rates,
            share=args.share,
            start_at=parse_time(args.start_at),
        )
        report(workload, unit=unit, within=args.within_h, seeds=range(args.seeds), spot_rate=args.spot_rate)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
