"""The per-worker train loop of recipes (`trainers.recipe`; the built-ins are recipes), run by Ray Train
on every rank.

`trainers.launch` hands it to Ray Train (through `recipe_train_loop`); read it top to bottom:

1. Find where to start: the run's latest checkpoint (`Checkpointer.latest`: a restarted worker group
   or a resubmitted job) holds the `TrainState`, with the exact data position.
2. Open this rank's data stream from that position: it starts reading in the background at once,
   so the first batch is read while the model is built.
3. Build the recipe's model (weights from the seed alone, the same on every rank), wrap it for
   `spec.strategy` (DDP or FSDP2, `trainers.parallel`; gloo on CPU, nccl on GPU), build the
   optimizer, and load the checkpoint's model, optimizer, LR schedule, recipe state and RNG states
   into them (an FSDP checkpoint re-shards to this run's world size). Forward and loss run under
   `spec.precision` (bf16 = autocast).
4. Run optimizer steps until exactly `max_steps`; the loop owns the step count and starts a new
   epoch of the shard whenever one runs out.
   Between backward and the optimizer step, every rank judges the step's numerics
   (`trainers.anomaly`: NaN or infinite loss or gradient norm, or a gradient-norm spike) and the
   ranks agree on the verdict, and on whether the control plane asked to stop, in one small
   collective (`gather_values`). An anomaly does what `spec.on_anomaly` says: `stop` raises a
   ValueError whose message is the job's reason ("loss is NaN at step 412 on rank 1; ..."); `warn`
   posts it and goes on, without applying a non-finite step's gradients; `rollback` (the default)
   restarts steps 1-3 in-process from the run's last checkpoint (or from the seed's initial weights
   when there is none yet), with the offending batch added to `TrainState.skipped_batches`. The loop
   passes over a skipped batch as if it were not in the data (the data position moves, no step is
   taken), so the run then takes exactly the batches a run without that batch would take; the list
   is saved in every later checkpoint, and its length counts the run's rollbacks: one more anomaly
   after `anomaly.max_rollbacks` of them stops the job. The detecting rank posts an `anomaly` event
   and rank 0 a `rollback` event (`Telemetry.event`).
5. Each step, record this rank's metrics (`STEP_METRICS`, and the metrics the recipe's `loss`
   returns) as telemetry; at eval steps (`spec.eval`, `trainers.evaluation`) rank 0's also carry the
   eval metrics, averaged over the ranks.
6. At the end of every step the ranks agree (`Checkpointer.end_step`, one small collective per step)
   on whether to checkpoint (`checkpoint.every_steps`, `checkpoint.every_s`, `max_steps`) and
   whether to stop. A checkpoint is copied to host memory at that step and written in the
   background while training goes on (`checkpoint.async`); it is completed and reported
   (`ray.train.report` is a barrier, so all ranks call it the same number of times) at a later step
   where every rank's write is done. When the control plane asks the job to stop (a telemetry
   reply: preempted, or out of runtime), the ranks agree on it in the step's collective (above),
   save a checkpoint at that step, wait until it is complete and return: the run resumes from
   exactly that step when the job is admitted again.

Data position: each rank reads its own samples in an order fixed by (seed, epoch, world size)
(`trainers.data_order`), so the checkpoint's (epoch, batches_in_epoch) is the exact position of
every rank (each consumed batches_in_epoch * batch_size samples of that epoch), and a resumed run
takes exactly the batches an uninterrupted run would have taken.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
import ray.train.torch
import ray.util
import torch

from service.contract.handoff import loop_token
from service.contract.protocol import GROUP_STARTED, LaunchRequest
from service.contract.spec import AnomalyAction, JobSpec
from trainers import startup
from trainers.anomaly import Anomaly, AnomalyDetector, decide, encode
from trainers.checkpoint import Checkpointer, Resume, TrainParts, TrainState, seed_rank
from trainers.data import DatasetInfo, RankBatches, iter_batches_for_rank
from trainers.evaluation import Evaluator
from trainers.parallel import autocast, clip_grad_norm, gather_values, parallelize, rank0_value
from trainers.recipe import Recipe, recipe_for, split_loss
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
    request = LaunchRequest.model_validate(loop_config["request"])
    dataset = DatasetInfo.from_dict(loop_config["dataset"])
    spec = request.spec
    trainer = recipe_for(spec)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    _configure_logging(rank)
    start = _Worker(
        request,
        dataset,
        trainer,
        rank=rank,
        world_size=world_size,
        device=device,
        initial_recipe_state=copy.deepcopy(trainer.state_dict()),
    ).start

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        telemetry = stack.enter_context(
            Telemetry(
                url=request.telemetry_url, attempt=request.attempt, rank=rank, token=loop_token(loop_config)
            )
        )
        _join_group(telemetry, device=device)
        checkpointer = stack.enter_context(
            Checkpointer(request, row_shape=dataset.row_shape, rank=rank, telemetry=telemetry, device=device)
        )
        startup.mark("group_joined")
        with checkpointer.latest() as resume:
            state, batches, parts = start(resume)
            if resume is not None and rank == 0:
                logger.info("resumed from step %d (epoch %d)", state.step, state.epoch)
        stack.callback(lambda: batches.close())  # whichever stream is open at the end
        startup.mark("ready")
        if rank == 0:
            _announce_start(
                telemetry,
                request,
                world_size=world_size,
                resumed_from=state.step if resume is not None else None,
                ready_s=time.perf_counter() - started,
            )

        evaluator = (
            Evaluator(
                request,
                DatasetInfo.from_dict(loop_config["eval_dataset"]),
                trainer,
                rank=rank,
                world_size=world_size,
                device=device,
            )
            if loop_config.get("eval_dataset") is not None
            else None
        )
        detector = AnomalyDetector.from_spec(spec.anomaly, rank=rank)
        grad_clip = trainer.grad_clip or math.inf
        last_log = -math.inf
        parts.model.train()
        # 4. Exactly max_steps optimizer steps.
        while state.step < spec.required_max_steps:
            step_started = time.perf_counter()
            telemetry.progress("data")
            epoch, batch = next(batches)
            if state.next_batch(epoch) in state.skipped_batches:
                state.pass_batch(epoch=epoch)  # a rollback skipped it: as if it were not in the data
                continue
            data_wait_s = time.perf_counter() - step_started
            telemetry.progress("compute")

            with autocast(spec.precision, device=device, model=parts.model):
                loss, recipe_metrics = split_loss(trainer.loss(parts.model, batch))
            forward_s = time.perf_counter() - step_started - data_wait_s
            parts.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            grad_norm = clip_grad_norm(parts.model, max_norm=grad_clip)

            # Numerics, judged before the update: the ranks agree on the step's anomaly, and on whether
            # the control plane asked to stop (the one small collective of every step).
            step = state.step + 1
            seen = detector.check(step=step, loss=loss.item(), grad_norm=grad_norm.item())
            telemetry.progress("sync")
            verdict = decide(
                gather_values(encode(seen, stop_requested=telemetry.stop_requested.is_set()), device=device),
                step=step,
            )
            anomaly = verdict.anomaly
            if anomaly is not None:
                if anomaly.rank == rank:
                    _report_anomaly(telemetry, anomaly, step=step, spec=spec)
                _stop_unless_allowed(anomaly, state=state, spec=spec)
                if spec.on_anomaly is AnomalyAction.ROLLBACK:
                    skipped = [*state.skipped_batches, state.next_batch(epoch)]
                    del loss, grad_norm, parts
                    batches.close()
                    with checkpointer.last() as resume:
                        state, batches, parts = start(resume)
                    state.skipped_batches = skipped
                    parts.model.train()
                    if rank == 0:
                        _announce_rollback(telemetry, anomaly, state=state, spec=spec)
                    continue

            lr = parts.optimizer.param_groups[0]["lr"]
            if anomaly is None or anomaly.kind == "spike":
                parts.optimizer.step()
                detector.accept(step=step, grad_norm=grad_norm.item())
            # else on_anomaly is warn: the step counts, but its non-finite gradients are not applied.
            parts.lr_schedule.step()
            state.advance(epoch=epoch, samples=spec.required_batch_size * world_size)
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
                **metric_values(recipe_metrics),
            }
            if evaluator is not None and evaluator.due(
                state.step, checkpoint_due=checkpointer.due(state.step)
            ):
                telemetry.progress("eval", step=state.step)
                evaluated = evaluator.run(parts.model)
                if rank == 0:
                    values.update(evaluated)
            telemetry.record(state.step, values)
            if startup.mark("step_1_done"):
                startup.emit(f"rank {rank}")
            now = time.monotonic()
            if rank == 0 and (now - last_log >= LOG_INTERVAL_S or state.step == spec.max_steps):
                last_log = now
                _log_progress(state.step, max_steps=spec.required_max_steps, values=values)

            # 6. Checkpoint (in the background unless it is the last); stop here when the control
            # plane asks, with a complete checkpoint.
            telemetry.progress("sync", step=state.step)
            stop = checkpointer.end_step(parts, state, metrics=values, stop_requested=verdict.stop_requested)
            if stop:
                if rank == 0:
                    logger.info(
                        "stopped at step %d with a checkpoint, as the control plane asked", state.step
                    )
                break
        telemetry.progress("done")


@dataclass(frozen=True)
class _Worker:
    """One rank of the worker group: what it needs to (re)build its training state."""

    request: LaunchRequest
    dataset: DatasetInfo
    trainer: Recipe[Any]
    rank: int
    world_size: int
    device: torch.device
    # The recipe's state as built: what a rollback to the initial weights gives it back.
    initial_recipe_state: dict[str, Any]

    def start(self, resume: Resume | None) -> tuple[TrainState, RankBatches, TrainParts]:
        """Steps 1-3 from `resume` (None: a fresh run): at the group's start, and again on a rollback."""
        # 1. Where to start.
        state = resume.train_state(world_size=self.world_size) if resume is not None else TrainState()
        # 2. This rank's data from there, reading in the background from now on (the order uses
        # no global RNG, so the model below is built while the first batch is read).
        startup.mark("stream_opening")
        batches = iter_batches_for_rank(
            self.request,
            self.dataset,
            rank=self.rank,
            world_size=self.world_size,
            collate_fn=self.trainer.build_collate(self.dataset.row_shape, uri=self.dataset.uri),
            start=state.data_position(batch_size=self.request.spec.required_batch_size),
            device=self.device,
        )
        try:
            # 3. Model, wrapped for the strategy, then the optimizer (FSDP replaces parameters by
            # shards). Initial weights depend on the seed only, not on the rank or world size.
            startup.mark("stream_opened")
            spec = self.request.spec
            torch.manual_seed(spec.seed)
            model = self.trainer.build_model(self.dataset.row_shape)
            model = parallelize(
                model,
                strategy=spec.strategy,
                device=self.device,
                fsdp=spec.fsdp,
                precision=spec.precision,
                max_workers=spec.max_workers,
                blocks=self.trainer.fsdp_blocks(model),
            )
            optimizer, lr_schedule = self.trainer.build_optimizer(model, max_steps=spec.required_max_steps)
            parts = TrainParts(model=model, optimizer=optimizer, lr_schedule=lr_schedule, extra=self.trainer)
            startup.mark("model_built")
            if resume is not None:
                resume.restore(parts, rank=self.rank, world_size=self.world_size)
            else:
                if self.initial_recipe_state:
                    self.trainer.load_state_dict(copy.deepcopy(self.initial_recipe_state))
                seed_rank(spec.seed, rank=self.rank, step=0)
        except BaseException:
            batches.close()
            raise
        return state, batches, parts


