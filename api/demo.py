"""`apiary demo`, and the synthetic datasets it trains on (the benchmarks' and the tests' too).

`token_table`: fixed-length sequences that follow a learnable rule (each sequence counts up from a
random start by a random stride of 1 to `max_stride`, modulo the vocabulary), so a small LM's loss
visibly falls within tens of steps. `classification_table`: feature vectors whose label is the
argmax of a fixed linear map of the features. Both carry an `id` column, the row's number.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from api.client import ApiaryClient
from service.contract.states import TERMINAL_STATES
from service.contract.storage import resolve_uri

DEMO_VOCAB_SIZE = 64


def token_table(
    *, num_rows: int, seq_len: int, vocab_size: int, seed: int = 0, max_stride: int = 3
) -> pa.Table:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab_size, size=(num_rows, 1))
    strides = rng.integers(1, max_stride + 1, size=(num_rows, 1))
    tokens = (starts + strides * np.arange(seq_len)[None, :]) % vocab_size
    return pa.table(
        {
            "id": pa.array(np.arange(num_rows), pa.int64()),
            "tokens": pa.array(list(tokens.astype(np.int32)), pa.list_(pa.int32())),
        }
    )


def classification_table(*, num_rows: int, num_features: int, num_classes: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    weights = np.random.default_rng(1234).normal(size=(num_features, num_classes))
    features = rng.normal(size=(num_rows, num_features)).astype(np.float32)
    labels = (features @ weights).argmax(axis=1)
    return pa.table(
        {
            "id": pa.array(np.arange(num_rows), pa.int64()),
            "features": pa.array(list(features), pa.list_(pa.float32())),
            "label": pa.array(labels, pa.int64()),
        }
    )


def write_shards(
    table: pa.Table,
    uri: str,
    *,
    num_shards: int,
    row_group_rows: int = 1024,
    s3_endpoint_url: str | None = None,
) -> list[str]:
    """`table` as `num_shards` parquet files of contiguous rows in the folder `uri` (no manifest)."""
    root, filesystem = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    filesystem.create_dir(root, recursive=True)
    bounds = np.linspace(0, table.num_rows, num_shards + 1).astype(int)
    paths = []
    for index, (start, stop) in enumerate(itertools.pairwise(bounds)):
        path = f"{root}/shard-{index:05d}.parquet"
        part = table.slice(int(start), int(stop - start))
        pq.write_table(part, path, filesystem=filesystem, row_group_size=row_group_rows)
        paths.append(path)
    return paths


def demo_spec(dataset: Path, *, steps: int, workers: int) -> dict[str, Any]:
    return {
        "name": "demo-gpt",
        "queue": "research",
        "trainer": "gpt",
        "num_workers": workers,
        "resources_per_worker": {"CPU": 1},
        "dataset": {"uri": dataset.as_uri(), "format": "parquet"},
        "max_steps": steps,
        "batch_size": 16,
        "seed": 0,
        "checkpoint": {"every_steps": max(1, steps // 3)},
        "config": {
            "vocab_size": DEMO_VOCAB_SIZE,
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "lr": 3e-3,
            "warmup_steps": 5,
        },
    }


def write_demo_dataset(folder: Path) -> None:
    table = token_table(num_rows=2048, seq_len=33, vocab_size=DEMO_VOCAB_SIZE)
    write_shards(table, folder.as_uri(), num_shards=4)


def run_demo_job(url: str, *, dataset: Path, steps: int, workers: int, console: Console) -> int:
    """Submit the demo job to the API at `url`, print its state and loss as it trains; 0 if it succeeded."""
    with ApiaryClient(url) as client:  # APIARY_TOKEN, if the database has tokens
        job = client.submit(demo_spec(dataset, steps=steps, workers=workers))
        console.print(
            f"[bold]3.[/] submitted job {job.id} ({workers} workers, {steps} steps); waiting for Ray"
        )
        shown_state, last_step, started = "", -1, time.monotonic()
        while job.state not in TERMINAL_STATES:
            time.sleep(1)
            job = client.get(job.id)
            if job.state != shown_state:
                shown_state = job.state
                console.print(f"    state: [cyan]{shown_state}[/] ({time.monotonic() - started:.0f} s)")
            points = client.metrics(job.id, rank=0, min_step=last_step + 1)
            # The newest step each second, and the first step too: a short run may end within a second,
            # and the loss it starts from is what shows that it learned.
            shown = [points[0], points[-1]] if last_step < 0 and len(points) > 1 else points[-1:]
            for point in shown:
                last_step = point.step
                values = point.values
                console.print(
                    f"    step {last_step:>4}/{steps}  loss {values.get('loss', float('nan')):.3f}  "
                    f"{values.get('samples_per_s', 0):.0f} samples/s"
                )
        style = "green" if job.state == "succeeded" else "red"
        console.print(f"[bold]4.[/] job {job.id} [{style}]{job.state}[/]", end="")
        console.print(f": {job.message}" if job.message else "")
        if job.latest_checkpoint:
            console.print(f"    checkpoint: {job.latest_checkpoint}")
        return 0 if job.state == "succeeded" else 1
