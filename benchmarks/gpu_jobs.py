"""One-worker DDP and FSDP jobs, bf16, through `apiary serve`: the GPU node's check of the whole path.

    .venv/bin/python benchmarks/gpu_jobs.py          # starts `apiary serve` (its own local Ray) in a temp dir
    .venv/bin/python benchmarks/gpu_jobs.py --url http://127.0.0.1:8000 --dataset DIR   # a running service
    .venv/bin/python benchmarks/gpu_jobs.py --cpu    # a rehearsal on a machine without a GPU

`benchmarks/gpu_check.sh` runs this. Each job is the same built-in `gpt` (the small one of
`benchmarks/fsdp_speed.py`: d256, 4 layers) on `api.demo`'s token dataset, one worker with
`resources_per_worker: {GPU: 1}` (so Ray gives it a GPU, and the trainer CUDA and NCCL),
`precision: bf16`, submitted over REST one after the other. Per job: its end state, the seconds from
submission to the end of step 1 (rank 0's metric time against the client's clock: one machine) and
the median samples/s of the steps after the first tenth; then FSDP's figure against DDP's (a job of
one worker runs FSDP unwrapped: goal >= 0.97x; before that fix the GPU node showed 0.45x).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import Serve, run_job

from api.client import ApiaryClient
from api.demo import DEMO_VOCAB_SIZE, demo_spec, write_demo_dataset


def job_spec(dataset: Path, *, strategy: str, steps: int, cpu: bool) -> dict[str, Any]:
    spec = demo_spec(dataset, steps=steps, workers=1)
    spec.update(
        name=f"gpu-check-{strategy}",
        strategy=strategy,
        precision="bf16",
        batch_size=64,
        resources_per_worker={"CPU": 1} if cpu else {"CPU": 1, "GPU": 1},
        checkpoint={"every_steps": steps},  # one checkpoint (sharded for fsdp), at the end
        config={"vocab_size": DEMO_VOCAB_SIZE, "d_model": 256, "n_layers": 4, "n_heads": 4},
    )
    return spec


def measure(client: ApiaryClient, spec: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """Run one job; its state, submission to the end of step 1 and steady samples/s."""
    result: dict[str, Any] = {"strategy": spec["strategy"], "first_step_s": float("nan")}
    try:
        measured = run_job(client, spec, timeout_s=timeout_s)
    except (RuntimeError, TimeoutError) as error:  # a job that failed, or did not end in time
        return {**result, "state": "failed", "message": str(error), "samples_per_s": float("nan")}
    points = measured["points"]
    first = [point["time"] for point in points if point["step"] == 1]
    steady = [point["values"]["samples_per_s"] for point in points if point["step"] > spec["max_steps"] // 10]
    return {
        **result,
        "state": measured["job"]["state"],
        "message": "",
        "first_step_s": first[0] - measured["submitted"] if first else float("nan"),
        "samples_per_s": statistics.median(steady) if steady else float("nan"),
    }


@contextlib.contextmanager
def service(url: str | None, folder: Path) -> Iterator[str]:
    """`url`, or a fresh `apiary serve` (SQLite, its own local Ray) in `folder`, stopped afterwards."""
    if url is not None:
        yield url
        return
    serve = Serve(folder / "apiary", data_root=folder)
    try:
        serve.wait_healthy()
        yield serve.url
    finally:
        serve.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running apiary serve (default: start one)")
    parser.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="with --url: a folder that service may read (APIARY_DATA_ROOTS) for the token dataset",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timeout-s", type=float, default=180, help="per job")
    parser.add_argument("--cpu", action="store_true", help="CPU workers (a rehearsal without a GPU)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="apiary-gpu-jobs-") as temporary:
        folder = Path(temporary)
        # A started service reads datasets under the run's folder (Serve's APIARY_DATA_ROOTS).
        dataset = args.dataset or folder / "tokens"
        write_demo_dataset(dataset)
        with service(args.url, folder) as url, ApiaryClient(url) as client:
            results = [
                measure(
                    client,
                    job_spec(dataset, strategy=strategy, steps=args.steps, cpu=args.cpu),
                    timeout_s=args.timeout_s,
                )
                for strategy in ("ddp", "fsdp")
            ]
    device = "CPU" if args.cpu else "GPU"
    print(f"jobs over REST: gpt d256 x 4 layers, 1 {device} worker, bf16, batch 64, {args.steps} steps")
    for result in results:
        print(
            f"  {result['strategy']:<5} {result['state']:<10} submission to step 1 "
            f"{result['first_step_s']:5.1f} s   {result['samples_per_s']:8.0f} samples/s  {result['message']}"
        )
    ddp, fsdp = results
    print(f"  fsdp / ddp: {fsdp['samples_per_s'] / ddp['samples_per_s']:.2f}x (one worker: goal >= 0.97x)")
    return 0 if all(result["state"] == "succeeded" for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
