"""The per-worker train loop of the built-in trainers (`mlp`, `gpt`), run by Ray Train on every rank.

`trainers.launch` hands it to Ray Train (through `builtin_train_loop`); read it top to bottom:

1. Find where to start: Ray Train's latest checkpoint of this run (a restarted worker group or a
   resubmitted job) holds the step and the exact data position.
2. Open this rank's data stream from that position: it starts reading in the background at once,
   so the first batch is read while the model is built.
3. Build the model from the spec (weights from the seed alone, the same on every rank), wrap it
   for `spec.strategy` (DDP or FSDP2, `trainers.parallel`; gloo on CPU, nccl on GPU), build the
   optimizer and load the checkpoint's model, optimizer, LR schedule and RNG states into them (an
   FSDP checkpoint re-shards to this run's world size). Forward and loss run under
   `spec.precision` (bf16 = autocast).
4. Run optimizer steps until exactly `max_steps`; the loop owns the step count and starts a new
   epoch of the shard whenever one runs out.
5. Each step, record per-rank metrics (`STEP_METRICS`) with the `Reporter`.
6. Every `checkpoint.every_steps` steps and at `max_steps`, every rank calls `ray.train.report`
   (a barrier: all ranks call it the same number of times) and rank 0 attaches the checkpoint.

Data position: each rank reads its own samples in an order fixed by (seed, epoch, world size)
(`trainers.data_order`), so the checkpoint's (epoch, batches_in_epoch) is the exact position of
every rank (each consumed batches_in_epoch * batch_size samples of that epoch), and a resumed run
takes exactly the batches an uninterrupted run would have taken.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from service.spec import JobSpec, LaunchRequest
from service.storage import checkpoint_uri
from trainers.checkpoint import (
    capture_rng_state,
    checkpoint_dir_name,
    load_checkpoint,
    restore_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from trainers.data import DatasetInfo, RankBatches, build_collate, iter_batches_for_rank, resume_position
from trainers.models import build_model, build_optimizer, compute_loss, grad_clip_of
from trainers.parallel import autocast, clip_grad_norm, is_sharded, parallelize
from trainers.report import Reporter

logger = logging.getLogger(__name__)

# The values every rank records for every step, in this order.
STEP_METRICS = ("loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "data_wait_s", "epoch")
# Rank 0's progress line in the job log: step 1, then at most this often, and the last step. Each
# line travels through Ray's log monitor to the driver while the ranks hold the cores; every step's
# metrics of every rank reach the service through the Reporter anyway.
LOG_INTERVAL_S = 10.0


@dataclass(kw_only=True)
class Progress:
    """Where training stands; what a checkpoint must restore besides the tensors."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    samples_consumed: int = 0


def train_loop_per_worker(config: dict[str, Any]) -> None:
    request = LaunchRequest.model_validate(config["request"])
    dataset = DatasetInfo.from_dict(config["dataset"])
    spec = request.spec
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    _configure_logging(rank)

    started = time.perf_counter()
    progress, batches, model, optimizer, scheduler = _prepare(
        request, dataset, rank=rank, world_size=world_size
    )
    if rank == 0:
        logger.info(
            "rank 0 of %d ready in %.1f s (model built, data stream open)",
            world_size,
            time.perf_counter() - started,
        )
    device = ray.train.torch.get_device()
    grad_clip = grad_clip_of(spec) or math.inf
    last_log = -math.inf

    model.train()
    with batches, Reporter(report_url=request.report_url, attempt=request.attempt, rank=rank) as reporter:
        # 4. Exactly max_steps optimizer steps.
        while progress.step < spec.max_steps:
            step_started = time.perf_counter()
            epoch, batch = next(batches)
            data_wait_s = time.perf_counter() - step_started
            if epoch != progress.epoch:
                progress.epoch, progress.batches_in_epoch = epoch, 0

            with autocast(spec.precision, device=device):
                loss = compute_loss(model, batch, spec=spec)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            grad_norm = clip_grad_norm(model, max_norm=grad_clip)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()

            progress.step += 1
            progress.batches_in_epoch += 1
            progress.samples_consumed += spec.batch_size * world_size
            step_time_s = time.perf_counter() - step_started

            # 5. Metrics of this rank.
            values = {
                "loss": loss.item(),
                "lr": float(lr),
                "grad_norm": grad_norm.item(),
                "samples_per_s": spec.batch_size / step_time_s,
                "step_time_s": step_time_s,
                "data_wait_s": data_wait_s,
                "epoch": float(epoch),
            }
            reporter.record(progress.step, values)
            now = time.monotonic()
            if rank == 0 and (now - last_log >= LOG_INTERVAL_S or progress.step == spec.max_steps):
                last_log = now
                logger.info(
                    "step %d/%d epoch %d loss %.4f lr %.2e grad_norm %.3f %.0f samples/s (data wait %.0f%%)",
                    progress.step,
                    spec.max_steps,
                    epoch,
                    values["loss"],
                    lr,
                    values["grad_norm"],
                    values["samples_per_s"],
                    100 * data_wait_s / step_time_s,
                )

            # 6. Checkpoint.
            every = spec.checkpoint.every_steps
            if progress.step == spec.max_steps or (every is not None and progress.step % every == 0):
                _checkpoint(
                    model=model,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    request=request,
                    dataset=dataset,
                    progress=progress,
                    metrics={"step": progress.step, "samples_consumed": progress.samples_consumed, **values},
                    rank=rank,
                    reporter=reporter,
                )


