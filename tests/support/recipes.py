"""Recipes as a user would write them (`trainer: tests.support.recipes:CountingLM`), on the token parquet
format of the built-in `gpt` (its collate is reused), and the examples' recipes paced for tests."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from examples.hf_gpt2.hf_gpt2 import GPT2LM
from trainers.recipe import Collate, Recipe, RowShape, first_row_length, require_list_column
from trainers.recipes import GPTCollate


class CountingLMConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(ge=2)
    width: int = Field(default=16, ge=1)
    lr: float = Field(default=1e-2, gt=0)


class CountingLM(Recipe[CountingLMConfig]):
    """A bigram model (embedding, then a linear head) that also counts the training batches it took:
    the count is its own state (saved in checkpoints) and a metric of every step, with the accuracy."""

    config_type = CountingLMConfig
    read_columns = ("tokens",)

    def __init__(self, config: CountingLMConfig) -> None:
        super().__init__(config)
        self.batches_seen = 0

    def check_columns(self, schema: pa.Schema, first_row: pa.Table, *, uri: str) -> RowShape:
        require_list_column(schema, uri=uri, name="tokens", of="integer ids", ok=pa.types.is_integer)
        return {"seq_len": first_row_length(first_row, uri=uri, name="tokens")}

    def build_collate(self, row_shape: RowShape, *, uri: str) -> Collate:
        return GPTCollate(seq_len=row_shape["seq_len"], vocab_size=self.config.vocab_size, uri=uri)

    def build_model(self, row_shape: RowShape) -> nn.Module:
        return nn.Sequential(
            nn.Embedding(self.config.vocab_size, self.config.width),
            nn.Linear(self.config.width, self.config.vocab_size),
        )

    def loss(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        targets = tokens[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if model.training:
            self.batches_seen += 1
        accuracy = (logits.argmax(-1) == targets).float().mean()
        return loss, {"accuracy": accuracy, "batches_seen": float(self.batches_seen)}

    def evaluate(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor | float]:
        # The loss and its metrics, and what the batch holds: the same batches every eval, the same sum.
        return {**super().evaluate(model, batch), "token_sum": float(batch["tokens"].sum())}

    def build_optimizer(
        self, model: nn.Module, *, max_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        optimizer = torch.optim.SGD(model.parameters(), lr=self.config.lr)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _constant)

    def state_dict(self) -> dict[str, Any]:
        return {"batches_seen": self.batches_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches_seen = int(state["batches_seen"])


def _constant(step: int) -> float:
    return 1.0


class NotARecipe:
    """A class that is not a `Recipe`: the driver refuses it."""


class PacedGPT2LM(GPT2LM):
    """The Hugging Face GPT-2 example (`examples/hf_gpt2`), at most 20 steps a second: a test's
    disturbance lands mid-run on any machine. The pause changes no number."""

    def loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(0.05)
        return super().loss(model, batch)
