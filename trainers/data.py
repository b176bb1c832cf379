"""Datasets: where the shards are, what their rows look like, and how a worker turns them into batches.

The driver (`trainers.launch`) calls `inspect_dataset` before any worker starts. With a manifest
(`_manifest.json`, written by `apiary data shard`) it checks every shard's presence, size and sha256
first, so a missing or corrupt shard fails the job in seconds with `apiary-error: ...`, not as a hang
or a traceback inside a worker. Without one it lists the files and reads only parquet footers (or
tar member names) and one row. Either way it learns the read units (parquet row groups, or whole tar
shards) with their row counts: the input of the deterministic order (`trainers.data_order`).

The worker side is `iter_batches_for_rank`: (epoch, batch) forever from a data position, read
through Ray Data in an order that is a function of (seed, epoch, world size) only
(`trainers.data_stream`); the train loop, not the data, owns the step count.

Formats: `parquet` shards, and `webdataset` `.tar` shards in the layout of `service.sharding`.

Row formats of the built-in trainers:
- `mlp`: `features` (a list of numbers, the same length in every row) and `label` (an integer class
  for classification, a number for regression).
- `gpt`: `tokens` (a list of integer token ids, the same length L >= 2 in every row).

An `id` column, when present, is the sample id that `APIARY_DATA_TRACE_DIR` records (see
`maybe_trace_ids`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from ray.data.collate_fn import ArrowBatchCollateFn

from service.errors import DatasetError
from service.sharding import count_webdataset_samples, iter_webdataset_samples
from service.spec import GPTConfig, JobSpec, MLPConfig
from service.storage import Manifest, list_shards, read_manifest, validate_manifest
from trainers.data_order import Unit
from trainers.data_stream import BatchStream, ShardSource, iter_rank_batches

if TYPE_CHECKING:
    import torch

# Where every rank appends the sample ids of its batches (one JSON line per step), when set.
TRACE_ENV_VAR = "APIARY_DATA_TRACE_DIR"
ID_COLUMN = "id"

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    """What the driver learned about a dataset; travels to every worker in the config dict."""

    uri: str
    files: list[str]
    columns: list[str]
    num_rows: int
    # Per-trainer row shape: {"input_size": n} for mlp, {"seq_len": L} for gpt, {} for custom.
    row_shape: dict[str, int] = field(default_factory=dict)
    # The columns the trainer reads (a built-in's); None reads them all (a custom trainer's).
    read_columns: list[str] | None = None
    format: str = "parquet"
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
        return cls(**data)


def inspect_dataset(
    spec: JobSpec, *, s3_endpoint_url: str | None = None, verify_checksums: bool = True
) -> DatasetInfo:
    """Check that the job's dataset can feed its trainer, reading footers (or tar headers) and one row.

    With a manifest, every shard is first checked against it (size, and sha256 unless
    `verify_checksums` is False). Raises `DatasetError` (a `ValueError`) with a one-line reason.
    """
    uri = spec.dataset.uri
    data_format = spec.dataset.format
    files, filesystem = list_shards(uri, data_format=data_format, s3_endpoint_url=s3_endpoint_url)
    # None for a single file and for a folder written by other tools; list_shards checked the format.
    manifest = read_manifest(uri, s3_endpoint_url=s3_endpoint_url)
    if manifest is not None:
        validate_manifest(
            manifest, uri=uri, s3_endpoint_url=s3_endpoint_url, verify_checksums=verify_checksums
        )
    if data_format == "parquet":
        schema, units, first_row = _parquet_layout(files, filesystem=filesystem, uri=uri, manifest=manifest)
    else:
        schema, units, first_row = _webdataset_layout(
            files, filesystem=filesystem, uri=uri, manifest=manifest
        )
    num_rows = sum(rows for _, _, rows in units)
    # An elastic job may grow to max_workers: the dataset must feed one step of the largest group.
    rows_per_step = spec.max_workers * spec.batch_size
    if num_rows < rows_per_step:
        raise DatasetError(
            f"dataset {uri} has {num_rows} rows but one step needs num_workers x batch_size = "
            f"{spec.max_workers} x {spec.batch_size} = {rows_per_step}"
        )
    row_shape: dict[str, int] = {}
    read_columns: list[str] | None = None
    config = spec.trainer_config()
    if isinstance(config, MLPConfig):
        read_columns = ["features", "label"]
        _require_list_column(schema, uri=uri, name="features", numeric=True)
        label_ok = pa.types.is_integer if config.task == "classification" else _is_number
        _require_column(schema, uri=uri, name="label", ok=label_ok, want=_label_type(config))
        row_shape["input_size"] = _first_row_length(first_row, uri=uri, name="features")
    elif isinstance(config, GPTConfig):
        read_columns = ["tokens"]
        _require_list_column(schema, uri=uri, name="tokens", numeric=False)
        seq_len = _first_row_length(first_row, uri=uri, name="tokens")
        if seq_len < 2:
            raise DatasetError(f"dataset {uri}: rows of 'tokens' need at least 2 ids, got {seq_len}")
        row_shape["seq_len"] = seq_len
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
        raise DatasetError(f"dataset {uri} is not readable parquet: {_one_line(err)}") from err
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
        raise DatasetError(f"dataset {uri} is not a readable webdataset: {_one_line(err)}") from err
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


def _is_number(data_type: pa.DataType) -> bool:
    return bool(pa.types.is_integer(data_type) or pa.types.is_floating(data_type))


def _is_list(data_type: pa.DataType) -> bool:
    return bool(
        pa.types.is_list(data_type)
        or pa.types.is_large_list(data_type)
        or pa.types.is_fixed_size_list(data_type)
    )


def _label_type(config: MLPConfig) -> str:
    return "an integer class id" if config.task == "classification" else "a number"


def _require_column(schema: pa.Schema, *, uri: str, name: str, ok: Any, want: str) -> None:
    if name not in schema.names:
        raise DatasetError(f"dataset {uri} has no column {name!r} (columns: {', '.join(schema.names)})")
    data_type = schema.field(name).type
    if not ok(data_type):
        raise DatasetError(f"dataset {uri}: column {name!r} must be {want}, got {data_type}")


def _require_list_column(schema: pa.Schema, *, uri: str, name: str, numeric: bool) -> None:
    item = "numbers" if numeric else "integer ids"

    def ok(data_type: pa.DataType) -> bool:
        if not _is_list(data_type):
            return False
        value_type = data_type.value_type
        return _is_number(value_type) if numeric else bool(pa.types.is_integer(value_type))

    _require_column(schema, uri=uri, name=name, ok=ok, want=f"a list of {item}")


def _first_row_length(first_row: pa.Table, *, uri: str, name: str) -> int:
    first = first_row.column(name)[0]
    if not first.is_valid:
        raise DatasetError(f"dataset {uri}: the first row of {name!r} is null")
    return len(first)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


# ---------------------------------------------------------------------------------------------------
# Worker side: Arrow batches -> tensors, and an endless stream of (epoch, batch). torch is imported
# where a tensor is made: the driver imports this module for `inspect_dataset` and needs no torch.
# ---------------------------------------------------------------------------------------------------

Batch = dict[str, "torch.Tensor"]


def _fixed_width(column: pa.ChunkedArray, *, width: int, name: str, uri: str) -> np.ndarray:
    array = column.combine_chunks()
    if array.null_count:
        raise DatasetError(f"dataset {uri}: column {name!r} has null rows")
    lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths.min() != width or lengths.max() != width):
        bad = int(lengths[lengths != width][0])
        raise DatasetError(
            f"dataset {uri}: every row of {name!r} must have {width} values (as the first row), found {bad}"
        )
    # flatten() honours slicing offsets, unlike .values, so this is the batch's own data.
    return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), width)


class MLPCollate(ArrowBatchCollateFn):
    """`features` -> float32 [B, input_size]; `label` -> int64 [B] (classification) or float32 [B]."""

    def __init__(self, *, input_size: int, config: MLPConfig, uri: str) -> None:
        super().__init__()
        self.input_size = input_size
        self.config = config
        self.uri = uri

    # Ray annotates the return with an unbound TypeVar, which no concrete type satisfies for mypy.
    def __call__(self, batch: pa.Table) -> Batch:  # type: ignore[override]
        import torch

        features = _fixed_width(
            batch.column("features"), width=self.input_size, name="features", uri=self.uri
        )
        labels = batch.column("label").to_numpy()
        if self.config.task == "classification":
            num_classes = self.config.num_classes
            assert num_classes is not None  # MLPConfig enforces it for classification
            if labels.min() < 0 or labels.max() >= num_classes:
                bad = labels[(labels < 0) | (labels >= num_classes)][0]
                raise DatasetError(
                    f"dataset {self.uri}: label {bad} is outside [0, num_classes={num_classes})"
                )
            label_tensor = torch.tensor(labels, dtype=torch.int64)
        else:
            label_tensor = torch.tensor(labels, dtype=torch.float32)
        return {"features": torch.tensor(features, dtype=torch.float32), "label": label_tensor}


class GPTCollate(ArrowBatchCollateFn):
    """`tokens` -> int64 [B, seq_len], checked against the vocabulary."""

    def __init__(self, *, seq_len: int, vocab_size: int, uri: str) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.uri = uri

    # Ray annotates the return with an unbound TypeVar, which no concrete type satisfies for mypy.
    def __call__(self, batch: pa.Table) -> Batch:  # type: ignore[override]
        import torch

        tokens = _fixed_width(batch.column("tokens"), width=self.seq_len, name="tokens", uri=self.uri)
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise DatasetError(
                f"dataset {self.uri}: token ids must be in [0, vocab_size={self.vocab_size}), "
                f"found {tokens.min()}..{tokens.max()}"
            )
        return {"tokens": torch.tensor(tokens, dtype=torch.int64)}


def build_collate(spec: JobSpec, info: DatasetInfo) -> ArrowBatchCollateFn:
    config = spec.trainer_config()
    if isinstance(config, MLPConfig):
        return MLPCollate(input_size=info.row_shape["input_size"], config=config, uri=info.uri)
    if isinstance(config, GPTConfig):
        return GPTCollate(seq_len=info.row_shape["seq_len"], vocab_size=config.vocab_size, uri=info.uri)
    raise ValueError(f"trainer {spec.trainer!r} has no built-in collate function")


def iter_batches_for_rank(
    spec: JobSpec,
    info: DatasetInfo,
    *,
    rank: int,
    world_size: int,
    collate_fn: ArrowBatchCollateFn,
    start_epoch: int = 0,
    start_sample: int = 0,
    device: torch.device | str = "cpu",
    s3_endpoint_url: str | None = None,
    data_cpus: float | None = None,
    trace_name: str | None = None,
) -> RankBatches:
    """(epoch, full batch) for this rank forever, starting at data position (start_epoch, start_sample).

    The order is a function of (spec.seed, epoch, world_size) only (`trainers.data_order`); every
    rank gets the same number of batches per epoch, so all ranks roll over at the same step.
    `start_sample` is the samples this rank already consumed in `start_epoch`. Reading starts now,
    in the background (`trainers.data_stream.BatchStream`); close the result when done.
    """
    trace = _open_trace(trace_name, rank=rank) if ID_COLUMN in info.columns else None
    source = info.shard_source(
        s3_endpoint_url=s3_endpoint_url, extra_columns=(ID_COLUMN,) if trace is not None else ()
    )
    try:
        stream = iter_rank_batches(
            source,
            units=info.read_units(),
            seed=spec.seed,
            shuffle=spec.dataset.shuffle,
            buffer_rows=spec.dataset.shuffle_buffer_rows,
            world_size=world_size,
            rank=rank,
            batch_size=spec.batch_size,
            collate_fn=collate_fn,
            start_epoch=start_epoch,
            start_sample=start_sample,
            data_cpus=None if data_cpus is None else data_cpus / world_size,
            id_column=ID_COLUMN if trace is not None else None,
        )
    except BaseException:
        if trace is not None:
            trace.close()
        raise
    return RankBatches(stream, trace=trace, device=device)


class RankBatches(Iterator[tuple[int, Batch]]):
    """One rank's (epoch, batch) stream, on `device`; each batch taken is written to the trace, if any."""

    def __init__(self, stream: BatchStream, *, trace: Any, device: torch.device | str) -> None:
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


