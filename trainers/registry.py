"""The built-in trainers, one object each: what rows they read, how rows become tensors, the model, its
loss and its optimizer.

`builtin_trainer(spec)` validates the spec's `config` against the trainer's schema once (the schemas
are `service.contract.spec.BUILTIN_CONFIGS`, which the API checks at submission) and returns the trainer
bound to it. Adding a built-in trainer is one class here and its config schema there.

- `mlp`: rows of `features` (a list of numbers, the same length in every row; its length is the
  model's input size) and `label` (an integer class for classification, a number for regression).
  A multilayer perceptron (`trainers.models.MLP`): cross-entropy over `num_classes` logits, or MSE on
  one output. Adam at a constant `lr`; gradients are measured, not clipped.
- `gpt`: rows of `tokens` (integer ids, the same length L >= 2 in every row). A small decoder-only
  transformer (`trainers.models.GPT`) reads `tokens[:, :-1]` and predicts `tokens[:, 1:]`, so its
  context is L - 1. AdamW (weight decay on matrices only), linear warmup over `warmup_steps`, then
  cosine decay to `MIN_LR_RATIO` of `lr` at `max_steps`; gradients clipped to `grad_clip`.

Custom trainers (`package.module:function`) are not registered: they bring their own train loop
(`trainers.launch.custom_trainer`).

This module imports no torch: the job driver uses the column checks, and only the workers, which
build models and tensors, import torch (inside the methods that need it).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from service.contract.errors import DatasetError
from service.contract.spec import BUILTIN_CONFIGS, GPTConfig, JobSpec, MLPConfig
from service.contract.storage import is_list_type, is_number_type

if TYPE_CHECKING:
    import torch
    from torch import nn

# Cosine decay ends at this fraction of the peak learning rate.
MIN_LR_RATIO = 0.1

ConfigT = TypeVar("ConfigT", bound=BaseModel)
# What the driver learns from the data that sizes the model: {"input_size": n} | {"seq_len": L}.
RowShape = dict[str, int]
# Arrow rows -> a batch of tensors (what `BuiltinTrainer.loss` takes); it runs on the workers.
Collate = Callable[[pa.Table], dict[str, "torch.Tensor"]]


class BuiltinTrainer(ABC, Generic[ConfigT]):
    """A built-in trainer bound to one job's validated config."""

    name: ClassVar[str]
    config_type: ClassVar[type[BaseModel]]
    read_columns: ClassVar[tuple[str, ...]]

    def __init__(self, config: ConfigT) -> None:
        self.config = config

    @abstractmethod
    def check_columns(self, schema: pa.Schema, first_row: pa.Table, *, uri: str) -> RowShape:
        """Raise `DatasetError` unless these columns can feed the trainer; return the row shape."""

    @abstractmethod
    def build_collate(self, row_shape: RowShape, *, uri: str) -> Collate:
        """Arrow rows -> the batch of tensors that `loss` takes."""

    @abstractmethod
    def build_model(self, row_shape: RowShape) -> nn.Module: ...

    @abstractmethod
    def loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor: ...

    @abstractmethod
    def build_optimizer(
        self, model: nn.Module, *, max_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer and its per-step LR schedule (call after the model is wrapped and placed)."""

    @property
    def grad_clip(self) -> float | None:
        """The gradient-norm clip; None measures the norm without clipping."""
        return None


class MLPTrainer(BuiltinTrainer[MLPConfig]):
    name = "mlp"
    config_type = MLPConfig
    read_columns = ("features", "label")

    def check_columns(self, schema: pa.Schema, first_row: pa.Table, *, uri: str) -> RowShape:
        require_list_column(schema, uri=uri, name="features", of="numbers", ok=is_number_type)
        if self.config.task == "classification":
            require_column(schema, uri=uri, name="label", want="an integer class id", ok=pa.types.is_integer)
        else:
            require_column(schema, uri=uri, name="label", want="a number", ok=is_number_type)
        return {"input_size": first_row_length(first_row, uri=uri, name="features")}

    def build_collate(self, row_shape: RowShape, *, uri: str) -> Collate:
        return MLPCollate(input_size=row_shape["input_size"], config=self.config, uri=uri)

    def build_model(self, row_shape: RowShape) -> nn.Module:
        from trainers.models import MLP

        config = self.config
        output_size = config.num_classes if config.task == "classification" else 1
        assert output_size is not None  # MLPConfig requires num_classes for classification
        return MLP(
            input_size=row_shape["input_size"], hidden_sizes=config.hidden_sizes, output_size=output_size
        )

    def loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F

        output = model(batch["features"])
        if self.config.task == "classification":
            return F.cross_entropy(output, batch["label"])
        return F.mse_loss(output.squeeze(-1), batch["label"])

    def build_optimizer(
        self, model: nn.Module, *, max_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        import torch

        optimizer = torch.optim.Adam(model.parameters(), lr=self.config.lr)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _constant)


class GPTTrainer(BuiltinTrainer[GPTConfig]):
    name = "gpt"
    config_type = GPTConfig
    read_columns = ("tokens",)

    def check_columns(self, schema: pa.Schema, first_row: pa.Table, *, uri: str) -> RowShape:
        require_list_column(schema, uri=uri, name="tokens", of="integer ids", ok=pa.types.is_integer)
        seq_len = first_row_length(first_row, uri=uri, name="tokens")
        if seq_len < 2:
            raise DatasetError(f"dataset {uri}: rows of 'tokens' need at least 2 ids, got {seq_len}")
        return {"seq_len": seq_len}

    def build_collate(self, row_shape: RowShape, *, uri: str) -> Collate:
        return GPTCollate(seq_len=row_shape["seq_len"], vocab_size=self.config.vocab_size, uri=uri)

    def build_model(self, row_shape: RowShape) -> nn.Module:
        from trainers.models import GPT

        return GPT(self.config, block_size=row_shape["seq_len"] - 1)

    def loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F

        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def build_optimizer(
        self, model: nn.Module, *, max_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        import torch

        config = self.config
        # Decay matrices (linear and embedding weights), not biases or LayerNorm gains.
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))
        schedule = partial(lr_factor, warmup_steps=config.warmup_steps, max_steps=max_steps)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    @property
    def grad_clip(self) -> float | None:
        return self.config.grad_clip


REGISTRY: dict[str, type[BuiltinTrainer[Any]]] = {
    trainer.name: trainer for trainer in (MLPTrainer, GPTTrainer)
}
assert {name: trainer.config_type for name, trainer in REGISTRY.items()} == BUILTIN_CONFIGS


def builtin_trainer(spec: JobSpec) -> BuiltinTrainer[Any]:
    """The built-in trainer `spec.trainer`, bound to `spec.config` (validated here, once)."""
    trainer = REGISTRY.get(spec.trainer)
    if trainer is None:
        raise ValueError(f"trainer {spec.trainer!r} is not a built-in trainer ({', '.join(REGISTRY)})")
    return trainer(trainer.config_type.model_validate(spec.config))


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float = MIN_LR_RATIO) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based): linear warmup, then cosine.

    Step 0 gets 1/warmup_steps, step warmup_steps - 1 the full LR, and the decay reaches `min_ratio`
    at `max_steps`.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _constant(step: int) -> float:
    return 1.0


# -- column checks (on the driver, before any worker starts) ------------------------------------------


def require_column(schema: pa.Schema, *, uri: str, name: str, want: str, ok: Any) -> None:
    if name not in schema.names:
        raise DatasetError(f"dataset {uri} has no column {name!r} (columns: {', '.join(schema.names)})")
    data_type = schema.field(name).type
    if not ok(data_type):
        raise DatasetError(f"dataset {uri}: column {name!r} must be {want}, got {data_type}")


def require_list_column(schema: pa.Schema, *, uri: str, name: str, of: str, ok: Any) -> None:
    """`name` must be a list column whose values pass `ok` (described by `of`)."""

    def list_ok(data_type: pa.DataType) -> bool:
        return is_list_type(data_type) and bool(ok(data_type.value_type))

    require_column(schema, uri=uri, name=name, want=f"a list of {of}", ok=list_ok)


def first_row_length(first_row: pa.Table, *, uri: str, name: str) -> int:
    first = first_row.column(name)[0]
    if not first.is_valid:
        raise DatasetError(f"dataset {uri}: the first row of {name!r} is null")
    return len(first)


# -- collate functions (on the workers): Arrow batches -> tensors ---------------------------------------


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


class MLPCollate:
    """`features` -> float32 [B, input_size]; `label` -> int64 [B] (classification) or float32 [B]."""

    def __init__(self, *, input_size: int, config: MLPConfig, uri: str) -> None:
        self.input_size = input_size
        self.config = config
        self.uri = uri

    def __call__(self, batch: pa.Table) -> dict[str, torch.Tensor]:
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


class GPTCollate:
    """`tokens` -> int64 [B, seq_len], checked against the vocabulary."""

    def __init__(self, *, seq_len: int, vocab_size: int, uri: str) -> None:
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.uri = uri

    def __call__(self, batch: pa.Table) -> dict[str, torch.Tensor]:
        import torch

        tokens = _fixed_width(batch.column("tokens"), width=self.seq_len, name="tokens", uri=self.uri)
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise DatasetError(
                f"dataset {self.uri}: token ids must be in [0, vocab_size={self.vocab_size}), "
                f"found {tokens.min()}..{tokens.max()}"
            )
        return {"tokens": torch.tensor(tokens, dtype=torch.int64)}
