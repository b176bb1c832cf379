"""The per-worker train loop of recipes (`trainers.recipe`; the built-ins are recipes), run by Ray Train
on every rank: the first client of the training context (`trainers.context`), which gives it, as it
gives any own loop, the data, the restore, the step boundary (metrics, checkpoints) and stopping.

`trainers.launch` hands it to Ray Train (through `recipe_train_loop`); read it top to bottom:

1. Find where to start (the context, on opening): the run's latest checkpoint
   (`Checkpointer.latest`: a restarted worker group or a resubmitted job) holds the `TrainState`,
   with the exact data position.
2. Open this rank's data stream from that position (`TrainContext.batches`): it starts reading in
   the background at once, so the first batch is read while the model is built.
3. Build the recipe's model (weights from the seed alone, the same on every rank), wrap it for
   `spec.strategy` (DDP or FSDP2, `trainers.parallel`; gloo on CPU, nccl on GPU), build the
   optimizer, and load the checkpoint's model, optimizer, LR schedule, recipe state and RNG states
   into them (`TrainContext.restore`; an FSDP checkpoint re-shards to this run's world size).
   Forward and loss run under `spec.precision` (bf16 = autocast).
4. Run optimizer steps until exactly `max_steps`; the loop owns the step count and the stream
   starts a new epoch of the shard whenever one runs out.
   Between backward and the optimizer step, every rank judges the step's numerics
   (`trainers.anomaly`: NaN or infinite loss or gradient norm, or a gradient-norm spike) and the
   ranks agree on the verdict in one small collective (`gather_values`). An anomaly does what
   `spec.on_anomaly` says: `stop` raises a ValueError whose message is the job's reason ("loss is
   NaN at step 412 on rank 1; ..."); `warn` posts it and goes on, without applying a non-finite
   step's gradients; `rollback` (the default) goes back to the run's last checkpoint (or to the
   seed's initial weights when there is none yet) and does steps 2-3 again in-process, with the
   offending batch added to the skipped batches (`TrainContext.roll_back`). The stream passes over
   a skipped batch as if it were not in the data (the data position moves, no step is taken), so the
   run then takes exactly the batches a run without that batch would take; the list is saved in
   every later checkpoint, and its length counts the run's rollbacks: one more anomaly after
   `anomaly.max_rollbacks` of them stops the job. The detecting rank posts an `anomaly` event and
   rank 0 a `rollback` event (`Telemetry.event`).
5. Each step, this rank's metrics (`STEP_METRICS`, and the metrics the recipe's `loss` returns); at
   eval steps (`spec.eval`, `trainers.evaluation`) rank 0's also carry the eval metrics, averaged
   over the ranks.
6. The step boundary, `TrainContext.report`: the metrics are recorded as telemetry, and the ranks
   agree (`Checkpointer.end_step`, one small collective per step) on whether to checkpoint
   (`checkpoint.every_steps`, `checkpoint.every_s`, `max_steps`) and whether to stop. A checkpoint
   is copied to host memory at that step and written in the background while training goes on
   (`checkpoint.async`); it is completed and reported (`ray.train.report` is a barrier, so all ranks
   call it the same number of times) at a later step where every rank's write is done. When the
   control plane asks the job to stop (a telemetry reply: preempted, or out of runtime), the ranks
   agree on it there, save a checkpoint at that step, wait until it is complete and return
   (`TrainContext.should_stop`): the run resumes from exactly that step when the job is admitted
   again.

Data position: each rank reads its own samples in an order fixed by (seed, epoch, world size)
(`trainers.data_order`), so the checkpoint's (epoch, batches_in_epoch) is the exact position of
every rank (each consumed batches_in_epoch * batch_size samples of that epoch), and a resumed run
takes exactly the batches an uninterrupted run would have taken.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from service.contract.spec import AnomalyAction, JobSpec
from trainers import startup
from trainers.anomaly import Anomaly, AnomalyDetector, decide, encode
from trainers.checkpoint import TrainParts
from trainers.context import TrainContext, metric_values, open_context
from trainers.evaluation import Evaluator
from trainers.loop_config import LoopConfig
from trainers.parallel import clip_grad_norm, gather_values
from trainers.recipe import Recipe, RowShape, recipe_for, split_loss
from trainers.telemetry import Telemetry

logger = logging.getLogger(__name__)

# The values every rank records for every step, in this order.
STEP_METRICS = (
    "loss",
    "lr",
    "grad_norm",
    "samples_per_s",
    "step_time_s",
    "data_wait_s",
    "forward_s",  # the forward pass alone: this rank's own work, which stragglers stand out by
    "epoch",
)
# Rank 0's progress line in the job log: step 1, then at most this often, and the last step. Each
# line travels through Ray's log monitor to the driver while the ranks hold the cores; every step's
# metrics of every rank reach the service as telemetry anyway.
LOG_INTERVAL_S = 10.0


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    with open_context(loop_config) as ctx:
        spec, rank = ctx.spec, ctx.rank
        max_steps = spec.required_max_steps
        dataset = ctx.dataset
        assert dataset is not None  # a recipe's spec has one (service.contract.trainer_kind.kind_refusal)
        trainer = recipe_for(spec)
        # 1-3. This rank's data from the checkpoint's position, reading in the background from now on
        # (the order uses no global RNG, so the model is built while the first batch is read); then
        # the model, restored.
        startup.mark("stream_opening")
        batches = ctx.batches(trainer.build_collate(dataset.row_shape, uri=dataset.uri))
        startup.mark("stream_opened")
        parts = _build(ctx, trainer, row_shape=dataset.row_shape)
        startup.mark("ready")

        eval_dataset = LoopConfig.from_dict(loop_config).eval_dataset
        evaluator = (
            Evaluator(
                ctx.request,
                eval_dataset,
                trainer,
                rank=rank,
                world_size=ctx.world_size,
                device=ctx.device,
            )
            if eval_dataset is not None
            else None
        )
        detector = AnomalyDetector.from_spec(spec.anomaly, rank=rank)
        grad_clip = trainer.grad_clip or math.inf
        last_log = -math.inf
        parts.model.train()
        # 4. Exactly max_steps optimizer steps.
        while ctx.step < max_steps:
            step_started = time.perf_counter()
            batch = next(batches)  # a batch a rollback skipped is passed over
            epoch = ctx.epoch
            data_wait_s = time.perf_counter() - step_started

            with ctx.autocast(parts.model):
                loss, recipe_metrics = split_loss(trainer.loss(parts.model, batch))
            forward_s = time.perf_counter() - step_started - data_wait_s
            parts.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            grad_norm = clip_grad_norm(parts.model, max_norm=grad_clip)

            # Numerics, judged before the update: the ranks agree on the step's anomaly (the loop's one
            # small collective of every step; the step boundary, `ctx.report`, has the other).
            step = ctx.step + 1
            seen = detector.check(step=step, loss=loss.item(), grad_norm=grad_norm.item())
            ctx.telemetry.progress("sync")
            anomaly = decide(gather_values(encode(seen), device=ctx.device), step=step)
            if anomaly is not None:
                if anomaly.rank == rank:
                    _report_anomaly(ctx.telemetry, anomaly, step=step, spec=spec)
                _stop_unless_allowed(anomaly, rollbacks=len(ctx.skipped_batches), spec=spec)
                if spec.on_anomaly is AnomalyAction.ROLLBACK:
                    del loss, grad_norm, parts
                    ctx.roll_back()  # to the last checkpoint, leaving this batch out of the data
                    parts = _build(ctx, trainer, row_shape=dataset.row_shape)
                    parts.model.train()
                    if rank == 0:
                        _announce_rollback(ctx, anomaly, spec=spec)
                    continue

            lr = parts.optimizer.param_groups[0]["lr"]
            if anomaly is None or anomaly.kind == "spike":
                parts.optimizer.step()
                detector.accept(step=step, grad_norm=grad_norm.item())
            # else on_anomaly is warn: the step counts, but its non-finite gradients are not applied.
            if parts.lr_schedule is not None:
                parts.lr_schedule.step()
            step_time_s = time.perf_counter() - step_started

            # 5. This rank's metrics.
            values = {
                "loss": loss.item(),
                "lr": float(lr),
                "grad_norm": grad_norm.item(),
                "samples_per_s": spec.required_batch_size / step_time_s,
                "step_time_s": step_time_s,
                "data_wait_s": data_wait_s,
                "forward_s": forward_s,
                "epoch": float(epoch),
                **recipe_metric_values(recipe_metrics),
            }
            if evaluator is not None and evaluator.due(step, checkpoint_due=ctx.checkpointer.due(step)):
                ctx.telemetry.progress("eval", step=step)
                evaluated = evaluator.run(parts.model)
                if rank == 0:
                    values.update(evaluated)
            if startup.mark("step_1_done"):
                startup.emit(f"rank {rank}")
            now = time.monotonic()
            if rank == 0 and (now - last_log >= LOG_INTERVAL_S or step == max_steps):
                last_log = now
                _log_progress(step, max_steps=max_steps, values=values)

            # 6. The step boundary: the metrics recorded, a checkpoint (in the background unless it is
            # the last); stop here when the control plane asks, with a complete checkpoint.
            ctx.report(step, **values)
            if ctx.should_stop():
                break


def _build(ctx: TrainContext, trainer: Recipe[Any], *, row_shape: RowShape) -> TrainParts:
    """The recipe's model, wrapped for the strategy, its optimizer, restored from the context's checkpoint
    (or fresh): at the group's start, and again on a rollback.

    Initial weights depend on the seed only, not on the rank or world size; the optimizer is built
    after the wrapping (FSDP replaces parameters by shards).
    """
    spec = ctx.spec
    torch.manual_seed(spec.seed)
    model = trainer.build_model(row_shape)
    model = ctx.parallelize(model, blocks=trainer.fsdp_blocks(model))
    optimizer, lr_schedule = trainer.build_optimizer(model, max_steps=spec.required_max_steps)
    startup.mark("model_built")
    ctx.restore(model=model, optimizer=optimizer, lr_schedule=lr_schedule, extra=trainer)
    return TrainParts(model=model, optimizer=optimizer, lr_schedule=lr_schedule, extra=trainer)


def recipe_metric_values(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """A recipe's metrics as numbers; a name of the loop's own (`STEP_METRICS`) is refused."""
    taken = next((name for name in metrics if name in STEP_METRICS), None)
    if taken is not None:
        raise ValueError(
            f"the recipe's loss returns a metric named {taken!r}, a name of the loop's own step "
            f"metrics ({', '.join(STEP_METRICS)}): rename it"
        )
    return metric_values(metrics)


def _report_anomaly(telemetry: Telemetry, anomaly: Anomaly, *, step: int, spec: JobSpec) -> None:
    """The rank that saw it posts the anomaly (once, not once per rank)."""
    telemetry.event(
        "anomaly",
        step=step,
        message=f"{anomaly.describe()} (on_anomaly: {spec.on_anomaly})",
        **anomaly.event_data(),
    )


def _stop_unless_allowed(anomaly: Anomaly, *, rollbacks: int, spec: JobSpec) -> None:
    """Raise the job's failure reason when `on_anomaly` (or the rollbacks left) says stop.

    A ValueError: `trainers.launch.failure_reason` makes its message the job's one-line reason.
    """
    if spec.on_anomaly is AnomalyAction.STOP:
        raise ValueError(f"{anomaly.describe()}; stopped (on_anomaly: stop)")
    if spec.on_anomaly is AnomalyAction.ROLLBACK and rollbacks >= spec.anomaly.max_rollbacks:
        raise ValueError(f"{anomaly.describe()}; stopped after {rollbacks} rollbacks (anomaly.max_rollbacks)")


def _announce_rollback(ctx: TrainContext, anomaly: Anomaly, *, spec: JobSpec) -> None:
    epoch, index = ctx.skipped_batches[-1]
    rollbacks = len(ctx.skipped_batches)
    where = f"the checkpoint at step {ctx.step}" if ctx.step else "the initial weights (no checkpoint yet)"
    ctx.telemetry.event(
        "rollback",
        step=anomaly.step,
        message=f"rolled back from step {anomaly.step} to {where}, skipping batch {index} of epoch {epoch} "
        f"(rollback {rollbacks} of at most {spec.anomaly.max_rollbacks})",
        restored_step=ctx.step,
        skipped_epoch=epoch,
        skipped_batch=index,
        rollbacks=rollbacks,
    )


def _log_progress(step: int, *, max_steps: int, values: dict[str, float]) -> None:
    logger.info(
        "step %d/%d epoch %d loss %.4f lr %.2e grad_norm %.3f %.0f samples/s (data wait %.0f%%)",
        step,
        max_steps,
        values["epoch"],
        values["loss"],
        values["lr"],
        values["grad_norm"],
        values["samples_per_s"],
        100 * values["data_wait_s"] / values["step_time_s"],
    )
