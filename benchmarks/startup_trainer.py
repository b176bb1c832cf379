"""A custom trainer for `benchmarks/overhead.py`: how fast a user's own train function starts.

Written as a user would (`trainer: "benchmarks.startup_trainer:train"`): Ray Train's
`prepare_model` (DDP), the dataset through `ray.train.get_dataset_shard("train")`, a next-token
model on the benchmark's token rows. It trains `max_steps` steps and records the end of step 1 as a
start-up mark (`trainers.startup`), which Apiary's wrapper cannot see from outside the function.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
from torch import nn

from service.contract.protocol import LaunchRequest
from trainers import startup


def train(loop_config: dict[str, Any]) -> None:
    spec = LaunchRequest.model_validate(loop_config["request"]).spec
    vocab, width = int(spec.config["vocab_size"]), int(spec.config["d_model"])
    torch.manual_seed(spec.seed)
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, vocab)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shard = ray.train.get_dataset_shard("train")
    rank = ray.train.get_context().get_world_rank()
    step = 0
    while step < spec.max_steps:
        for batch in shard.iter_batches(batch_size=spec.batch_size, batch_format="numpy"):
            tokens = torch.from_numpy(np.stack(batch["tokens"]).astype(np.int64))
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if startup.mark("step_1_done"):
                startup.emit(f"rank {rank}")
            if step == spec.max_steps:
                break
