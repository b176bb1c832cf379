"""The training context: your own loop (a Core API), with Apiary's guarantees.

A function whose first parameter is annotated `TrainContext` is an own loop
(`service.contract.trainer_kind`); `trainer: package.module:train` names it, and every rank of the
job calls it with its context:

    def train(ctx: TrainContext) -> None:
        model = ctx.parallelize(Net(ctx.config["hidden"]))   # spec.strategy (DDP, FSDP2), on ctx.device
        optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.config["lr"])
        ctx.restore(model=model, optimizer=optimizer, extra=counters)   # resume exactly, or start
        batches = ctx.batches(collate)            # the job's dataset: deterministic, resumable order
        for step in range(ctx.step + 1, ctx.max_steps + 1):
            batch = next(batches)
            with ctx.autocast(model):             # spec.precision
                loss = F.cross_entropy(model(batch["x"]), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.report(step, loss=loss)           # metrics, checkpoints, the ranks agree on stopping
            if ctx.should_stop():                 # preempted, or out of runtime: a checkpoint of this
                return                            # step is complete; the job resumes from it

What each part does:

- Before the function runs, the context joins the worker group to the job's telemetry, seeds
  python, numpy and torch with `spec.seed` (the same model on every rank), and finds the run's
  latest complete checkpoint (`trainers.checkpoint.Checkpointer.latest`: a restarted worker group,
  a resubmitted or preempted job).
- `batches(collate)`: this rank's batches of the job's dataset, forever (a new epoch when one runs
  out), in the order of `trainers.data_order` (a function of the seed, the epoch and the world size),
  from the checkpoint's data position. `collate` turns a `pyarrow.Table` of rows into a dict of
  tensors (on the CPU; the batches come on `ctx.device`). Reading runs in the background.
- `restore(model=, optimizer=, lr_schedule=, extra=)`: names the state that checkpoints hold (the
  model after `parallelize`, its optimizer, an LR schedule, and any extra state: an object with
  `state_dict()`/`load_state_dict()` or a plain dict, updated in place) and loads it from the
  checkpoint, with this rank's RNG states; on a fresh run it seeds each rank's RNG from (seed,
  rank). Returns the step it resumed from (`ctx.step`; 0 when fresh).
- `report(step, **metrics)`: the step boundary, the same step on every rank. The metrics (numbers
  or one-element tensors) reach the service as this rank's point at `step` (the metrics endpoint,
  the streams, the charts, Prometheus). Then the ranks agree, in one small collective, on whether to
  checkpoint (`checkpoint.every_steps`, `every_s`, `auto`, `max_steps`) and whether to stop; a
  checkpoint is copied at the step and written in the background (`checkpoint.async`), recorded with
  the service (`keep_last`/`keep_best` apply), exactly as the built-in loop's.
- With `spec.profile`, the step boundary also runs `torch.profiler` on every rank for those steps
  (`trainers.profiling`): the traces go beside the checkpoints, the split into a `profile` event.
- `should_stop()`: True from the report at which the ranks agreed to stop (the job was preempted or
  ran out of runtime); that step's checkpoint is then complete. Return from the function: the job is
  requeued and resumes from exactly there.
- When the function returns, the checkpoint in flight is completed, and the last reported step is
  saved if no checkpoint holds it yet.

The context and the built-in loop (`trainers.loop`, whose recipes get the same guarantees) share
everything here: the loop is this context's first client.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa
import ray
import ray.train
import ray.train.torch
import ray.util
import torch
from torch import nn

from service.contract.protocol import GROUP_STARTED, LaunchRequest
from service.contract.spec import JobSpec
from trainers import startup
from trainers.checkpoint import Checkpointer, Resume, Stateful, TrainParts, TrainState, seed_rank
from trainers.data import DatasetInfo, RankBatches, iter_batches_for_rank
from trainers.data_stream import Batch
from trainers.loop_config import LoopConfig
from trainers.parallel import autocast, parallelize, rank0_value
from trainers.profiling import StepProfiler
from trainers.telemetry import Telemetry

logger = logging.getLogger(__name__)

# Arrow rows -> a dict of tensors (runs on the worker, in the stream's background thread).
Collate = Callable[[pa.Table], Batch]


class TrainContext:
    """One rank's view of its job: data, state, metrics, checkpoints and stopping (see the module)."""

    def __init__(
        self,
        *,
        request: LaunchRequest,
        dataset: DatasetInfo | None,
        rank: int,
        world_size: int,
        device: torch.device,
        telemetry: Telemetry,
        checkpointer: Checkpointer,
    ) -> None:
        self.request = request
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.telemetry = telemetry
        self.checkpointer = checkpointer
        self._started = time.perf_counter()
        self._state = TrainState()
        self._resume: Resume | None = None
        self._resume_folder = contextlib.ExitStack()  # keeps the checkpoint's (downloaded) folder
        self._resumed_from: int | None = None
        self._parts: TrainParts | None = None
        self._initial_extra: dict[str, Any] | None = None
        self._collate: Collate | None = None
        self._columns: Sequence[str] | None = None
        self._stream: RankBatches | None = None
        self._last_batch: tuple[int, int] | None = None  # (epoch, index in it) of the last batch taken
        self._metrics: dict[str, float] = {}
        self._stop = False
        self._announced = False
        profile = request.spec.profile
        self._profiler = (
            StepProfiler(profile, request=request, rank=rank, device=device, telemetry=telemetry)
            if profile is not None
            else None
        )

    # -- what the job is -------------------------------------------------------------------------------

    @property
    def spec(self) -> JobSpec:
        return self.request.spec

    @property
    def config(self) -> dict[str, Any]:
        """The spec's free-form `config`."""
        return self.request.spec.config

    @property
    def max_steps(self) -> int | None:
        """The spec's `max_steps`; None when it sets none (the loop decides when it is done)."""
        return self.request.spec.max_steps

    @property
    def batch_size(self) -> int | None:
        """Rows per batch, on each rank (the spec's `batch_size`)."""
        return self.request.spec.batch_size

    @property
    def step(self) -> int:
        """The last step reported, or restored from a checkpoint (0 on a fresh run)."""
        return self._state.step

    @property
    def epoch(self) -> int:
        """The epoch of the last batch taken."""
        return self._state.epoch

    @property
    def samples_consumed(self) -> int:
        """Samples all ranks together have taken from the dataset."""
        return self._state.samples_consumed

    @property
    def resumed_from(self) -> int | None:
        """The step of the checkpoint this run resumed from; None on a fresh run."""
        return self._resumed_from

    # -- model and precision ---------------------------------------------------------------------------

    def parallelize(self, model: nn.Module, *, blocks: Sequence[nn.Module] | None = None) -> nn.Module:
        """`model` on this rank's device, wrapped for `spec.strategy` (DDP, or FSDP2 with `spec.fsdp`, its
        units `blocks`: default `model.blocks` when an `nn.ModuleList`) and `spec.precision` (FSDP2's
        bf16 policy). Build the optimizer after this: FSDP replaces the parameters by shards."""
        spec = self.spec
        return parallelize(
            model,
            strategy=spec.strategy,
            device=self.device,
            fsdp=spec.fsdp,
            precision=spec.precision,
            max_workers=spec.max_workers,
            blocks=blocks,
        )

    def autocast(self, model: nn.Module | None = None) -> contextlib.AbstractContextManager[None]:
        """Run the enclosed forward and loss at `spec.precision` (bf16: autocast, unless `model` is
        sharded, whose FSDP2 policy already computes in bf16)."""
        return autocast(self.spec.precision, device=self.device, model=model)

    # -- data ------------------------------------------------------------------------------------------

    def batches(self, collate: Collate, *, columns: Sequence[str] | None = None) -> Iterator[Batch]:
        """This rank's batches from the data position, forever; `columns` (None: the dataset's
        `read_columns`, else all) are read.

        A second call opens the stream again at the current position, with this `collate`.
        """
        if self.dataset is None or self.batch_size is None:
            missing = "dataset" if self.dataset is None else "batch_size"
            raise ValueError(
                f"{missing}: ctx.batches() reads the job's dataset, and the spec sets no {missing}"
            )
        self._collate, self._columns = collate, columns
        self._open_stream()
        return _ContextBatches(self)

    def _open_stream(self) -> None:
        self._close_stream()
        assert self._collate is not None and self.dataset is not None and self.batch_size is not None
        dataset = self.dataset
        if self._columns is not None:
            dataset = replace(dataset, read_columns=list(self._columns))
        self._stream = iter_batches_for_rank(
            self.request,
            dataset,
            rank=self.rank,
            world_size=self.world_size,
            collate_fn=self._collate,
            start=self._state.data_position(batch_size=self.batch_size),
            device=self.device,
        )

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def next_batch(self) -> Batch:
        """The next batch of this rank (`batches()` must have been called); a batch a rollback skipped
        (`roll_back`) is passed over, as if it were not in the data."""
        stream = self._stream
        if stream is None:
            raise RuntimeError("call ctx.batches(collate) before taking batches")
        self.telemetry.progress("data")
        state = self._state
        while True:
            epoch, batch = next(stream)
            taken = state.next_batch(epoch)
            state.pass_batch(epoch=epoch)
            if taken not in state.skipped_batches:
                break
        self._last_batch = taken
        state.samples_consumed += (self.batch_size or 0) * self.world_size
        self.telemetry.progress("compute")
        return batch

    # -- state -----------------------------------------------------------------------------------------

    def restore(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_schedule: torch.optim.lr_scheduler.LRScheduler | None = None,
        extra: Stateful | dict[str, Any] | None = None,
    ) -> int:
        """Name what checkpoints hold and load it from the checkpoint to resume from (every rank, after
        `parallelize` and building the optimizer); returns the step resumed from (0: a fresh start).

        `extra`: state of your own (counters, a curriculum): an object with `state_dict()` and
        `load_state_dict()`, or a dict, updated in place. Plain containers, numbers, strings and tensors
        only: a checkpoint loads with `weights_only=True`.
        """
        stateful = _DictState(extra) if isinstance(extra, dict) else extra
        parts = TrainParts(model=model, optimizer=optimizer, lr_schedule=lr_schedule, extra=stateful)
        if self._initial_extra is None:
            # What a rollback to the initial weights gives the extra state back.
            self._initial_extra = copy.deepcopy(stateful.state_dict()) if stateful is not None else {}
        resume = self._resume
        if resume is not None:
            resume.restore(parts, rank=self.rank, world_size=self.world_size)
        else:
            if stateful is not None and self._initial_extra:
                stateful.load_state_dict(copy.deepcopy(self._initial_extra))
            seed_rank(self.spec.seed, rank=self.rank, step=0)
        self._parts = parts
        self._announce_start()
        if self._profiler is not None:
            self._profiler.at_restore(self._state.step)
        return self._state.step

    def roll_back(self) -> None:
        """Go back to the run's last complete checkpoint (the initial state when there is none), and
        leave the last batch taken out of the data from now on (every rank at the same step).

        The batches go on from the checkpoint's data position; call `restore` again with the state to
        load (the built-in loop rebuilds its model: `trainers.loop`'s anomaly rollback).
        """
        skipped = [*self._state.skipped_batches, *([self._last_batch] if self._last_batch else [])]
        self._close_stream()
        self._parts = None
        self._resume_folder.close()
        self._resume = self._resume_folder.enter_context(self.checkpointer.last())
        self._state = (
            self._resume.train_state(world_size=self.world_size) if self._resume is not None else TrainState()
        )
        self._state.skipped_batches = skipped
        self._last_batch = None
        if self._collate is not None:
            self._open_stream()

    @property
    def skipped_batches(self) -> list[tuple[int, int]]:
        """(epoch, index) of the batches rollbacks left out; its length counts the run's rollbacks."""
        return self._state.skipped_batches

    # -- the step boundary -----------------------------------------------------------------------------

    def report(self, step: int, /, **metrics: float | torch.Tensor) -> None:
        """End step `step` (every rank, the same steps): record this rank's metrics, checkpoint when one
        is due, and agree with the other ranks on stopping (`should_stop`)."""
        if self._parts is None:
            raise RuntimeError(
                "call ctx.restore(model=..., optimizer=...) before ctx.report(...): checkpoints need them"
            )
        if isinstance(step, bool) or not isinstance(step, int) or step <= self._state.step:
            raise ValueError(
                f"ctx.report(step={step!r}): steps are integers that increase, the last was "
                f"{self._state.step}"
            )
        values = metric_values(metrics)
        self._state.step = step
        self._metrics = values
        self.telemetry.record(step, values)
        self.telemetry.progress("sync", step=step)
        self._stop = self.checkpointer.end_step(
            self._parts, self._state, metrics=values, stop_requested=self.telemetry.stop_requested.is_set()
        )
        if self._stop and self.rank == 0:
            logger.info("stopped at step %d with a checkpoint, as the control plane asked", step)
        if self._profiler is not None:
            self._profiler.at_step(step)
        self.telemetry.progress("compute", step=step)

    def should_stop(self) -> bool:
        """True once the ranks agreed (at a `report`) to stop: preempted, or out of runtime. That step's
        checkpoint is complete; return from the loop."""
        return self._stop

    # -- the job's lifetime ----------------------------------------------------------------------------

    def _begin(self) -> None:
        """At the start (every rank): the worker group's segment, the checkpoint to resume from, the seed."""
        # Which start of the worker group this is (a restart inside Ray Train replays steps): rank 0's
        # clock, shared by every rank (a collective).
        self.telemetry.segment = rank0_value(time.time_ns() // 1_000_000, device=self.device)
        startup.mark("group_joined")
        self._resume = self._resume_folder.enter_context(self.checkpointer.latest())
        if self._resume is not None:
            self._state = self._resume.train_state(world_size=self.world_size)
            self._resumed_from = self._state.step
        # The same initial weights on every rank, whatever the rank or world size.
        torch.manual_seed(self.spec.seed)

    def _announce_start(self) -> None:
        """Rank 0, once: the worker group is ready (the job log and its timeline)."""
        if self._announced:
            return
        self._announced = True
        if self.rank != 0:
            return
        resumed = self._resumed_from
        if resumed is not None:
            logger.info("resumed from step %d (epoch %d)", resumed, self._state.epoch)
        logger.info(
            "rank 0 of %d ready in %.1f s (model built, data stream open)",
            self.world_size,
            time.perf_counter() - self._started,
        )
        self.telemetry.event(
            GROUP_STARTED,
            step=resumed or 0,
            message=f"worker group of {self.world_size} started (attempt {self.request.attempt}) "
            + (f"from its checkpoint at step {resumed}" if resumed is not None else "from step 0"),
            world_size=self.world_size,
        )
        if resumed is not None:
            # The checkpoint the group resumed from is complete: the control plane records it if the
            # attempt that wrote it died before reporting it (e.g. the run's last one, after which
            # this attempt has no step left to take and no checkpoint to write).
            self.telemetry.checkpoint_saved(resumed, self.checkpointer.uri(resumed), resumed=True)

    def _finish(self) -> None:
        """The loop returned (on every rank): complete the checkpoint in flight, and save the last
        reported step unless a checkpoint holds it."""
        if self._profiler is not None:
            self._profiler.finish(self._state.step)  # a window the loop left before its end
        self.checkpointer.flush()
        parts, state = self._parts, self._state
        saved = self.checkpointer.started_step
        if saved is None:
            saved = self._resumed_from
        if parts is not None and state.step > 0 and saved != state.step:
            self.checkpointer.save(parts, state, metrics=self._metrics)
        self.telemetry.progress("done")

    def _close(self) -> None:
        self._close_stream()
        self._resume_folder.close()


class _ContextBatches(Iterator[Batch]):
    """What `TrainContext.batches` returns: the context's next batch, each time."""

    def __init__(self, context: TrainContext) -> None:
        self._context = context

    def __next__(self) -> Batch:
        return self._context.next_batch()


class _DictState:
    """A dict as checkpointed state: saved as it is, loaded back into the same dict."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.clear()
        self.state.update(state)


def metric_values(metrics: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """Metrics as numbers: floats, ints and one-element tensors; anything else is a TypeError."""
    values: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise TypeError(f"metric {name!r} is a tensor of {value.numel()} elements, not a scalar")
            values[name] = float(value.detach().item())
        elif isinstance(value, int | float) and not isinstance(value, bool):
            values[name] = float(value)
        else:
            raise TypeError(f"metric {name!r} is a {type(value).__name__}, not a number")
    return values


def configure_logging(rank: int) -> None:
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


@contextlib.contextmanager
def open_context(loop_config: dict[str, Any]) -> Iterator[TrainContext]:
    """This rank's context for the job in Ray Train's `loop_config` (inside a Ray Train worker).

    A normal exit completes the checkpoints (`_finish`, a collective); an exception leaves them.
    """
    config = LoopConfig.from_dict(loop_config)
    request, dataset = config.request, config.dataset
    train_context = ray.train.get_context()
    rank, world_size = train_context.get_world_rank(), train_context.get_world_size()
    device = ray.train.torch.get_device()
    configure_logging(rank)
    with contextlib.ExitStack() as stack:
        telemetry = stack.enter_context(
            Telemetry(url=request.telemetry_url, attempt=request.attempt, rank=rank, token=config.token())
        )
        checkpointer = stack.enter_context(
            Checkpointer(
                request,
                row_shape=dataset.row_shape if dataset is not None else {},
                rank=rank,
                telemetry=telemetry,
                device=device,
            )
        )
        context = TrainContext(
            request=request,
            dataset=dataset,
            rank=rank,
            world_size=world_size,
            device=device,
            telemetry=telemetry,
            checkpointer=checkpointer,
        )
        stack.callback(context._close)
        telemetry.node = f"{ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()[:8]})"
        if device.type == "cuda":  # the GPU figures of this rank's status (trainers.system)
            telemetry.system.cuda_device = (
                device.index if device.index is not None else torch.cuda.current_device()
            )
        context._begin()
        yield context
        context._finish()


def run_loop(function: Callable[[TrainContext], Any], loop_config: dict[str, Any]) -> None:
    """Run an own loop (`def train(ctx: TrainContext)`) on this rank (`trainers.launch`)."""
    with open_context(loop_config) as context:
        function(context)
