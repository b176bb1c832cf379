"""Plain `torch.distributed` DDP on Apiary's `gpt` workload: the baseline of `benchmarks/overhead.py`.

    python benchmarks/plain_ddp.py --spec spec.json --out result.json

`spec.json` is the same JobSpec that `overhead.py` submits to Apiary. Two processes (gloo, CPU) each
read their share of the dataset's parquet shards with pyarrow into memory (rows rank::world_size),
then train the same model, optimizer, LR schedule, loss and gradient clipping as the built-in `gpt`
trainer (`trainers.models`). Rank 0 writes the unix time at the end of every step to `--out`, the
moment Apiary's trainer records its step metric, so both sides are timed at the same point.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as pads
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# Run as a script from the repository root: make `service` and `trainers` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.contract.spec import JobSpec
from service.contract.storage import list_shards
from trainers.recipe import recipe_for, split_loss


def load_rows(spec: JobSpec, *, rank: int, world_size: int) -> np.ndarray:
    """This rank's token rows, [rows, seq_len] int64, read with pyarrow (as a plain script would)."""
    files, filesystem = list_shards(spec.required_dataset.uri)
    table = pads.dataset(files, filesystem=filesystem, format="parquet").to_table(columns=["tokens"])
    column = table.column("tokens").combine_chunks()
    seq_len = len(column[0])
    tokens = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), seq_len)
    return np.ascontiguousarray(tokens[rank::world_size].astype(np.int64))


def worker(rank: int, world_size: int, spec_json: str, out: str, threads: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    spec = JobSpec.model_validate_json(spec_json)
    rows = load_rows(spec, rank=rank, world_size=world_size)
    torch.manual_seed(spec.seed)
    trainer = recipe_for(spec)
    model = nn.parallel.DistributedDataParallel(trainer.build_model({"seq_len": rows.shape[1]}))
    optimizer, lr_schedule = trainer.build_optimizer(model.module, max_steps=spec.required_max_steps)
    grad_clip = trainer.grad_clip or math.inf
    batches_per_epoch = len(rows) // spec.required_batch_size
    step_times: list[float] = []
    losses: list[float] = []
    model.train()
    for step in range(spec.required_max_steps):
        start = (step % batches_per_epoch) * spec.required_batch_size
        batch = {"tokens": torch.from_numpy(rows[start : start + spec.required_batch_size])}
        loss, _ = split_loss(trainer.loss(model, batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
        optimizer.step()
        lr_schedule.step()
        # The same host syncs as Apiary's loop (it records loss and grad norm every step).
        losses.append(loss.item())
        grad_norm.item()
        step_times.append(time.time())
    dist.barrier()
    if rank == 0:
        Path(out).write_text(
            json.dumps({"step_end_times": step_times, "losses": losses, "threads": torch.get_num_threads()})
        )
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spec", required=True, help="JobSpec JSON file (trainer gpt, file:// dataset)")
    parser.add_argument("--out", required=True, help="where rank 0 writes its per-step times (JSON)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process; Ray gives a 1-CPU worker OMP_NUM_THREADS=1, so 1 matches Apiary",
    )
    args = parser.parse_args(argv)
    spec = JobSpec.model_validate_json(Path(args.spec).read_text())
    mp.spawn(
        worker,
        args=(spec.num_workers, spec.model_dump_json(), args.out, args.threads, free_port()),
        nprocs=spec.num_workers,
        join=True,
    )
    result: dict[str, Any] = json.loads(Path(args.out).read_text())
    return result


if __name__ == "__main__":
    main()
