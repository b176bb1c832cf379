"""An image classifier from Hugging Face `transformers` (its ViT, built from a config without weights), as
an Apiary recipe on an image parquet dataset: rows of `image` (PNG or JPEG bytes, all of one size) and
`label` (an integer class). `make_images.py` writes a synthetic one.

The images are decoded with Pillow on the workers, scaled to [-1, 1] per channel, and fed to
`ViTForImageClassification` (patches of `patch_size` pixels, so the images' sides must be multiples
of it). Cross-entropy over `num_classes`, with the batch's accuracy as a metric of every step (and,
with `eval`, `eval_accuracy`); AdamW with linear warmup and cosine decay. With `strategy: fsdp` each
transformer layer (`vit.layers`) is an FSDP2 unit.

    trainer: examples.hf_image.hf_vit:ViTClassifier   # with --code examples/hf_image: hf_vit:ViTClassifier
    config: {num_classes: 4, patch_size: 8, hidden_size: 64, num_layers: 2, num_heads: 4}
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from apiary import Collate, DatasetError, Recipe, RowShape, lr_factor, require_column

if TYPE_CHECKING:
    import torch
    from torch import nn


class ViTClassifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_classes: int = Field(ge=2)
    patch_size: int = Field(default=8, ge=1)
    hidden_size: int = Field(default=64, ge=8)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=4, ge=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.05, ge=0)
    warmup_steps: int = Field(default=10, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ViTClassifierConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        return self


def decode(image: bytes) -> np.ndarray:
    """PNG or JPEG bytes -> uint8 [height, width, channels] (RGB, or one channel for grey)."""
    from PIL import Image

    with Image.open(io.BytesIO(image)) as opened:
        pixels = np.asarray(opened.convert("L" if opened.mode in ("L", "I", "F") else "RGB"))
    return pixels[..., None] if pixels.ndim == 2 else pixels


class ImageCollate:
    """`image` -> float32 [B, channels, height, width] in [-1, 1]; `label` -> int64 [B], checked."""

    def __init__(self, *, height: int, width: int, channels: int, num_classes: int, uri: str) -> None:
        self.shape = (height, width, channels)
        self.num_classes = num_classes
        self.uri = uri

    def __call__(self, batch: pa.Table) -> dict[str, torch.Tensor]:
        import torch

        images = [decode(image) for image in batch.column("image").to_pylist()]
        wrong = next((image.shape for image in images if image.shape != self.shape), None)
        if wrong is not None:
            raise DatasetError(
                f"dataset {self.uri}: an image is {wrong} (height, width, channels), not {self.shape}"
            )
        labels = batch.column("label").to_numpy()
        if labels.min() < 0 or labels.max() >= self.num_classes:
            bad = labels[(labels < 0) | (labels >= self.num_classes)][0]
            raise DatasetError(
                f"dataset {self.uri}: label {bad} is outside [0, num_classes={self.num_classes})"
            )
        pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        return {"pixels": pixels.contiguous(), "label": torch.tensor(labels, dtype=torch.int64)}


class ViTClassifier(Recipe[ViTClassifierConfig]):
    config_type = ViTClassifierConfig
    read_columns = ("image", "label")

    def check_columns(self, schema: pa.Schema, first_row: pa.Table, *, uri: str) -> RowShape:
        require_column(schema, uri=uri, name="image", want="image bytes (PNG or JPEG)", ok=pa.types.is_binary)
        require_column(schema, uri=uri, name="label", want="an integer class id", ok=pa.types.is_integer)
        first = first_row.column("image")[0].as_py()
        try:
            height, width, channels = decode(first).shape
        except Exception as err:  # Pillow raises several kinds for bytes that are no image
            raise DatasetError(f"dataset {uri}: the first row's image cannot be decoded ({err})") from err
        patch = self.config.patch_size
        if height % patch or width % patch:
            raise ValueError(
                f"config.patch_size: {patch} does not divide the images' {height}x{width} pixels ({uri})"
            )
        return {"height": height, "width": width, "channels": channels}

    def build_collate(self, row_shape: RowShape, *, uri: str) -> Collate:
        return ImageCollate(
            height=row_shape["height"],
            width=row_shape["width"],
            channels=row_shape["channels"],
            num_classes=self.config.num_classes,
            uri=uri,
        )

    def build_model(self, row_shape: RowShape) -> nn.Module:
        from transformers import ViTConfig, ViTForImageClassification

        config = self.config
        return ViTForImageClassification(
            ViTConfig(
                image_size=(row_shape["height"], row_shape["width"]),
                patch_size=config.patch_size,
                num_channels=row_shape["channels"],
                hidden_size=config.hidden_size,
                num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_heads,
                intermediate_size=4 * config.hidden_size,
                hidden_dropout_prob=config.dropout,
                attention_probs_dropout_prob=config.dropout,
                num_labels=config.num_classes,
            )
        )

    def fsdp_blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        vit = model.vit  # transformers 5 holds the layers in `vit.layers` (4 had `vit.encoder.layer`)
        layers = getattr(vit, "layers", None) or vit.encoder.layer  # type: ignore[union-attr]
        return list(layers)

    def loss(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        import torch.nn.functional as F

        logits = model(pixel_values=batch["pixels"]).logits.float()
        accuracy = (logits.argmax(-1) == batch["label"]).float().mean()
        return F.cross_entropy(logits, batch["label"]), {"accuracy": accuracy}

    def build_optimizer(
        self, model: nn.Module, *, max_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        import torch

        config = self.config
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=config.lr)
        schedule = partial(lr_factor, warmup_steps=config.warmup_steps, max_steps=max_steps)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    @property
    def grad_clip(self) -> float | None:
        return self.config.grad_clip
