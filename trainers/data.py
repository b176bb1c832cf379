"""Datasets: where the shards are, what their rows look like, and how a worker turns them into batches.

The driver (`trainers.launch`) calls `inspect_dataset` before any worker starts: it lists the parquet
files and reads only their footers (schema, row counts) and one row, so a wrong URI, a missing column
or a dataset too small for one step fails in seconds with a message the user can act on, not as a
traceback inside a worker. The worker side is `iter_epochs`, which yields batches forever, counting
epochs, because the train loop (not the data) owns the step count.

Row formats of the built-in trainers:
- `mlp`: `features` (a list of numbers, the same length in every row) and `label` (an integer class
  for classification, a number for regression).
- `gpt`: `tokens` (a list of integer token ids, the same length L >= 2 in every row).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import torch
from ray.data.collate_fn import ArrowBatchCollateFn

from service.errors import DatasetError
from service.spec import GPTConfig, JobSpec, MLPConfig
from service.storage import list_shards

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetInfo:
        return cls(**data)


def inspect_dataset(spec: JobSpec, *, s3_endpoint_url: str | None = None) -> DatasetInfo:
    """Check that the job's dataset can feed its trainer, reading footers and one row only.

    Raises `DatasetError` (a `ValueError`) with a one-line reason when it cannot.
    """
    uri = spec.dataset.uri
    files, filesystem = list_shards(uri, s3_endpoint_url=s3_endpoint_url)
    try:
        dataset = pads.dataset(files, filesystem=filesystem, format="parquet")
        num_rows = dataset.count_rows()
    except (OSError, pa.ArrowInvalid) as err:
        raise DatasetError(f"dataset {uri} is not readable parquet: {_one_line(err)}") from err
    schema = dataset.schema
    rows_per_step = spec.num_workers * spec.batch_size
    if num_rows < rows_per_step:
        raise DatasetError(
            f"dataset {uri} has {num_rows} rows but one step needs num_workers x batch_size = "
            f"{spec.num_workers} x {spec.batch_size} = {rows_per_step}"
        )
    row_shape: dict[str, int] = {}
    read_columns: list[str] | None = None
    config = spec.trainer_config()
    if isinstance(config, MLPConfig):
        read_columns = ["features", "label"]
        _require_list_column(schema, uri=uri, name="features", numeric=True)
        label_ok = pa.types.is_integer if config.task == "classification" else _is_number
        _require_column(schema, uri=uri, name="label", ok=label_ok, want=_label_type(config))
        row_shape["input_size"] = _first_row_length(dataset, uri=uri, name="features")
    elif isinstance(config, GPTConfig):
        read_columns = ["tokens"]
        _require_list_column(schema, uri=uri, name="tokens", numeric=False)
        seq_len = _first_row_length(dataset, uri=uri, name="tokens")
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
    )


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


def _first_row_length(dataset: pads.Dataset, *, uri: str, name: str) -> int:
    first = dataset.head(1, columns=[name]).column(name)[0]
    if not first.is_valid:
        raise DatasetError(f"dataset {uri}: the first row of {name!r} is null")
    return len(first)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


# ---------------------------------------------------------------------------------------------------
# Worker side: Arrow batches -> tensors, and an endless stream of (epoch, batch).
# ---------------------------------------------------------------------------------------------------

Batch = dict[str, torch.Tensor]


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


class EmptyEpochError(DatasetError):
    """A rank's shard produced no full batch in an epoch, so the step count could never be reached."""


def iter_epochs(
    shard: Any,
    *,
    batch_size: int,
    collate_fn: ArrowBatchCollateFn,
    start_epoch: int = 0,
    device: torch.device | str = "auto",
) -> Iterator[tuple[int, Batch]]:
    """Yield (epoch, full batch) from a Ray Train dataset shard forever, starting a new epoch when one ends.

    Every rank gets the same number of rows per epoch (Ray Train splits with `equal=True`) and drops
    the same partial last batch, so all ranks roll over at the same step and start the next epoch's
    split together; a rank that would otherwise wait forever on the others raises instead.
    """
    epoch = start_epoch
    while True:
        num_batches = 0
        for batch in shard.iter_torch_batches(
            batch_size=batch_size, collate_fn=collate_fn, drop_last=True, device=device
        ):
            num_batches += 1
            yield epoch, batch
        if num_batches == 0:
            raise EmptyEpochError(f"epoch {epoch} gave this rank no full batch of {batch_size} rows")
        epoch += 1
