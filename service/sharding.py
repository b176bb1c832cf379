"""`apiary data shard`: write a local parquet file or folder as N shards plus a manifest, at any URI.

    apiary data shard ./rows.parquet s3://bucket/tokens --format webdataset --num-shards 8

Rows keep their order: shard i holds the i-th contiguous run of rows, and the shards' row counts
differ by at most one. Parquet shards are written with `row_group_rows` rows per row group (the
trainer's unit of shuffling and of resume). The manifest (`_manifest.json`, see `service.storage`)
is written last, with each shard's rows, size and sha256, so a reader that finds it knows every
shard is complete.

WebDataset layout. A `.tar` shard holds one group of members per row, in row order, all named
`{key}.{column}.{ext}` where `key` is the row's 9-digit index within the shard:

- `{key}.{column}.npy`: a list or array column (`numpy.save` of a 1-D array with the column's dtype),
  and float scalars (a 0-d array);
- `{key}.{column}.cls`: an integer scalar as decimal text (the WebDataset convention for labels);
- `{key}.{column}.txt`: a string, UTF-8.

For example a token row is `000000017.id.cls` + `000000017.tokens.npy`, a classification row is
`000000017.features.npy` + `000000017.label.cls`. Column names must not contain '.' (the key/column
separator). `decode_webdataset` is the inverse, used by the trainer's reader.

Like `service.spec` and `service.storage`, this module needs only pyarrow and numpy: the trainers
import it on the cluster, so a shard written here is read there by the same code.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import tarfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from service.errors import DatasetError
from service.storage import (
    SHARD_SUFFIXES,
    Manifest,
    ShardEntry,
    resolve_uri,
    schema_fields,
    write_manifest,
)

logger = logging.getLogger(__name__)

FORMATS = ("parquet", "webdataset")
_KEY_DIGITS = 9


class ShardingError(DatasetError):
    """The source cannot be sharded as asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, field=None)


def shard_dataset(
    source: str,
    dest: str,
    *,
    data_format: str = "parquet",
    num_shards: int,
    row_group_rows: int = 1024,
    s3_endpoint_url: str | None = None,
) -> Manifest:
    """Write the parquet rows at local `source` (a file or folder) as `num_shards` shards at `dest`.

    Raises `ShardingError` (a ValueError) for a bad source, format or shard count.
    """
    if data_format not in FORMATS:
        raise ShardingError(f"format must be one of {', '.join(FORMATS)}, got {data_format!r}")
    if num_shards < 1:
        raise ShardingError(f"--num-shards must be >= 1, got {num_shards}")
    if row_group_rows < 1:
        raise ShardingError(f"row_group_rows must be >= 1, got {row_group_rows}")
    table = _read_source(source)
    if table.num_rows < num_shards:
        raise ShardingError(f"{source} has {table.num_rows} rows, fewer than --num-shards {num_shards}")
    if data_format == "webdataset":
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
        if data_format == "parquet":
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
    logger.info("wrote %d %s shards (%d rows) to %s", num_shards, data_format, table.num_rows, dest)
    return manifest


def _read_source(source: str) -> pa.Table:
    path, filesystem = resolve_uri(source)
    try:
        dataset = pads.dataset(path, filesystem=filesystem, format="parquet")
        table = dataset.to_table()
    except FileNotFoundError as err:
        raise ShardingError(f"{source} does not exist") from err
    except (OSError, pa.ArrowInvalid) as err:
        raise ShardingError(f"{source} is not readable parquet: {' '.join(str(err).split())}") from err
    if table.num_rows == 0:
        raise ShardingError(f"{source} has no rows")
    return table


# ---------------------------------------------------------------------------------------------------
# WebDataset codec (layout in the module docstring)
# ---------------------------------------------------------------------------------------------------


