"""Datasets: where the shards are, what their rows look like, and each worker's stream of batches.

The driver (`trainers.launch`) calls `inspect_dataset` before any worker starts. With a manifest
(`_manifest.json`, written by `apiary data shard`) it checks every shard's presence, size and sha256
first, so a missing or corrupt shard fails the job in seconds with a one-line reason, not as a hang
or a traceback inside a worker. Without one it lists the files and reads only parquet footers (or
tar member names) and one row. Either way it learns the read units (parquet row groups, or whole tar
shards) with their row counts: the input of the deterministic order (`trainers.data_order`). A
recipe checks its columns on that one row (`Recipe.check_columns`, `trainers.recipe`).

The worker side is `iter_batches_for_rank`: (epoch, batch) forever from a data position, read
through Ray Data in an order that is a function of (seed, epoch, world size) only
(`trainers.data_stream`); the train loop, not the data, owns the step count.

Formats: `parquet` shards, and `webdataset` `.tar` shards in the layout of `service.contract.webdataset`.

An `id` column, when present, is the sample id that `LaunchRequest.data_trace_dir` records (see
`RankBatches`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from service.contract.errors import DatasetError, one_line
from service.contract.protocol import LaunchRequest
from service.contract.spec import DataFormat, JobSpec
from service.contract.storage import Manifest, list_shards, read_manifest, validate_manifest
from service.contract.webdataset import count_webdataset_samples, iter_webdataset_samples
from trainers.data_order import DataOrder, DataPosition, Unit
from trainers.data_stream import Batch, BatchStream, ShardSource, iter_rank_batches

if TYPE_CHECKING:
    import torch

    from trainers.recipe import Recipe

ID_COLUMN = "id"


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    """What the driver learned about a dataset; travels to every worker in the config dict."""

    uri: str
    files: list[str]
    columns: list[str]
    num_rows: int
    # The recipe's row shape (`Recipe.check_columns`): {"input_size": n} for mlp, {"seq_len": L} for
    # gpt; {} for a function trainer.
    row_shape: dict[str, int] = field(default_factory=dict)
    # The columns the trainer reads (a recipe's `read_columns`); None reads them all.
    read_columns: list[str] | None = None
    format: DataFormat = DataFormat.PARQUET
    # Read units in canonical order, as [file index, part (row group; -1 = whole tar), rows].
    units: list[list[int]] = field(default_factory=list)

    def read_units(self) -> list[Unit]:
        return [Unit(file, part, rows) for file, part, rows in self.units]

    def shard_source(
        self, *, s3_endpoint_url: str | None, extra_columns: tuple[str, ...] = ()
    ) -> ShardSource:
        """How read tasks reach the shards: the trainer's columns (all if None), plus `extra_columns`."""
        columns = self.read_columns
        if columns is not None:
            columns = [*columns, *(name for name in extra_columns if name not in columns)]
        return ShardSource(
            uri=self.uri,
            files=self.files,
            data_format=self.format,
            columns=columns,
            s3_endpoint_url=s3_endpoint_url,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetInfo:
        return cls(**{**data, "format": DataFormat(data["format"])})


def inspect_dataset(
    spec: JobSpec,
    *,
    recipe: Recipe[Any] | None = None,
    s3_endpoint_url: str | None = None,
    verify_checksums: bool = True,
) -> DatasetInfo:
    """Check that the job's dataset can feed its trainer, reading footers (or tar headers) and one row:
    `recipe`'s column check (None, for a function trainer: any columns).

    With a manifest, every shard is first checked against it (size, and sha256 unless
    `verify_checksums` is False). Raises `DatasetError` (a `ValueError`) with a one-line reason.
    """
    uri = spec.required_dataset.uri
    data_format = spec.required_dataset.format
    files, filesystem = list_shards(uri, data_format=data_format, s3_endpoint_url=s3_endpoint_url)
    # None for a single file and for a folder written by other tools; list_shards checked the format.
    manifest = read_manifest(uri, s3_endpoint_url=s3_endpoint_url)
    if manifest is not None:
        validate_manifest(
            manifest, uri=uri, s3_endpoint_url=s3_endpoint_url, verify_checksums=verify_checksums
        )
    if data_format == DataFormat.PARQUET:
        schema, units, first_row = _parquet_layout(files, filesystem=filesystem, uri=uri, manifest=manifest)
    else:
        schema, units, first_row = _webdataset_layout(
            files, filesystem=filesystem, uri=uri, manifest=manifest
        )
    num_rows = sum(rows for _, _, rows in units)
    # An elastic job may grow to max_workers: the dataset must feed one step of the largest group (a
    # function trainer without batch_size chooses its own batches).
    rows_per_step = spec.max_workers * (spec.batch_size or 1)
    if num_rows < rows_per_step:
        raise DatasetError(
            f"dataset {uri} has {num_rows} rows but one step needs num_workers x batch_size = "
            f"{spec.max_workers} x {spec.batch_size} = {rows_per_step}"
        )
    row_shape: dict[str, int] = {}
    read_columns: list[str] | None = None
    if recipe is not None:
        row_shape = recipe.check_columns(schema, first_row, uri=uri)
        read_columns = list(recipe.read_columns) if recipe.read_columns is not None else None
    return DatasetInfo(
        uri=uri,
        files=files,
        columns=list(schema.names),
        num_rows=num_rows,
        row_shape=row_shape,
        read_columns=read_columns,
        format=data_format,
        units=units,
    )


def _parquet_layout(
    files: list[str], *, filesystem: pafs.FileSystem, uri: str, manifest: Manifest | None
) -> tuple[pa.Schema, list[list[int]], pa.Table]:
    """(schema, units, first row) of parquet shards; row groups from the manifest or the footers."""
    units: list[list[int]] = []
    try:
        if manifest is not None and all(shard.row_groups for shard in manifest.shards):
            for index, shard in enumerate(manifest.shards):
                units.extend([index, group, rows] for group, rows in enumerate(shard.row_groups))
            schema = manifest.arrow_schema()
        else:
            schema = None
            for index, path in enumerate(files):
                metadata = pq.read_metadata(path, filesystem=filesystem)
                schema = schema or metadata.schema.to_arrow_schema()
                units.extend(
                    [index, group, metadata.row_group(group).num_rows]
                    for group in range(metadata.num_row_groups)
                    if metadata.row_group(group).num_rows
                )
        first_unit = next((unit for unit in units if unit[2] > 0), None)
        if schema is None or first_unit is None:
            raise DatasetError(f"dataset {uri} has no rows")
        first_file = pq.ParquetFile(filesystem.open_input_file(files[first_unit[0]]))
        first_row = first_file.read_row_group(first_unit[1]).slice(0, 1)
    except (OSError, pa.ArrowInvalid) as err:
        raise DatasetError(f"dataset {uri} is not readable parquet: {one_line(err)}") from err
    return schema, units, first_row


def _webdataset_layout(
    files: list[str], *, filesystem: pafs.FileSystem, uri: str, manifest: Manifest | None
) -> tuple[pa.Schema, list[list[int]], pa.Table]:
    """(schema, units, first row) of tar shards; rows from the manifest or by scanning member names."""
    try:
        if manifest is not None:
            counts = [shard.num_rows for shard in manifest.shards]
        else:
            counts = []
            for path in files:
                with filesystem.open_input_stream(path) as stream:
                    counts.append(count_webdataset_samples(stream))
        first_index = next((index for index, count in enumerate(counts) if count), None)
        if first_index is None:
            raise DatasetError(f"dataset {uri} has no samples")
        with filesystem.open_input_stream(files[first_index]) as stream:
            sample = next(iter_webdataset_samples(stream))
    except (OSError, ValueError) as err:
        if isinstance(err, DatasetError):
            raise
        raise DatasetError(f"dataset {uri} is not a readable webdataset: {one_line(err)}") from err
    first_row = pa.table(
        {
            name: pa.array([value.tolist() if isinstance(value, np.ndarray) else value])
            for name, value in sample.items()
        }
    )
    if manifest is not None:
        first_row = first_row.cast(manifest.arrow_schema())
    units = [[index, -1, count] for index, count in enumerate(counts) if count]
    return first_row.schema, units, first_row


def iter_batches_for_rank(
    request: LaunchRequest,
    info: DatasetInfo,
    *,
    rank: int,
    world_size: int,
    collate_fn: Callable[[pa.Table], Batch],
    start: DataPosition = DataPosition(),
    device: torch.device | str = "cpu",
) -> RankBatches:
    """(epoch, full batch) for this rank forever, starting at data position `start`.

    The order is a function of (spec.seed, epoch, world_size) only (`trainers.data_order`); every
    rank gets the same number of batches per epoch, so all ranks roll over at the same step.
    Reading starts now, in the background (`trainers.data_stream.BatchStream`), with this rank's
    share of the job's `data_cpus`; close the result when done.
    """
    spec = request.spec
    trace = (
        _open_trace(request.data_trace_dir, request.run_name, rank=rank)
        if request.data_trace_dir and ID_COLUMN in info.columns
        else None
    )
    source = info.shard_source(
        s3_endpoint_url=request.s3_endpoint_url, extra_columns=(ID_COLUMN,) if trace is not None else ()
    )
    order = DataOrder(
        units=tuple(info.read_units()),
        seed=spec.seed,
        world_size=world_size,
        batch_size=spec.required_batch_size,
        shuffle=spec.required_dataset.shuffle,
        buffer_rows=spec.required_dataset.shuffle_buffer_rows,
    )
    try:
        stream = iter_rank_batches(
            source,
            order,
            rank=rank,
            collate_fn=collate_fn,
            start=start,
            data_cpus=request.data_cpus / world_size,
            id_column=ID_COLUMN if trace is not None else None,
        )
    except BaseException:
        if trace is not None:
            trace.close()
        raise
    return RankBatches(stream, trace=trace, device=device)


class RankBatches(Iterator[tuple[int, Batch]]):
    """One rank's (epoch, batch) stream, on `device`; each batch taken is written to the trace, if any."""

    def __init__(self, stream: BatchStream, *, trace: IO[str] | None, device: torch.device | str) -> None:
        self._stream = stream
        self._trace = trace
        self._device = device

    def __next__(self) -> tuple[int, Batch]:
        epoch, batch = next(self._stream)
        ids = batch.pop("__ids__", None)
        if self._trace is not None:
            # Written when the loop takes the batch (not when it is prefetched): what was trained on.
            self._trace.write(json.dumps({"epoch": epoch, "ids": ids}) + "\n")
            self._trace.flush()
        return epoch, {key: value.to(self._device) for key, value in batch.items()}

    def close(self) -> None:
        self._stream.close()
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    def __enter__(self) -> RankBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_trace(trace_dir: str, run_name: str, *, rank: int) -> IO[str]:
    """`{trace_dir}/{run_name}/rank-{rank}.jsonl`, opened for append.

    A debugging and test aid: each line is one step's {"epoch", "ids"} on this rank, so two runs (or a
    run and its resumption, which appends) can be compared sample by sample.
    """
    folder = Path(trace_dir) / run_name
    folder.mkdir(parents=True, exist_ok=True)
    return (folder / f"rank-{rank}.jsonl").open("a")