def _open_trace(trace_name: str | None, *, rank: int) -> Any:
    """`{APIARY_DATA_TRACE_DIR}/{trace_name}/rank-{rank}.jsonl`, opened for append; None when not tracing.

    A debugging and test aid: each line is one step's {"epoch", "ids"} on this rank, so two runs (or a
    run and its resumption, which appends) can be compared sample by sample.
    """
    root = os.environ.get(TRACE_ENV_VAR)
    if not root or not trace_name:
        return None
    folder = Path(root) / trace_name
    folder.mkdir(parents=True, exist_ok=True)
    return (folder / f"rank-{rank}.jsonl").open("a")


def resume_position(
    *, epoch: int, batches_in_epoch: int, saved_world_size: int, world_size: int
) -> tuple[int, int]:
    """The (epoch, batches_in_epoch) to resume from, given a checkpoint's data position.

    The same world size continues at the exact next batch. A different one changes every rank's
    range (the order is a function of the world size), so no position in the old order maps onto
    the new one: training continues with the next epoch, and the rest of this one is skipped.
    """
    if saved_world_size == world_size:
        return epoch, batches_in_epoch
    logger.warning(
        "checkpoint written by %d ranks, this run has %d: data continues at the start of epoch %d",
        saved_world_size,
        world_size,
        epoch + 1,
    )
    return epoch + 1, 0