def encode_webdataset(table: pa.Table) -> bytes:
    """One tar shard holding `table`'s rows, in order."""
    columns = {name: table.column(name) for name in table.schema.names}
    kinds = {name: _kind(column.type, name) for name, column in columns.items()}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        values = {name: column.to_pylist() for name, column in columns.items()}
        numpy_types = {
            name: column.type.value_type.to_pandas_dtype() if kinds[name] == "list" else None
            for name, column in columns.items()
        }
        for row in range(table.num_rows):
            key = f"{row:0{_KEY_DIGITS}d}"
            for name in table.schema.names:
                value = values[name][row]
                if value is None:
                    raise ShardingError(
                        f"column {name!r} has a null in row {row}: webdataset rows need values"
                    )
                kind = kinds[name]
                if kind == "list":
                    payload = _npy(np.asarray(value, dtype=numpy_types[name]))
                    ext = "npy"
                elif kind == "int":
                    payload, ext = str(int(value)).encode(), "cls"
                elif kind == "float":
                    payload, ext = _npy(np.asarray(value, dtype=columns[name].type.to_pandas_dtype())), "npy"
                else:
                    payload, ext = str(value).encode(), "txt"
                member = tarfile.TarInfo(f"{key}.{name}.{ext}")
                member.size = len(payload)
                tar.addfile(member, io.BytesIO(payload))
    return buffer.getvalue()


def decode_webdataset(data: bytes | io.RawIOBase | io.BufferedIOBase) -> pa.Table:
    """The rows of one tar shard (the inverse of `encode_webdataset`), columns in first-sample order."""
    rows: list[dict[str, Any]] = list(iter_webdataset_samples(data))
    if not rows:
        return pa.table({})
    names = list(rows[0])
    columns = {}
    for name in names:
        try:
            values = [row[name] for row in rows]
        except KeyError:
            raise DatasetError(f"a webdataset sample has no {name!r} member, unlike the first one") from None
        if isinstance(values[0], np.ndarray) and values[0].ndim == 1:
            value_type = pa.from_numpy_dtype(values[0].dtype)
            flat = np.concatenate(values)
            offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(np.int32)
            columns[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, value_type))
        elif isinstance(values[0], np.ndarray):
            columns[name] = pa.array(np.stack(values))
        else:
            columns[name] = pa.array(values)
    return pa.table(columns)


def iter_webdataset_samples(data: bytes | io.RawIOBase | io.BufferedIOBase) -> Iterator[dict[str, object]]:
    """Samples of a tar shard as {column: value}, streaming (members are read in tar order)."""
    fileobj = io.BytesIO(data) if isinstance(data, bytes) else data
    current_key: str | None = None
    sample: dict[str, object] = {}
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = member.name.rsplit("/", 1)[-1]
            parts = base.split(".")
            if len(parts) != 3:
                raise DatasetError(f"tar member {member.name!r} is not named {{key}}.{{column}}.{{ext}}")
            key, column, ext = parts
            extracted = tar.extractfile(member)
            assert extracted is not None  # isfile() above
            payload = extracted.read()
            if key != current_key:
                if sample:
                    yield sample
                current_key, sample = key, {}
            sample[column] = _decode_value(payload, ext=ext, name=member.name)
    if sample:
        yield sample


def count_webdataset_samples(data: bytes | io.RawIOBase | io.BufferedIOBase) -> int:
    """Samples in a tar shard, from member names only (payloads are skipped)."""
    fileobj = io.BytesIO(data) if isinstance(data, bytes) else data
    keys = 0
    previous: str | None = None
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for member in tar:
            key = member.name.rsplit("/", 1)[-1].split(".", 1)[0]
            if member.isfile() and key != previous:
                keys, previous = keys + 1, key
    return keys


def _kind(data_type: pa.DataType, name: str) -> str:
    if (
        pa.types.is_list(data_type)
        or pa.types.is_large_list(data_type)
        or pa.types.is_fixed_size_list(data_type)
    ):
        value_type = data_type.value_type
        if not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
            raise ShardingError(
                f"column {name!r}: webdataset list columns must hold numbers, got {data_type}"
            )
        return "list"
    if pa.types.is_integer(data_type):
        return "int"
    if pa.types.is_floating(data_type):
        return "float"
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type):
        return "str"
    raise ShardingError(f"column {name!r} has type {data_type}, which the webdataset layout does not cover")


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _decode_value(payload: bytes, *, ext: str, name: str) -> object:
    if ext == "npy":
        return np.load(io.BytesIO(payload), allow_pickle=False)
    if ext == "cls":
        return int(payload)
    if ext == "txt":
        return payload.decode()
    raise DatasetError(f"tar member {name!r}: unknown extension {ext!r} (expected npy, cls or txt)")
