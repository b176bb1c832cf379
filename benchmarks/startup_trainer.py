"""A custom trainer for `benchmarks/overhead.py`: how fast a user's own train function starts.

Written as a user would (`trainer: "benchmarks.startup_trainer:train"`): Ray Train's
`prepare_model` (DDP), the dataset through `ray.train.get_dataset_shard("train")`, a next-token
model on the benchmark's token rows, its sizes in `config` as Ray Train hands it over (the job's
`config`). It trains `config["max_steps"]` steps and records the end of step 1 as a
start-up mark (`trainers.startup`), which Apiary's wrapper cannot see from outside the function.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
from torch import nn

from trainers import startup


def train(config: dict[str, Any]) -> None:
    vocab, width = int(config["vocab_size"]), int(config["d_model"])
    max_steps, batch_size = int(config["max_steps"]), int(config["batch_size"])
    torch.manual_seed(int(config.get("seed", 0)))
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, vocab)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shard = ray.train.get_dataset_shard("train")
    rank = ray.train.get_context().get_world_rank()
    step = 0
    while step < max_steps:
        for batch in shard.iter_batches(batch_size=batch_size, batch_format="numpy"):
            tokens = torch.from_numpy(np.stack(batch["tokens"]).astype(np.int64))
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if startup.mark("step_1_done"):
                startup.emit(f"rank {rank}")
            if step == max_steps:
                break