def metric_values(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """A recipe's metrics as numbers; a name of the loop's own (`STEP_METRICS`) is refused."""
    taken = next((name for name in metrics if name in STEP_METRICS), None)
    if taken is not None:
        raise ValueError(
            f"the recipe's loss returns a metric named {taken!r}, a name of the loop's own step "
            f"metrics ({', '.join(STEP_METRICS)}): rename it"
        )
    return {name: float(value) for name, value in metrics.items()}


def _join_group(telemetry: Telemetry, *, device: torch.device) -> None:
    """Tell telemetry where this rank runs, and which start of the worker group this is (a restart
    inside Ray Train replays steps): rank 0's clock, shared by every rank (a collective)."""
    telemetry.node = f"{ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()[:8]})"
    telemetry.segment = rank0_value(time.time_ns() // 1_000_000, device=device)


def _announce_start(
    telemetry: Telemetry, request: LaunchRequest, *, world_size: int, resumed_from: int | None, ready_s: float
) -> None:
    """Rank 0: the worker group is ready, in the job log and in its timeline."""
    logger.info("rank 0 of %d ready in %.1f s (model built, data stream open)", world_size, ready_s)
    telemetry.event(
        GROUP_STARTED,
        step=resumed_from or 0,
        message=f"worker group of {world_size} started (attempt {request.attempt}) "
        + (f"from its checkpoint at step {resumed_from}" if resumed_from is not None else "from step 0"),
        world_size=world_size,
    )


def _report_anomaly(telemetry: Telemetry, anomaly: Anomaly, *, step: int, spec: JobSpec) -> None:
    """The rank that saw it posts the anomaly (once, not once per rank)."""
    telemetry.event(
        "anomaly",
        step=step,
        message=f"{anomaly.describe()} (on_anomaly: {spec.on_anomaly})",
        **anomaly.event_data(),
    )


def _stop_unless_allowed(anomaly: Anomaly, *, state: TrainState, spec: JobSpec) -> None:
    """Raise the job's failure reason when `on_anomaly` (or the rollbacks left) says stop.

    A ValueError: `trainers.launch.failure_reason` makes its message the job's one-line reason.
    """
    if spec.on_anomaly is AnomalyAction.STOP:
        raise ValueError(f"{anomaly.describe()}; stopped (on_anomaly: stop)")
    rollbacks = len(state.skipped_batches)
    if spec.on_anomaly is AnomalyAction.ROLLBACK and rollbacks >= spec.anomaly.max_rollbacks:
        raise ValueError(f"{anomaly.describe()}; stopped after {rollbacks} rollbacks (anomaly.max_rollbacks)")


def _announce_rollback(telemetry: Telemetry, anomaly: Anomaly, *, state: TrainState, spec: JobSpec) -> None:
    epoch, index = state.skipped_batches[-1]
    rollbacks = len(state.skipped_batches)
    where = (
        f"the checkpoint at step {state.step}" if state.step else "the initial weights (no checkpoint yet)"
    )
    telemetry.event(
        "rollback",
        step=anomaly.step,
        message=f"rolled back from step {anomaly.step} to {where}, skipping batch {index} of epoch {epoch} "
        f"(rollback {rollbacks} of at most {spec.anomaly.max_rollbacks})",
        restored_step=state.step,
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


def _configure_logging(rank: int) -> None:
    """Ray Train workers start with no handler for our loggers; rank 0 speaks at INFO, others warn."""
    package_logger = logging.getLogger("trainers")
    if not package_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s"))
        package_logger.addHandler(handler)
        package_logger.propagate = False
    package_logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # httpx logs every telemetry post at INFO: that is one log line per post and rank forwarded to the
    # job's driver log, which buries the training log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
