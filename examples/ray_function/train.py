"""A Ray Train function, written as Ray Train's documentation writes one, run by Apiary unchanged.

A small regression model on data it makes itself (no dataset in the spec): each worker draws its own
batches from a seeded generator, `prepare_model` wraps the model for DDP, every epoch ends with one
`ray.train.report` of the epoch's loss and a checkpoint that rank 0 writes, and a restarted, recovered
or preempted run picks up at the epoch after its checkpoint (`ray.train.get_checkpoint()`).

    apiary submit examples/ray_function/job.yaml --watch

Outside Apiary it is a plain Ray Train script: `python examples/ray_function/train.py` runs it with
Ray's `TorchTrainer` on a local Ray.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import ray.train
import ray.train.torch
import torch
from torch import nn


def train_func(config: dict[str, Any]) -> None:
    rank = ray.train.get_context().get_world_rank()
    model = nn.Sequential(
        nn.Linear(8, config.get("hidden", 32)), nn.ReLU(), nn.Linear(config.get("hidden", 32), 1)
    )
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.05))

    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
        getattr(model, "module", model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1

    # The data: y = x . w + noise, drawn per worker and epoch from the seed (the same on every run).
    true_weights = torch.linspace(-1.0, 1.0, 8)
    for epoch in range(start_epoch, config.get("epochs", 10)):
        generator = torch.Generator().manual_seed(config.get("seed", 0) * 1000 + epoch * 100 + rank)
        total = 0.0
        for _ in range(config.get("steps_per_epoch", 20)):
            x = torch.randn(config.get("batch_size", 32), 8, generator=generator)
            y = (x @ true_weights + 0.01 * torch.randn(x.shape[0], generator=generator)).unsqueeze(1)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        metrics = {"loss": total / config.get("steps_per_epoch", 20), "epoch": epoch}

        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if rank == 0:  # one copy of the DDP model is enough
                state = {
                    "model": getattr(model, "module", model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                }
                torch.save(state, os.path.join(folder, "checkpoint.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=checkpoint)


if __name__ == "__main__":
    from ray.train.torch import TorchTrainer

    result = TorchTrainer(
        train_func,
        train_loop_config={"epochs": 5},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
    ).fit()
    print(result.metrics)
