"""Checkpoint folders (`trainers.checkpoint`): what they hold, how they load, and where a run resumes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from service.contract.spec import JobSpec
from service.contract.storage import checkpoint_uri
from tests.support.jobs import make_spec
from trainers.checkpoint import (
    STATE_FILE,
    Resume,
    TrainParts,
    TrainState,
    build_model_from_checkpoint,
    capture_rng_state,
    checkpoint_dir_name,
    load_checkpoint,
    restore_checkpoint,
    restore_rng_state,
    resume_position,
    save_checkpoint,
    train_state_of,
)
from trainers.recipe import recipe_for

GPT_CONFIG = {"vocab_size": 20, "d_model": 16, "n_layers": 1, "n_heads": 2, "warmup_steps": 2}


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def build_parts(spec: JobSpec, row_shape: dict[str, int]) -> TrainParts:
    trainer = recipe_for(spec)
    model = trainer.build_model(row_shape)
    optimizer, lr_schedule = trainer.build_optimizer(model, max_steps=spec.max_steps)
    return TrainParts(model=model, optimizer=optimizer, lr_schedule=lr_schedule)


def test_round_trip_restores_training_state(tmp_path: Path) -> None:
    spec = make_spec(trainer="gpt", dataset="file:///unused", config=GPT_CONFIG, max_steps=10)
    row_shape = {"seq_len": 9}
    trainer = recipe_for(spec)
    parts = build_parts(spec, row_shape)
    for _ in range(3):
        loss = trainer.loss(parts.model, {"tokens": torch.randint(0, 20, (4, 9))})
        parts.optimizer.zero_grad()
        loss.backward()
        parts.optimizer.step()
        parts.lr_schedule.step()
    rng = capture_rng_state()
    expected_draws = draws()

    state = TrainState(step=3, epoch=1, batches_in_epoch=2, samples_consumed=24)
    wrote = save_checkpoint(tmp_path, parts, state, spec=spec, row_shape=row_shape, rng=[rng, rng])
    assert wrote and (tmp_path / STATE_FILE).is_file()

    contents = load_checkpoint(tmp_path)  # weights_only=True: plain containers and tensors only
    assert train_state_of(contents) == state
    assert contents["trainer"] == "gpt"
    assert contents["spec"]["config"]["vocab_size"] == 20
    assert contents["world_size"] == 2
    assert contents["model_format"] == "full"
    assert not any(key.startswith("module.") for key in contents["model"])

    fresh = build_parts(spec, row_shape)
    restore_checkpoint(tmp_path, fresh)
    assert fresh.lr_schedule.last_epoch == 3
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(parts.optimizer.param_groups[0]["lr"])
    assert torch.equal(
        fresh.optimizer.state_dict()["state"][0]["exp_avg"],
        parts.optimizer.state_dict()["state"][0]["exp_avg"],
    )
    tokens = torch.randint(0, 20, (2, 8))
    assert torch.equal(fresh.model.eval()(tokens), parts.model.eval()(tokens))

    restore_rng_state(contents["rng"][1])
    assert draws() == expected_draws

    rebuilt = build_model_from_checkpoint(tmp_path)
    assert not rebuilt.training
    assert torch.equal(rebuilt(tokens), parts.model.eval()(tokens))


def test_a_format_2_checkpoint_still_loads(tmp_path: Path) -> None:
    spec = make_spec(trainer="gpt", dataset="file:///unused", config=GPT_CONFIG, max_steps=10)
    parts = build_parts(spec, {"seq_len": 9})
    parts.optimizer.step()
    parts.lr_schedule.step()
    save_checkpoint(tmp_path, parts, TrainState(step=1), spec=spec, row_shape={"seq_len": 9}, rng=[])
    # Format 2 called the LR schedule's state "scheduler".
    contents = torch.load(tmp_path / STATE_FILE, weights_only=True)
    contents["format_version"] = 2
    contents["scheduler"] = contents.pop("lr_schedule")
    torch.save(contents, tmp_path / STATE_FILE)

    fresh = build_parts(spec, {"seq_len": 9})
    restore_checkpoint(tmp_path, fresh)
    assert fresh.lr_schedule.last_epoch == 1


def test_skipped_batches_round_trip_and_older_formats_have_none(tmp_path: Path) -> None:
    spec = make_spec(trainer="mlp", dataset="file:///unused", config={"num_classes": 4})
    parts = build_parts(spec, {"input_size": 5})
    state = TrainState(step=12, epoch=1, batches_in_epoch=3, samples_consumed=384)
    state.skipped_batches = [(0, 7), (1, 2)]
    save_checkpoint(tmp_path, parts, state, spec=spec, row_shape={"input_size": 5}, rng=[])
    contents = load_checkpoint(tmp_path)
    assert contents["format_version"] == 4
    assert train_state_of(contents) == state
    resumed = Resume(directory=tmp_path, contents=contents, seed=0).train_state(world_size=1)
    assert resumed.skipped_batches == [(0, 7), (1, 2)]

    # A format 3 checkpoint had no skip list: it reads as an empty one.
    raw = torch.load(tmp_path / STATE_FILE, weights_only=True)
    raw["format_version"] = 3
    del raw["skipped_batches"]
    torch.save(raw, tmp_path / STATE_FILE)
    contents = load_checkpoint(tmp_path)
    assert contents["skipped_batches"] == []
    assert train_state_of(contents) == TrainState(step=12, epoch=1, batches_in_epoch=3, samples_consumed=384)


def test_a_skipped_batch_moves_the_data_position_but_takes_no_step() -> None:
    state = TrainState(step=4, epoch=0, batches_in_epoch=4, samples_consumed=128)
    assert state.next_batch(0) == (0, 4)
    assert state.next_batch(1) == (1, 0)  # the stream rolled over: the first batch of the next epoch
    state.pass_batch(epoch=0)
    assert state == TrainState(step=4, epoch=0, batches_in_epoch=5, samples_consumed=128)
    state.pass_batch(epoch=1)
    state.advance(epoch=1, samples=32)
    assert state == TrainState(step=5, epoch=1, batches_in_epoch=2, samples_consumed=160)


def test_mlp_checkpoint_rebuilds_with_input_size(tmp_path: Path) -> None:
    spec = make_spec(trainer="mlp", dataset="file:///unused", config={"num_classes": 4})
    parts = build_parts(spec, {"input_size": 5})
    save_checkpoint(
        tmp_path, parts, TrainState(), spec=spec, row_shape={"input_size": 5}, rng=[capture_rng_state()]
    )
    assert build_model_from_checkpoint(tmp_path)(torch.randn(3, 5)).shape == (3, 4)


def test_train_state_counts_steps_and_restarts_the_position_with_each_epoch() -> None:
    state = TrainState()
    for epoch in (0, 0, 0, 1, 1):
        state.advance(epoch=epoch, samples=32)
    assert state == TrainState(step=5, epoch=1, batches_in_epoch=2, samples_consumed=160)
    assert state.data_position(batch_size=16).sample == 32


def test_resume_position_keeps_the_epoch_unless_the_world_size_changed() -> None:
    assert resume_position(epoch=2, batches_in_epoch=5, saved_world_size=2, world_size=2) == (2, 5)
    assert resume_position(epoch=2, batches_in_epoch=5, saved_world_size=2, world_size=4) == (3, 0)
    contents = {"step": 9, "epoch": 2, "batches_in_epoch": 5, "samples_consumed": 288, "world_size": 2}
    resume = Resume(directory=Path("/unused"), contents=contents, seed=0)
    assert resume.train_state(world_size=2) == TrainState(
        step=9, epoch=2, batches_in_epoch=5, samples_consumed=288
    )
    assert resume.train_state(world_size=3) == TrainState(
        step=9, epoch=3, batches_in_epoch=0, samples_consumed=288
    )


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
