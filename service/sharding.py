"""`apiary data shard`: write a local parquet file or folder as N shards plus a manifest, at any URI.

    apiary data shard ./rows.parquet s3://bucket/tokens --format webdataset --num-shards 8

Rows keep their order: shard i holds the i-th contiguous run of rows, and the shards' row counts
differ by at most one. Parquet shards are written with `row_group_rows` rows per row group (the
trainer's unit of shuffling and of resume). The manifest (`_manifest.json`, see `service.contract.storage`)
is written last, with each shard's rows, size and sha256, so a reader that finds it knows every
shard is complete.

The `.tar` layout of WebDataset shards is `service.contract.webdataset`'s.

"""

from __future__ import annotations

import hashlib
import itertools
import logging

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from service.contract.errors import DatasetError, one_line
from service.contract.spec import DataFormat
from service.contract.storage import (
    SHARD_SUFFIXES,
    Manifest,
    ShardEntry,
    resolve_uri,
    schema_fields,
    write_manifest,
)
from service.contract.webdataset import encode_webdataset

logger = logging.getLogger(__name__)


class ShardingError(DatasetError):
    """The source cannot be sharded as asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, field=None)


def shard_dataset(
    source: str,
    dest: str,
    *,
    data_format: DataFormat | str = DataFormat.PARQUET,
    num_shards: int,
    row_group_rows: int = 1024,
    s3_endpoint_url: str | None = None,
) -> Manifest:
    """Write the parquet rows at local `source` (a file or folder) as `num_shards` shards at `dest`.

    Raises `ShardingError` (a ValueError) for a bad source, format or shard count.
    """
    if data_format not in tuple(DataFormat):
        formats = ", ".join(DataFormat)
        raise ShardingError(f"format must be one of {formats}, got {str(data_format)!r}")
    data_format = DataFormat(data_format)
    if num_shards < 1:
        raise ShardingError(f"--num-shards must be >= 1, got {num_shards}")
    if row_group_rows < 1:
        raise ShardingError(f"row_group_rows must be >= 1, got {row_group_rows}")
    table = _read_source(source)
    if table.num_rows < num_shards:
        raise ShardingError(f"{source} has {table.num_rows} rows, fewer than --num-shards {num_shards}")
    if data_format == DataFormat.WEBDATASET:
        bad = [name for name in table.schema.names if "." in name or not name]
        if bad:
            raise ShardingError(f"webdataset column names must not contain '.': {', '.join(bad)}")

    root, filesystem = resolve_uri(dest, s3_endpoint_url=s3_endpoint_url)
    filesystem.create_dir(root, recursive=True)
    bounds = np.linspace(0, table.num_rows, num_shards + 1).astype(int)
    entries: list[ShardEntry] = []
    for index, (start, stop) in enumerate(itertools.pairwise(bounds)):
        part = table.slice(int(start), int(stop - start))
        name = f"shard-{index:05d}{SHARD_SUFFIXES[data_format]}"
        row_groups: list[int] = []
        if data_format == DataFormat.PARQUET:
            sink = pa.BufferOutputStream()
            pq.write_table(part, sink, row_group_size=row_group_rows)
            data = sink.getvalue().to_pybytes()
            row_groups = [
                min(row_group_rows, part.num_rows - at) for at in range(0, part.num_rows, row_group_rows)
            ]
        else:
            data = encode_webdataset(part)
        with filesystem.open_output_stream(f"{root}/{name}") as stream:
            stream.write(data)
        entries.append(
            ShardEntry(
                path=name,
                num_rows=part.num_rows,
                size_bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                row_groups=row_groups,
            )
        )
    readable, ipc = schema_fields(table.schema)
    manifest = Manifest(
        format=data_format, num_rows=table.num_rows, schema=readable, schema_ipc=ipc, shards=entries
    )
    write_manifest(manifest, dest, s3_endpoint_url=s3_endpoint_url)
    logger.info("wrote %d %s shards (%d rows) to %s", num_shards, data_format.value, table.num_rows, dest)
    return manifest


def _read_source(source: str) -> pa.Table:
    path, filesystem = resolve_uri(source)
    try:
        dataset = pads.dataset(path, filesystem=filesystem, format="parquet")
        table = dataset.to_table()
    except FileNotFoundError as err:
        raise ShardingError(f"{source} does not exist") from err
    except (OSError, pa.ArrowInvalid) as err:
        raise ShardingError(f"{source} is not readable parquet: {one_line(err)}") from err
    if table.num_rows == 0:
        raise ShardingError(f"{source} has no rows")
    return table