def _prepare(
    request: LaunchRequest, dataset: DatasetInfo, *, rank: int, world_size: int
) -> tuple[Progress, RankBatches, nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Position, data stream (already reading), model, optimizer and schedule of this rank."""
    spec = request.spec
    # 1. Where to start: Ray Train's latest checkpoint of this run (a restarted worker group or a
    # resubmitted job) holds the step and the data position.
    checkpoint = ray.train.get_checkpoint()
    with contextlib.ExitStack() as stack, contextlib.ExitStack() as on_error:
        directory = stack.enter_context(checkpoint.as_directory()) if checkpoint is not None else None
        state = load_checkpoint(directory) if directory is not None else None
        progress = Progress()
        if state is not None:
            progress = Progress(
                step=state["step"],
                epoch=state["epoch"],
                batches_in_epoch=state["batches_in_epoch"],
                samples_consumed=state["samples_consumed"],
            )
            # Continue at the exact next sample of the same epoch (a new epoch if the world size changed).
            progress.epoch, progress.batches_in_epoch = resume_position(
                epoch=progress.epoch,
                batches_in_epoch=progress.batches_in_epoch,
                saved_world_size=state["world_size"],
                world_size=world_size,
            )

        # 2. This rank's data from that position. It starts reading now, in the background, so the
        # first batch is read while the model is built (the data order uses no global RNG).
        device = ray.train.torch.get_device()
        batches = iter_batches_for_rank(
            spec,
            dataset,
            rank=rank,
            world_size=world_size,
            collate_fn=build_collate(spec, dataset),
            start_epoch=progress.epoch,
            start_sample=progress.batches_in_epoch * spec.batch_size,
            device=device,
            s3_endpoint_url=request.s3_endpoint_url,
            data_cpus=request.data_cpus,
            trace_name=request.run_name,
        )
        on_error.callback(batches.close)

        # 3. Model, wrapped for the strategy (DDP or FSDP, trainers.parallel), and optimizer. Initial
        # weights depend on the seed only, not on the rank or world size, so a run is reproducible at
        # any scale. The optimizer is built on the wrapped model: FSDP replaces parameters by shards.
        # A checkpoint's state loads into them on every rank (an FSDP one re-sharded to this world size).
        torch.manual_seed(spec.seed)
        model = parallelize(
            build_model(spec, row_shape=dataset.row_shape), strategy=spec.strategy, device=device
        )
        optimizer, scheduler = build_optimizer(model, spec=spec)
        if state is not None and directory is not None:
            restore_checkpoint(directory, model=model, optimizer=optimizer, scheduler=scheduler, state=state)
            _restore_rng(state, spec=spec, rank=rank, world_size=world_size)
            if rank == 0:
                logger.info("resumed from step %d (epoch %d)", progress.step, progress.epoch)
        else:
            _seed_rank(spec.seed, rank=rank, step=0)
        on_error.pop_all()  # from here on the caller closes the stream
    return progress, batches, model, optimizer, scheduler


def _checkpoint(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    request: LaunchRequest,
    dataset: DatasetInfo,
    progress: Progress,
    metrics: dict[str, float],
    rank: int,
    reporter: Reporter,
) -> None:
    """Every rank calls this at the same steps (collectives); rank 0 writes `state.pt` and announces it.

    With DDP rank 0 holds everything; with FSDP every rank also writes its shards, and Ray Train merges
    the ranks' folders into the one checkpoint folder `name`.
    """
    name = checkpoint_dir_name(progress.step)
    rng = _gather_rng_states()
    if rank != 0 and not is_sharded(model):
        ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
        return
    with tempfile.TemporaryDirectory(prefix="apiary-checkpoint-") as directory:
        save_checkpoint(
            directory,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            spec=request.spec,
            row_shape=dataset.row_shape,
            step=progress.step,
            epoch=progress.epoch,
            batches_in_epoch=progress.batches_in_epoch,
            samples_consumed=progress.samples_consumed,
            rng=rng,
            rank=rank,
        )
        # Synchronous upload: when report() returns, the folder is in storage under `name`.
        ray.train.report(
            metrics, checkpoint=ray.train.Checkpoint.from_directory(directory), checkpoint_dir_name=name
        )
    if rank != 0:
        return
    reporter.report_checkpoint(
        progress.step,
        checkpoint_uri(storage_uri=request.storage_uri, run_name=request.run_name, name=name),
    )


def _gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, in rank order (a collective: all ranks must call it)."""
    mine = capture_rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def _seed_rank(seed: int, *, rank: int, step: int) -> None:
    """Seed python, numpy and torch from (seed, rank, step), so ranks draw different dropout masks."""
    mixed = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)


def _restore_rng(state: dict[str, Any], *, spec: JobSpec, rank: int, world_size: int) -> None:
    if state["world_size"] == world_size:
        restore_rng_state(state["rng"][rank])
        return
    if rank == 0:
        logger.warning(
            "checkpoint written by %d ranks, this run has %d: RNG reseeded from (seed, rank, step)",
            state["world_size"],
            world_size,
        )
    _seed_rank(spec.seed, rank=rank, step=state["step"])


def _configure_logging(rank: int) -> None:
    """Ray Train workers start with no handler for our loggers; rank 0 speaks at INFO, others warn."""
    package_logger = logging.getLogger("trainers")
    if not package_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s"))
        package_logger.addHandler(handler)
        package_logger.propagate = False
    package_logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # httpx logs every metrics post at INFO: that is one log line per post and rank forwarded to the
    # job's driver log, which buries the training log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
