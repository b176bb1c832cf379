"""DDP/FSDP wrapping, precision and sharded checkpoints, on real gloo process groups (no Ray).

Each multi-rank case spawns plain `torch.distributed` processes (a few seconds of torch import each),
which shows the same code Ray Train runs without a cluster's start-up cost.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from service.contract.spec import FsdpSpec, FsdpUnits, JobSpec, Strategy
from trainers.checkpoint import (
    SHARDED_DIR,
    STATE_FILE,
    TrainParts,
    TrainState,
    build_model_from_checkpoint,
    capture_rng_state,
    load_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from trainers.models import GPT
from trainers.parallel import (
    AUTO_ONE_UNIT_MAX_BYTES,
    autocast,
    clip_grad_norm,
    fsdp_units,
    is_sharded,
    parallelize,
)
from trainers.recipe import recipe_for

GPT_CONFIG = {"vocab_size": 24, "d_model": 16, "n_layers": 2, "n_heads": 2, "warmup_steps": 2, "lr": 1e-2}
ROW_SHAPE = {"seq_len": 9}
CPU = torch.device("cpu")


def gpt_spec(**fields: Any) -> JobSpec:
    values: dict[str, Any] = {
        "name": "parallel",
        "trainer": "gpt",
        "num_workers": 2,
        "dataset": {"uri": "file:///unused"},
        "max_steps": 20,
        "batch_size": 4,
        "config": GPT_CONFIG,
        **fields,
    }
    return JobSpec.model_validate(values)


def batch_for(step: int, *, rank: int, world_size: int, rows: int = 8) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of a fixed global batch of step `step` (the same whatever the world size)."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, GPT_CONFIG["vocab_size"], (rows, 1), generator=generator)
    tokens = (starts + torch.arange(ROW_SHAPE["seq_len"])) % GPT_CONFIG["vocab_size"]
    return {"tokens": tokens.chunk(world_size)[rank]}


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer as full (unsharded) CPU tensors keyed by parameter name; a collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state}


def _worker(rank: int, world_size: int, task: str, folder: str, spec_json: dict[str, Any]) -> None:
    dist.init_process_group(
        "gloo", init_method=Path(folder, f"rendezvous-{task}").as_uri(), rank=rank, world_size=world_size
    )
    try:
        _run_task(rank, world_size, task, folder, spec_json)
    finally:
        dist.destroy_process_group()
    # A rank that got here did its part: leave without interpreter finalization. After FSDP2 the gloo
    # group outlives destroy_process_group (something still references it), and a gloo thread that
    # drops its last all-gather's tensors needs the GIL; if Python is already finalizing, that thread
    # is made to exit inside C++ and the process aborts ("terminate called without an active
    # exception", about 1 run in 15 here, seen in a gdb core). Ray Train's workers never finalize:
    # their actors are killed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_parts(spec: JobSpec, *, wrap: bool) -> TrainParts:
    """Model (wrapped for `spec.strategy` over the process group), optimizer and LR schedule."""
    trainer = recipe_for(spec)
    model = trainer.build_model(ROW_SHAPE)
    if wrap:
        model = parallelize(model, strategy=spec.strategy, device=CPU)
    optimizer, lr_schedule = trainer.build_optimizer(model, max_steps=spec.max_steps)
    return TrainParts(model=model, optimizer=optimizer, lr_schedule=lr_schedule)


def _run_task(rank: int, world_size: int, task: str, folder: str, spec_json: dict[str, Any]) -> None:
    spec = JobSpec.model_validate(spec_json)
    trainer = recipe_for(spec)
    torch.manual_seed(spec.seed)
    parts = build_parts(spec, wrap=True)
    model, optimizer = parts.model, parts.optimizer
    assert is_sharded(model) == (spec.strategy is Strategy.FSDP)
    checkpoint = Path(folder, "checkpoint")
    step = 0
    if task == "train":
        for step in range(1, 4):
            with autocast(spec.precision, device=CPU):
                loss = trainer.loss(model, batch_for(step, rank=rank, world_size=world_size))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            clip_grad_norm(model, max_norm=1.0)
            optimizer.step()
            parts.lr_schedule.step()
        rng = [capture_rng_state()] * world_size
        # As under Ray Train: each rank writes into its own folder, the folders are merged after.
        own = Path(folder, f"rank-{rank}")
        own.mkdir()
        state = TrainState(step=step, batches_in_epoch=step, samples_consumed=step * 8)
        wrote = save_checkpoint(own, parts, state, spec=spec, row_shape=ROW_SHAPE, rng=rng, rank=rank)
        assert wrote == (rank == 0 or is_sharded(model))
    else:
        step = restore_checkpoint(checkpoint, parts)["step"]
    full = full_state(model, optimizer)
    if rank == 0:
        torch.save({"step": step, "lr": parts.lr_schedule.get_last_lr(), **full}, Path(folder, f"{task}.pt"))


def spawn(world_size: int, *, task: str, folder: Path, spec: JobSpec) -> dict[str, Any]:
    mp.start_processes(
        _worker,
        args=(world_size, task, str(folder), spec.model_dump(mode="json")),
        nprocs=world_size,
        start_method="spawn",
    )
    result: dict[str, Any] = torch.load(folder / f"{task}.pt", weights_only=True)
    return result


def merge_rank_folders(folder: Path) -> Path:
    """What Ray Train does with the folders every rank reported under one checkpoint name."""
    merged = folder / "checkpoint"
    for own in sorted(folder.glob("rank-*")):
        for path in own.rglob("*"):
            if path.is_file():
                target = merged / path.relative_to(own)
                target.parent.mkdir(parents=True, exist_ok=True)
                path.rename(target)
    return merged


def assert_states_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_states_equal(actual[key], value)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


@pytest.mark.timeout(300)
def test_fsdp_checkpoint_of_two_ranks_resumes_on_one_and_three(tmp_path: Path) -> None:
    spec = gpt_spec(strategy="fsdp")
    written = spawn(2, task="train", folder=tmp_path, spec=spec)
    checkpoint = merge_rank_folders(tmp_path)
    assert {p.name for p in (checkpoint / SHARDED_DIR).iterdir()} == {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    }
    state = load_checkpoint(checkpoint)
    assert state["model_format"] == "sharded" and "model" not in state and "optimizer" not in state
    assert state["step"] == 3 and state["world_size"] == 2
    # The optimizer really has moments to restore (three AdamW steps were taken).
    assert written["optimizer"]["state"]["blocks.0.attn.qkv.weight"]["exp_avg"].abs().sum() > 0

    for world_size in (1, 3):
        resumed = spawn(world_size, task=f"resume{world_size}", folder=tmp_path, spec=spec)
        assert resumed["step"] == 3
        assert resumed["lr"] == pytest.approx(written["lr"])
        assert_states_equal(resumed["model"], written["model"])
        assert_states_equal(resumed["optimizer"], written["optimizer"])

    # One process, no process group: the shards gather into a plain model for evaluation.
    model = build_model_from_checkpoint(checkpoint)
    assert_states_equal(model.state_dict(), written["model"])


@pytest.mark.timeout(300)
def test_ddp_checkpoint_is_one_full_state_file(tmp_path: Path) -> None:
    spec = gpt_spec(strategy="ddp")
    written = spawn(2, task="train", folder=tmp_path, spec=spec)
    checkpoint = merge_rank_folders(tmp_path)
    assert [p.name for p in checkpoint.iterdir()] == [STATE_FILE]
    assert load_checkpoint(checkpoint)["model_format"] == "full"
    resumed = spawn(1, task="resume1", folder=tmp_path, spec=spec)
    assert_states_equal(resumed["model"], written["model"])
    assert_states_equal(build_model_from_checkpoint(checkpoint).state_dict(), written["model"])


def test_full_checkpoint_refuses_an_fsdp_model(tmp_path: Path) -> None:
    spec = gpt_spec()
    state = TrainState(step=1, batches_in_epoch=1, samples_consumed=4)
    save_checkpoint(
        tmp_path,
        build_parts(spec, wrap=False),
        state,
        spec=spec,
        row_shape=ROW_SHAPE,
        rng=[capture_rng_state()],
    )
    with world_of_one():
        sharded = build_parts(spec.model_copy(update={"strategy": Strategy.FSDP}), wrap=True)
        assert is_sharded(sharded.model)
        with pytest.raises(ValueError, match="resume it with that strategy"):
            restore_checkpoint(tmp_path, sharded)


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """A gloo process group of this process alone (what Ray Train gives a job of one worker)."""
    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=Path(folder, "rendezvous").as_uri(), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_fsdp_units_auto_is_one_unit_for_a_small_model_on_cpu_and_one_per_block_otherwise() -> None:
    # gloo on CPU cannot overlap collectives with compute: one unit has the fewest, which pays for a
    # small model and not for a large one (benchmarks/fsdp_speed.py).
    small, large = 13 * 2**20, AUTO_ONE_UNIT_MAX_BYTES + 1
    assert fsdp_units(FsdpSpec(), device=CPU, param_bytes=small) is FsdpUnits.MODEL
    assert fsdp_units(FsdpSpec(), device=CPU, param_bytes=large) is FsdpUnits.BLOCKS
    assert fsdp_units(FsdpSpec(), device=torch.device("cuda", 0), param_bytes=small) is FsdpUnits.BLOCKS
    for units in (FsdpUnits.BLOCKS, FsdpUnits.MODEL):
        for device in (CPU, torch.device("cuda", 0)):
            assert fsdp_units(FsdpSpec(units=units), device=device, param_bytes=large) is units


def test_fsdp_shards_nothing_for_one_worker_and_its_options_shape_the_units() -> None:
    def gpt() -> torch.nn.Module:
        torch.manual_seed(0)
        return recipe_for(gpt_spec()).build_model(ROW_SHAPE)

    def as_gpt(model: torch.nn.Module) -> GPT:
        assert isinstance(model, GPT)  # fully_shard keeps the class (it subclasses it)
        return model

    def gathered(module: torch.nn.Module) -> bool:
        """True when the module's registered parameters are the full ones (not DTensor shards)."""
        return not any(isinstance(p, DTensor) for p in module.parameters())

    fsdp_module = FSDPModule
    tokens = batch_for(0, rank=0, world_size=1)["tokens"][:, :-1]
    with world_of_one():
        # A job that never has more than one worker: nothing to shard, nothing to pay for it.
        alone = parallelize(gpt(), strategy=Strategy.FSDP, device=CPU, max_workers=1)
        assert not is_sharded(alone)
        # An elastic job at one worker is sharded still: its checkpoints keep one layout. The
        # defaults on CPU (units auto): one unit, so the blocks are plain modules inside the root's.
        grows = as_gpt(parallelize(gpt(), strategy=Strategy.FSDP, device=CPU, max_workers=2))
        assert is_sharded(grows) and not any(isinstance(b, fsdp_module) for b in grows.blocks)
        # The root keeps its gathered parameters from forward to backward (backward needs them first),
        # whatever reshard_after_forward says; backward shards them again.
        grows(tokens).sum().backward()
        assert not gathered(grows)
        grows(tokens)
        assert gathered(grows)

        # units: blocks, one unit per block then the root; with reshard_after_forward (the default) a
        # block's full parameters are freed after its forward, and with false they stay until backward.
        for reshard in (True, False):
            blocks = as_gpt(
                parallelize(
                    gpt(),
                    strategy=Strategy.FSDP,
                    device=CPU,
                    fsdp=FsdpSpec(units=FsdpUnits.BLOCKS, reshard_after_forward=reshard),
                    max_workers=2,
                )
            )
            assert all(isinstance(b, fsdp_module) for b in blocks.blocks)
            blocks(tokens)
            assert gathered(blocks.blocks[0]) is not reshard and gathered(blocks.ln_f)

        # bf16 as FSDP2's mixed precision: bf16 compute, fp32 output for the loss, fp32 shards kept;
        # autocast stands aside for a sharded model.
        spec = gpt_spec(strategy="fsdp", precision="bf16")
        trainer = recipe_for(spec)
        model = parallelize(gpt(), strategy=Strategy.FSDP, device=CPU, precision="bf16", max_workers=2)
        optimizer, _ = trainer.build_optimizer(model, max_steps=spec.max_steps)
        tokens = batch_for(0, rank=0, world_size=1)["tokens"]
        seen: list[torch.dtype] = []
        handle = model.blocks[0].attn.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        losses = []
        for step in range(30):
            with autocast(spec.precision, device=CPU, model=model):
                assert not torch.is_autocast_enabled("cpu")
                logits = model(tokens[:, :-1])
                loss = trainer.loss(model, batch_for(step % 4, rank=0, world_size=1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        handle.remove()
        assert logits.dtype == torch.float32 and seen[0] == torch.bfloat16
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the shards stay fp32
        assert losses[-1] < losses[0] - 1.0, losses


def test_bf16_autocast_trains_on_cpu() -> None:
    spec = gpt_spec(precision="bf16", num_workers=1)
    trainer = recipe_for(spec)
    torch.manual_seed(0)
    parts = build_parts(spec, wrap=False)
    model, optimizer = parts.model, parts.optimizer
    losses = []
    for step in range(40):
        with autocast(spec.precision, device=CPU):
            logits = model(batch_for(step % 4, rank=0, world_size=1)["tokens"][:, :-1])
            assert logits.dtype == torch.bfloat16  # the matmuls really ran in bf16
            loss = trainer.loss(model, batch_for(step % 4, rank=0, world_size=1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(model, max_norm=1.0)
        optimizer.step()
        parts.lr_schedule.step()
        losses.append(loss.item())
    assert next(model.parameters()).dtype == torch.float32  # master weights stay fp32
    assert losses[-1] < losses[0] - 1.0, losses


def test_precision_must_be_known() -> None:
    with pytest.raises(ValueError, match="precision"), autocast("fp16", device=CPU):
        pass


def test_without_a_process_group_the_model_is_only_moved() -> None:
    model = recipe_for(gpt_spec()).build_model(ROW_SHAPE)
    assert parallelize(model, strategy=Strategy.DDP, device=CPU) is model
    assert parallelize(model, strategy=Strategy.FSDP, device=CPU) is model
