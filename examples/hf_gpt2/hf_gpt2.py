"""A Hugging Face `transformers` GPT-2, built from a config (no download), as an Apiary recipe.

It reads the token parquet format of the built-in `gpt` (rows of `tokens`, a fixed-length list of
integer ids; `apiary demo` and `api.demo.token_table` write it) and trains a causal LM on it:
`tokens[:, :-1]` in, `tokens[:, 1:]` predicted, so the model's context is the rows' length - 1.
AdamW with weight decay on matrices only, linear warmup then cosine decay (the built-in `gpt`'s
schedule), gradients clipped to `grad_clip`. With `strategy: fsdp` each GPT-2 block
(`transformer.h`) is an FSDP2 unit; `precision: bf16` runs forward and backward in bfloat16.

    trainer: examples.hf_gpt2.hf_gpt2:GPT2LM      # with --code examples/hf_gpt2: hf_gpt2:GPT2LM
    config: {vocab_size: 64, n_embd: 64, n_layer: 2, n_head: 4}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from apiary import (
    Collate,
    DatasetError,
    GPTCollate,
    Recipe,
    RowShape,
    first_row_length,
    lr_factor,
    require_list_column,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


class GPT2LMConfig(BaseModel):
    """The model's size and the optimizer's settings (`config` of the job's spec)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(ge=2, description="Token ids are in [0, vocab_size).")
    n_embd: int = Field(default=64, ge=8)
    n_layer: int = Field(default=2, ge=1)
    n_head: int = Field(default=4, ge=1)
    dropout: float = Field(
        default=0.0, ge=0, lt=1, description="GPT-2's residual, embedding and attention dropout."
    )
    lr: float = Field(default=3e-4, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    warmup_steps: int = Field(default=10, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPT2LMConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class GPT2LM(Recipe[GPT2LMConfig]):
    config_type = GPT2LMConfig
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
        from transformers import GPT2Config, GPT2LMHeadModel

        config = self.config
        return GPT2LMHeadModel(
            GPT2Config(
                vocab_size=config.vocab_size,
                n_positions=row_shape["seq_len"] - 1,
                n_embd=config.n_embd,
                n_layer=config.n_layer,
                n_head=config.n_head,
                resid_pdrop=config.dropout,
                embd_pdrop=config.dropout,
                attn_pdrop=config.dropout,
                bos_token_id=None,
                eos_token_id=None,
                use_cache=False,
            )
        )

    def fsdp_blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(model.transformer.h)  # type: ignore[union-attr, arg-type]

    def loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F

        tokens = batch["tokens"]
        logits = model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def build_optimizer(
        self, model: nn.Module, *, max_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        import torch

        config = self.config
        # Decay matrices (linear and embedding weights), not biases or LayerNorm gains. GPT-2 ties its
        # head to the token embedding: parameters() lists the shared tensor once.
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
