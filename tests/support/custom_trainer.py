"""A custom trainer, as a user would write one (`trainer: tests.support.custom_trainer:train`).

It reads the job's dataset both ways docs/jobs.md offers: Ray Train's `get_dataset_shard("train")`
(the whole epoch, split dynamically) and the built-ins' deterministic stream,
`trainers.data.iter_batches_for_rank`. Each rank writes what it saw to `config.out`.

`exit_once` is a trainer whose rank 1 dies once, as a worker killed under it would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray.train
import torch

from service.contract.protocol import LaunchRequest
from trainers.data import DatasetInfo, iter_batches_for_rank


def collate(batch: pa.Table) -> dict[str, torch.Tensor]:
    return {
        "id": torch.tensor(batch.column("id").to_pylist(), dtype=torch.int64),
        "tokens": torch.tensor(batch.column("tokens").to_pylist(), dtype=torch.int64),
    }


def train(loop_config: dict[str, Any]) -> None:
    request = LaunchRequest.model_validate(loop_config["request"])
    info = DatasetInfo.from_dict(loop_config["dataset"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()

    shard_rows = sum(len(batch["id"]) for batch in ray.train.get_dataset_shard("train").iter_batches())
    with iter_batches_for_rank(request, info, rank=rank, world_size=world_size, collate_fn=collate) as stream:
        batches = [next(stream) for _ in range(request.spec.max_steps)]
    seen = {
        "shard_rows": shard_rows,
        "stream": [[epoch, batch["id"].tolist()] for epoch, batch in batches],
    }
    out = Path(request.spec.config["out"], f"{request.run_name}-rank-{rank}.json")
    out.write_text(json.dumps(seen))


def exit_once(loop_config: dict[str, Any]) -> None:
    """Rank 1's process exits the first time (a marker in `config.out` remembers it); then every rank
    returns at once."""
    request = LaunchRequest.model_validate(loop_config["request"])
    marker = Path(request.spec.config["out"], "rank-1-exited")
    if ray.train.get_context().get_world_rank() == 1 and not marker.exists():
        marker.touch()
        os._exit(1)
