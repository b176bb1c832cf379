"""Synthetic sharded datasets for the demo, the tests and the benchmarks (written with pyarrow).

`token_rows`: fixed-length sequences that follow a learnable rule (each sequence
counts up from a random start by a random stride, modulo the vocabulary), so a
small LM's loss visibly falls within tens of steps. `classification_rows`:
feature vectors whose label is a linear function of the features.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from service.storage import resolve_uri


def token_table(*, num_rows: int, seq_len: int, vocab_size: int, seed: int, first_id: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab_size, size=(num_rows, 1))
    strides = rng.integers(1, 4, size=(num_rows, 1))
    tokens = (starts + strides * np.arange(seq_len)[None, :]) % vocab_size
    return pa.table(
        {
            "id": pa.array(np.arange(first_id, first_id + num_rows), pa.int64()),
            "tokens": pa.array(list(tokens.astype(np.int32)), pa.list_(pa.int32())),
        }
    )


def classification_table(
    *, num_rows: int, num_features: int, num_classes: int, seed: int, first_id: int = 0
) -> pa.Table:
    rng = np.random.default_rng(seed)
    weights = np.random.default_rng(1234).normal(size=(num_features, num_classes))
    features = rng.normal(size=(num_rows, num_features)).astype(np.float32)
    labels = (features @ weights).argmax(axis=1)
    return pa.table(
        {
            "id": pa.array(np.arange(first_id, first_id + num_rows), pa.int64()),
            "features": pa.array(list(features), pa.list_(pa.float32())),
            "label": pa.array(labels, pa.int64()),
        }
    )


def write_shards(
    tables: list[pa.Table], uri: str, *, s3_endpoint_url: str | None = None, row_group_rows: int = 1024
) -> list[str]:
    """Write one parquet shard per table under `uri` (a folder); returns the shard paths."""
    root, fs = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    fs.create_dir(root, recursive=True)
    paths = []
    for index, table in enumerate(tables):
        path = f"{root}/shard-{index:05d}.parquet"
        pq.write_table(table, path, filesystem=fs, row_group_size=row_group_rows)
        paths.append(path)
    return paths


def write_token_dataset(
    uri: str,
    *,
    num_shards: int,
    rows_per_shard: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    s3_endpoint_url: str | None = None,
) -> list[str]:
    tables = [
        token_table(
            num_rows=rows_per_shard,
            seq_len=seq_len,
            vocab_size=vocab_size,
            seed=seed * 1000 + shard,
            first_id=shard * rows_per_shard,
        )
        for shard in range(num_shards)
    ]
    return write_shards(tables, uri, s3_endpoint_url=s3_endpoint_url)


def write_classification_dataset(
    uri: str,
    *,
    num_shards: int,
    rows_per_shard: int,
    num_features: int,
    num_classes: int,
    seed: int = 0,
    s3_endpoint_url: str | None = None,
) -> list[str]:
    tables = [
        classification_table(
            num_rows=rows_per_shard,
            num_features=num_features,
            num_classes=num_classes,
            seed=seed * 1000 + shard,
            first_id=shard * rows_per_shard,
        )
        for shard in range(num_shards)
    ]
    return write_shards(tables, uri, s3_endpoint_url=s3_endpoint_url)
