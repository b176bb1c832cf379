"""Models, losses and optimizers of the built-in trainers.

Built-in trainers (`JobSpec.trainer`):

- `mlp`: a multilayer perceptron over `features` (its input size is read from the data by the
  driver). Classification (`num_classes` logits, cross-entropy) or regression (one output, MSE).
  Optimizer: Adam at a constant `lr`.
- `gpt`: a small decoder-only causal transformer language model (nanoGPT shape): token and
  position embeddings, pre-LayerNorm blocks of causal self-attention
  (`F.scaled_dot_product_attention`) and a 4x MLP, a final LayerNorm and an LM head tied to the
  token embedding. Rows hold `tokens` of a fixed length L; the model reads `tokens[:, :-1]` and
  predicts `tokens[:, 1:]`, so its context is L - 1. Optimizer: AdamW (weight decay on matrices
  only), linear warmup over `warmup_steps`, then cosine decay to 10% of `lr` at `max_steps`,
  gradients clipped to `grad_clip`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from service.spec import GPTConfig, JobSpec, MLPConfig

# Cosine decay ends at this fraction of the peak learning rate.
MIN_LR_RATIO = 0.1


class MLP(nn.Module):
    def __init__(self, *, input_size: int, hidden_sizes: list[int], output_size: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = input_size
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, output_size))
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim], the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(batch, seq, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, *, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Weight tying: the output projection reuses the input embedding (fewer parameters, better LM).
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by depth so the residual stream's variance stays put.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> next-token logits [B, T, vocab_size]."""
        seq = idx.shape[1]
        if seq > self.block_size:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's context {self.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(spec: JobSpec, *, row_shape: dict[str, int]) -> nn.Module:
    """The built-in model of `spec.trainer`, sized by its config and the data's row shape."""
    config = spec.trainer_config()
    if isinstance(config, MLPConfig):
        output_size = config.num_classes if config.task == "classification" else 1
        assert output_size is not None  # MLPConfig requires num_classes for classification
        return MLP(
            input_size=row_shape["input_size"], hidden_sizes=config.hidden_sizes, output_size=output_size
        )
    if isinstance(config, GPTConfig):
        return GPT(config, block_size=row_shape["seq_len"] - 1)
    raise ValueError(f"trainer {spec.trainer!r} is not a built-in trainer")


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor], *, spec: JobSpec) -> torch.Tensor:
    config = spec.trainer_config()
    if isinstance(config, MLPConfig):
        output = model(batch["features"])
        if config.task == "classification":
            return F.cross_entropy(output, batch["label"])
        return F.mse_loss(output.squeeze(-1), batch["label"])
    if isinstance(config, GPTConfig):
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    raise ValueError(f"trainer {spec.trainer!r} is not a built-in trainer")


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


def build_optimizer(
    model: nn.Module, *, spec: JobSpec
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Optimizer and per-step LR schedule of a built-in trainer (call after the model is on its device)."""
    config = spec.trainer_config()
    schedule: Callable[[int], float]
    if isinstance(config, MLPConfig):
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        schedule = _constant
    elif isinstance(config, GPTConfig):
        # Decay matrices (linear and embedding weights), not biases or LayerNorm gains.
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))
        schedule = partial(lr_factor, warmup_steps=config.warmup_steps, max_steps=spec.max_steps)
    else:
        raise ValueError(f"trainer {spec.trainer!r} is not a built-in trainer")
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def grad_clip_of(spec: JobSpec) -> float | None:
    """The gradient-norm clip of a built-in trainer; None means measure the norm but do not clip."""
    config = spec.trainer_config()
    return config.grad_clip if isinstance(config, GPTConfig) else None
