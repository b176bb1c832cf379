from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.storage import checkpoint_uri
from trainers.checkpoint import (
    STATE_FILE,
    build_model_from_checkpoint,
    capture_rng_state,
    checkpoint_dir_name,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from trainers.models import build_model, build_optimizer, compute_loss


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_round_trip_restores_training_state(synthetic: Any, tmp_path: Path) -> None:
    config = {"vocab_size": 20, "d_model": 16, "n_layers": 1, "n_heads": 2, "warmup_steps": 2}
    spec = synthetic.make_spec(trainer="gpt", dataset="file:///unused", config=config, max_steps=10)
    row_shape = {"seq_len": 9}
    model = build_model(spec, row_shape=row_shape)
    optimizer, scheduler = build_optimizer(model, spec=spec)
    for _ in range(3):
        loss = compute_loss(model, {"tokens": torch.randint(0, 20, (4, 9))}, spec=spec)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    rng = capture_rng_state()
    expected_draws = draws()

    wrote = save_checkpoint(
        tmp_path,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        spec=spec,
        row_shape=row_shape,
        step=3,
        epoch=1,
        batches_in_epoch=2,
        samples_consumed=24,
        rng=[rng, rng],
    )
    assert wrote and (tmp_path / STATE_FILE).is_file()

    state = load_checkpoint(tmp_path)  # weights_only=True: plain containers and tensors only
    assert (state["step"], state["epoch"], state["batches_in_epoch"], state["samples_consumed"]) == (
        3,
        1,
        2,
        24,
    )
    assert state["trainer"] == "gpt"
    assert state["spec"]["config"]["vocab_size"] == 20
    assert state["world_size"] == 2
    assert state["model_format"] == "full"
    assert not any(key.startswith("module.") for key in state["model"])

    fresh = build_model(spec, row_shape=row_shape)
    fresh.load_state_dict(state["model"])
    fresh_optimizer, fresh_scheduler = build_optimizer(fresh, spec=spec)
    fresh_optimizer.load_state_dict(state["optimizer"])
    fresh_scheduler.load_state_dict(state["scheduler"])
    assert fresh_scheduler.last_epoch == 3
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )

    restore_rng_state(state["rng"][1])
    assert draws() == expected_draws

    rebuilt = build_model_from_checkpoint(tmp_path)
    tokens = torch.randint(0, 20, (2, 8))
    assert not rebuilt.training
    assert torch.equal(rebuilt(tokens), model.eval()(tokens))


def test_mlp_checkpoint_rebuilds_with_input_size(synthetic: Any, tmp_path: Path) -> None:
    spec = synthetic.make_spec(trainer="mlp", dataset="file:///unused", config={"num_classes": 4})
    model = build_model(spec, row_shape={"input_size": 5})
    optimizer, scheduler = build_optimizer(model, spec=spec)
    save_checkpoint(
        tmp_path,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        spec=spec,
        row_shape={"input_size": 5},
        step=0,
        epoch=0,
        batches_in_epoch=0,
        samples_consumed=0,
        rng=[capture_rng_state()],
    )
    assert build_model_from_checkpoint(tmp_path)(torch.randn(3, 5)).shape == (3, 4)


def test_load_refuses_a_folder_without_state(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not an Apiary checkpoint"):
        load_checkpoint(tmp_path)


def test_checkpoint_names_and_uris() -> None:
    assert checkpoint_dir_name(30) == "checkpoint_00000030"
    name = checkpoint_dir_name(10)
    assert (
        checkpoint_uri(storage_uri="/data/ckpt", run_name="job-1", name=name)
        == "file:///data/ckpt/job-1/checkpoint_00000010"
    )
    assert (
        checkpoint_uri(storage_uri="file:///data/ckpt/", run_name="job-1", name=name)
        == "file:///data/ckpt/job-1/checkpoint_00000010"
    )
    assert (
        checkpoint_uri(storage_uri="s3://bucket/runs", run_name="job-1", name=name)
        == "s3://bucket/runs/job-1/checkpoint_00000010"
    )
