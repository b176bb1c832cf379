"""Function trainers, as a user writes them: Ray Train functions, run with the spec's `config`.

`train` reads the job's dataset with Ray Train's `get_dataset_shard("train")` and writes each rank's
row count to `config["out"]`. `exit_once` is a trainer whose rank 1 dies once, as a worker killed
under it would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ray.train


def train(config: dict[str, Any]) -> None:
    context = ray.train.get_context()
    rows = sum(len(batch["id"]) for batch in ray.train.get_dataset_shard("train").iter_batches())
    out = Path(config["out"], f"{context.get_experiment_name()}-rank-{context.get_world_rank()}.json")
    out.write_text(json.dumps({"shard_rows": rows}))


def exit_once(config: dict[str, Any]) -> None:
    """Rank 1's process exits the first time (a marker in `config["out"]` remembers it); then every rank
    returns at once."""
    marker = Path(config["out"], "rank-1-exited")
    if ray.train.get_context().get_world_rank() == 1 and not marker.exists():
        marker.touch()
        os._exit(1)
