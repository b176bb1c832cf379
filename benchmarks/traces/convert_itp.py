"""Convert a window of Microsoft's ITP trace (ElasticFlow, ASPLOS '23) into an Apiary trace.

    python benchmarks/traces/convert_itp.py RAW_DIR/cluster04.csv --start-day 14 --days 14 \\
        --full-scale-gpus 8 --name itp-c04-d14-fs8 --out benchmarks/traces

The raw trace (`data/raw-traces.tar.gz` of https://github.com/microsoft/elasticflow-traces, MIT
licence) has, per job, `job_id` (a UUID), `submission_time` (seconds), `duration` (seconds) and
`num_gpu`. It says nothing of owners, queues, CPUs or checkpoints, so the conversion decides:

- the window: jobs submitted in [start day, start day + days), submit times from its start;
- the queue: full-scale for jobs of `--full-scale-gpus` GPUs or more, research below;
- the gang: nodes of 8 GPUs and 32 CPUs (4 per GPU); a job of up to 8 GPUs is one worker, a larger
  one whole 8-GPU workers;
- one owner (`itp`): the trace has none, so history estimates by size class alone; priority 0;
- `checkpoint_every_s` 1800 (every 30 min); no declared `max_runtime_s`;
- job ids 1..N in submission order (the UUIDs are dropped);
- the cluster: the number of 8-GPU nodes that makes the window's offered load (GPU-seconds of the
  jobs it submits over its GPU-seconds) `--load` (0.875), at least the largest job's nodes.

It writes NAME.csv.gz and NAME.queues.yaml (limits that fit the trace: research takes one worker and
runs at most `--research-max-days` days; the file says how many jobs those limits touch), and
prints one line for the suite's manifest (benchmarks/traces/suite.json).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from service.scheduling.simulate import TraceJob, write_trace  # noqa: E402

GPUS_PER_NODE = 8
CPUS_PER_GPU = 4
CHECKPOINT_EVERY_S = 1800.0
DAY = 86_400.0


def convert(
    rows: list[dict[str, str]], *, start_day: float, days: float, full_scale_gpus: int
) -> list[TraceJob]:
    start, end = start_day * DAY, (start_day + days) * DAY
    window = sorted(
        (
            (float(row["submission_time"]) - start, float(row["duration"]), int(row["num_gpu"]))
            for row in rows
            if start <= float(row["submission_time"]) < end
        ),
    )
    jobs: list[TraceJob] = []
    for submit_s, duration_s, gpus in window:
        if duration_s <= 0 or gpus <= 0:
            continue  # nothing to schedule (counted by the caller)
        workers = math.ceil(gpus / GPUS_PER_NODE)
        per_worker = gpus / workers
        jobs.append(
            TraceJob(
                job_id=len(jobs) + 1,
                submit_s=submit_s,
                queue="full-scale" if gpus >= full_scale_gpus else "research",
                owner="itp",
                priority=0,
                num_workers=workers,
                cpu_per_worker=per_worker * CPUS_PER_GPU,
                gpu_per_worker=per_worker,
                duration_s=duration_s,
                checkpoint_every_s=CHECKPOINT_EVERY_S,
            )
        )
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("raw", type=Path, help="one cluster's CSV from raw-traces.tar.gz")
    parser.add_argument("--start-day", type=float, required=True)
    parser.add_argument("--days", type=float, default=14.0)
    parser.add_argument("--full-scale-gpus", type=int, default=8)
    parser.add_argument("--load", type=float, default=0.875)
    parser.add_argument("--research-max-days", type=float, default=7.0)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()

    with args.raw.open(newline="") as source:
        rows = list(csv.DictReader(source))
    jobs = convert(rows, start_day=args.start_day, days=args.days, full_scale_gpus=args.full_scale_gpus)
    gpu_s = {queue: 0.0 for queue in ("research", "full-scale")}
    for job in jobs:
        gpu_s[job.queue] += job.num_workers * job.gpu_per_worker * job.duration_s
    work = sum(gpu_s.values())
    span = args.days * DAY
    nodes = max(round(work / (args.load * span * GPUS_PER_NODE)), max(job.num_workers for job in jobs))
    limit_s = args.research_max_days * DAY
    touched = sum(1 for job in jobs if job.queue == "research" and job.duration_s > limit_s)
    args.out.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out / f"{args.name}.csv.gz", "wt", newline="") as out:
        write_trace(jobs, out)
    (args.out / f"{args.name}.queues.yaml").write_text(
        f"# Limits that fit {args.name}: research jobs are below {args.full_scale_gpus} GPUs (one worker)\n"
        f"# and run at most {args.research_max_days:g} days; {touched} of its {len(jobs)} jobs run longer "
        "and are stopped there.\n"
        "research:\n"
        "  max_workers_per_job: 1\n"
        f"  max_runtime_s: {limit_s:.0f}\n"
        f"  default_max_runtime_s: {limit_s:.0f}\n"
    )
    entry = {
        "name": args.name,
        "trace": f"{args.name}.csv.gz",
        "queues": f"{args.name}.queues.yaml",
        "nodes": nodes,
        "node": f"CPU={GPUS_PER_NODE * CPUS_PER_GPU},GPU={GPUS_PER_NODE}",
        "source": f"ITP {args.raw.stem}, days {args.start_day:g}-{args.start_day + args.days:g}, "
        f"full-scale >= {args.full_scale_gpus} GPUs",
        "jobs": len(jobs),
        "dropped": sum(
            1
            for row in rows
            if args.start_day * DAY <= float(row["submission_time"]) < (args.start_day + args.days) * DAY
        )
        - len(jobs),
        "research_load": round(gpu_s["research"] / work, 3),
        "offered_load": round(work / (span * nodes * GPUS_PER_NODE), 3),
        "limits_touch": touched,
    }
    print(json.dumps(entry))


if __name__ == "__main__":
    main()
