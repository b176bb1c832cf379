"""Resume-cost benchmark: time from restart to the first batch when resuming at 90% of an epoch vs at 0%.

    .venv/bin/python benchmarks/resume.py            # ~1 min on a 2-core machine

What a resume costs on the data side is opening the stream at a data position: Apiary skips whole
parquet row groups before the position and reads at most one shuffle window to drop the consumed
rows of it (`trainers.data_order`). The benchmark opens each of 2 ranks' streams (in 2 Ray workers at
once, as a restarted worker group does) at 0% and at 90% of an epoch, several times alternating, and
times the first batch; then, for contrast, the same 90% position reached the naive way (open at 0%
and read and discard batches up to it). Goal: 90% / 0% <= 1.1x.

The rest of a restart (Ray Train's worker group start, ~10-15 s here, and the checkpoint load) does
not depend on the data position, so it is left out: it would only dilute the ratio towards 1.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ingest import stream_request

from api.demo import token_table, write_shards
from service.contract.protocol import LaunchRequest
from service.contract.spec import JobSpec
from trainers.data import DatasetInfo, inspect_dataset, iter_batches_for_rank
from trainers.data_order import DataPosition
from trainers.recipe import recipe_for

SEQ_LEN = 129
VOCAB = 256


@ray.remote(num_cpus=1)
def first_batch_s(
    request_json: str, info: dict[str, Any], rank: int, start_sample: int, naive: bool
) -> float:
    # The collate builds torch tensors, and torch is imported on first use: in a restarted worker
    # that import overlaps the model build, not the data path. Whichever Ray worker process runs
    # this task for the first time would otherwise add ~1 s of import to a random few timings.
    import torch  # noqa: F401

    request = LaunchRequest.model_validate_json(request_json)
    spec = request.spec
    dataset = DatasetInfo.from_dict(info)
    started = time.perf_counter()
    batches = iter_batches_for_rank(
        request,
        dataset,
        rank=rank,
        world_size=2,
        collate_fn=recipe_for(spec).build_collate(dataset.row_shape, uri=dataset.uri),
        start=DataPosition(0, 0 if naive else start_sample),
    )
    for _ in range(start_sample // spec.required_batch_size if naive else 0):
        next(batches)
    next(batches)
    elapsed = time.perf_counter() - started
    batches.close()
    return elapsed


def time_resume(spec: JobSpec, info: DatasetInfo, *, start_sample: int, naive: bool = False) -> float:
    """Seconds until both ranks have their first batch."""
    return max(
        ray.get(
            [
                # Positional: Ray's typed `.remote` does not take keyword arguments.
                first_batch_s.remote(
                    stream_request(spec).model_dump_json(), info.to_dict(), rank, start_sample, naive
                )
                for rank in (0, 1)
            ]
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--rows-per-shard", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="apiary-resume-") as tmp:
        data = Path(tmp) / "tokens"
        table = token_table(num_rows=args.shards * args.rows_per_shard, seq_len=SEQ_LEN, vocab_size=VOCAB)
        write_shards(table, data.as_uri(), num_shards=args.shards)
        spec = JobSpec.model_validate(
            {
                "name": "bench",
                "trainer": "gpt",
                "num_workers": 2,
                "dataset": {"uri": data.as_uri()},
                "max_steps": 10,
                "batch_size": args.batch_size,
                "config": {"vocab_size": VOCAB},
            }
        )
        info = inspect_dataset(spec, recipe=recipe_for(spec))
        per_rank = info.num_rows // 2 // args.batch_size * args.batch_size
        at_90 = int(0.9 * per_rank) // args.batch_size * args.batch_size
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        try:
            time_resume(spec, info, start_sample=0)  # warm up workers and imports
            zero, ninety = [], []
            for _ in range(args.repeats):
                zero.append(time_resume(spec, info, start_sample=0))
                ninety.append(time_resume(spec, info, start_sample=at_90))
            naive = time_resume(spec, info, start_sample=at_90, naive=True)
        finally:
            ray.shutdown()

    z, n = statistics.median(zero), statistics.median(ninety)
    print(
        f"dataset: {info.num_rows} rows, {len(info.units)} row groups; per rank per epoch {per_rank} rows; "
        f"resume at sample {at_90} (90%)"
    )
    print(f"first batch at 0%:  {z:.2f} s (median of {args.repeats}: {', '.join(f'{x:.2f}' for x in zero)})")
    print(
        f"first batch at 90%: {n:.2f} s (median of {args.repeats}: {', '.join(f'{x:.2f}' for x in ninety)})"
    )
    print(f"90% / 0% = {n / z:.2f}x (goal <= 1.1x)")
    print(f"naive read-and-discard to 90%: {naive:.2f} s = {naive / z:.2f}x")


if __name__ == "__main__":
    main()
