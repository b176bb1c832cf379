"""Your own training loop on Apiary's training context (its Core API).

`trainer: examples.own_loop.train:train` (or `train:train` with `--code examples/own_loop`).

A classifier on rows of `features` (a list of numbers) and `label` (a class id), with a loop written
by hand: forward, loss, backward, clipping, the optimizer and its warmup. The context brings the job's
data in its resumable order, the spec's strategy and precision, metrics, checkpoints and preemption.
`config`: `hidden` (the width, default 64), `num_classes` (default 3), `lr` (default 3e-3),
`dropout` (default 0.1), `warmup_steps` (default 10).

    apiary submit examples/own_loop/job.yaml              # the module is installed with Apiary
    apiary submit job.yaml --code examples/own_loop        # or shipped: then `trainer: train:train`
"""

from __future__ import annotations

import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from apiary import TrainContext


class Classifier(nn.Module):
    def __init__(self, *, inputs: int, hidden: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(inputs, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.GELU()
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(features))


def collate(rows: pa.Table) -> dict[str, torch.Tensor]:
    """Arrow rows -> tensors (on the CPU; the context moves them to the rank's device)."""
    features = rows.column("features").combine_chunks()
    width = len(features[0]) if len(features) else 0
    return {
        "features": torch.tensor(features.flatten().to_numpy(), dtype=torch.float32).reshape(-1, width),
        "label": torch.tensor(rows.column("label").to_numpy(), dtype=torch.int64),
    }


def train(ctx: TrainContext) -> None:
    config = ctx.config
    if ctx.max_steps is None:
        raise ValueError("max_steps: this loop trains for the spec's max_steps; set it")
    batches = ctx.batches(collate, columns=["features", "label"])
    first = next(batches)  # sizes the model; it is trained on like any other batch
    model = ctx.parallelize(
        Classifier(
            inputs=first["features"].shape[1],
            hidden=config.get("hidden", 64),
            classes=config.get("num_classes", 3),
            dropout=config.get("dropout", 0.1),
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 3e-3))
    warmup = config.get("warmup_steps", 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    seen = {"correct": 0, "samples": 0}  # state of our own: checkpointed and restored with the model
    ctx.restore(model=model, optimizer=optimizer, lr_schedule=schedule, extra=seen)

    batch = first
    for step in range(ctx.step + 1, ctx.max_steps + 1):
        model.train()
        with ctx.autocast(model):
            logits = model(batch["features"])
            loss = F.cross_entropy(logits.float(), batch["label"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        schedule.step()
        seen["correct"] += int((logits.argmax(-1) == batch["label"]).sum())
        seen["samples"] += len(batch["label"])
        ctx.report(
            step,
            loss=loss,
            grad_norm=grad_norm,
            lr=schedule.get_last_lr()[0],
            running_accuracy=seen["correct"] / seen["samples"],
        )
        if ctx.should_stop():  # preempted: this step's checkpoint is complete, the job resumes from it
            return
        if step < ctx.max_steps:
            batch = next(batches)
