"""The built-in trainers as recipes (`trainers.recipe`): `mlp` is `MLPRecipe`, `gpt` is `GPTRecipe`.

They go through exactly the path of any `trainer: package.module:ClassName`; their config schemas are
`service.contract.spec.BUILTIN_CONFIGS`, so that the API also checks a built-in's `config` at
submission without importing this module.

- `mlp`: rows of `features` (a list of numbers, the same length in every row; its length is the
  model's input size) and `label` (an integer class for classification, a number for regression).
  A multilayer perceptron (`trainers.models.MLP`): cross-entropy over `num_classes` logits, or MSE on
  one output. Adam at a constant `lr`; gradients are measured, not clipped.
- `gpt`: rows of `tokens` (integer ids, the same length L >= 2 in every row). A small decoder-only
  transformer (`trainers.models.GPT`) reads `tokens[:, :-1]` and predicts `tokens[:, 1:]`, so its
  context is L - 1. AdamW (weight decay on matrices only), linear warmup over `warmup_steps`, then
  cosine decay to `MIN_LR_RATIO` of `lr` at `max_steps`; gradients clipped to `grad_clip`.
  `GPTRecipe.check_columns` and `GPTCollate` read the token parquet format for any causal LM recipe.

This module imports no torch at module level: the job's driver imports it for the column checks and
the config schema, and only the workers, which build models and tensors, import torch (inside the
methods that need it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from service.contract.errors import DatasetError
from service.contract.spec import GPTConfig, MLPConfig
from service.contract.storage import is_number_type
from trainers.recipe import (
    Collate,
    Recipe,
    RowShape,
    first_row_length,
    require_column,
    require_list_column,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

# Cosine decay ends at this fraction of the peak learning rate.
MIN_LR_RATIO = 0.1


class MLPRecipe(Recipe[MLPConfig]):
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


class GPTRecipe(Recipe[GPTConfig]):
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


# -- collate functions (on the workers): Arrow batches -> tensors ---------------------------------------


def fixed_width(column: pa.ChunkedArray, *, width: int, name: str, uri: str) -> np.ndarray:
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

        features = fixed_width(batch.column("features"), width=self.input_size, name="features", uri=self.uri)
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

        tokens = fixed_width(batch.column("tokens"), width=self.seq_len, name="tokens", uri=self.uri)
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise DatasetError(
                f"dataset {self.uri}: token ids must be in [0, vocab_size={self.vocab_size}), "
                f"found {tokens.min()}..{tokens.max()}"
            )
        return {"tokens": torch.tensor(tokens, dtype=torch.int64)}
