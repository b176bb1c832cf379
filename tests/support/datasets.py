"""Small sharded datasets for the trainer tests, from the demo's synthetic tables (`api.demo`)."""

from __future__ import annotations

from pathlib import Path

from api.demo import classification_table, token_table, write_shards


def write_tokens(
    folder: Path,
    *,
    rows: int = 256,
    seq_len: int = 17,
    vocab_size: int = 32,
    shards: int = 3,
    max_stride: int = 1,
) -> Path:
    """`id` and `tokens` rows (counting up by 1 by default: quick to learn) as parquet shards in `folder`."""
    table = token_table(num_rows=rows, seq_len=seq_len, vocab_size=vocab_size, max_stride=max_stride)
    write_shards(table, folder.as_uri(), num_shards=shards)
    return folder


def write_classes(
    folder: Path, *, rows: int = 512, num_features: int = 8, num_classes: int = 3, shards: int = 3
) -> Path:
    """`id`, `features` and `label` rows (linearly separable) as parquet shards in `folder`."""
    table = classification_table(num_rows=rows, num_features=num_features, num_classes=num_classes)
    write_shards(table, folder.as_uri(), num_shards=shards)
    return folder
