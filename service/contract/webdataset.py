"""The WebDataset codec: Arrow rows to `.tar` shard bytes and back.

A `.tar` shard holds one group of members per row, in row order, all named
`{key}.{column}.{ext}` where `key` is the row's 9-digit index within the shard:

- `{key}.{column}.npy`: a list or array column (`numpy.save` of a 1-D array with the column's dtype),
  and float scalars (a 0-d array);
- `{key}.{column}.cls`: an integer scalar as decimal text (the WebDataset convention for labels);
- `{key}.{column}.txt`: a string, UTF-8.

For example a token row is `000000017.id.cls` + `000000017.tokens.npy`, a classification row is
`000000017.features.npy` + `000000017.label.cls`. Column names must not contain '.' (the key/column
separator). `decode_webdataset` is the inverse.

`apiary data shard` (`service.sharding`) writes shards with `encode_webdataset`; the trainers read
them with `decode_webdataset` on the cluster. Like `service.contract.storage`, this needs only pyarrow and
numpy.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from service.contract.errors import DatasetError
from service.contract.storage import is_list_type

_KEY_DIGITS = 9


class _LayoutError(DatasetError):
    """These rows do not fit the WebDataset layout."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, field=None)


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
                    raise _LayoutError(
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
    if is_list_type(data_type):
        value_type = data_type.value_type
        if not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
            raise _LayoutError(f"column {name!r}: webdataset list columns must hold numbers, got {data_type}")
        return "list"
    if pa.types.is_integer(data_type):
        return "int"
    if pa.types.is_floating(data_type):
        return "float"
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type):
        return "str"
    raise _LayoutError(f"column {name!r} has type {data_type}, which the webdataset layout does not cover")


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
