"""Ray Train functions, unchanged: a function written as Ray Train's documentation shows runs as an
Apiary job, with Apiary's guarantees.

    def train_func(config):            # or train_func(): Ray accepts both, and so does Apiary
        start = 0
        checkpoint = ray.train.get_checkpoint()
        if checkpoint:                 # a restart, a recovery or a preempted job admitted again
            with checkpoint.as_directory() as folder:
                start = ...            # the function restores its own state
        for epoch in range(start, config["epochs"]):
            ...
            with tempfile.TemporaryDirectory() as folder:
                torch.save(..., os.path.join(folder, "model.pt"))
                ray.train.report({"loss": loss}, checkpoint=ray.train.Checkpoint.from_directory(folder))

`run_ray_function` runs it on every worker of the group (`trainers.launch` hands Ray Train a partial
of it), with the spec's `config` as `config`, and around every `ray.train.report` (however the
function imported it; `trainers.ray_private.intercept_report`):

- the step of a report is the metric `step` when the function reports one (an integer), else the
  count of reports since the run started: progress is counted in reports. A checkpoint the function
  does not name goes in the run's folder as `checkpoint_<step>` (`trainers.checkpoint`'s names), so
  a run resumed from one goes on counting from its step;
- this rank's numeric metrics become a telemetry point at that step (`trainers.telemetry`: the
  metrics endpoint, the streams, the web charts, Prometheus), posted before a report that carries a
  checkpoint goes to Ray Train (a group restarted from that checkpoint never takes those steps
  again, so they must not die in a killed rank's buffer), and its phase goes to the control
  plane with every post (`sync` inside a report, `compute` between two), so the service's hang
  detection judges the time between reports;
- a checkpoint Ray Train has persisted is recorded with the control plane (a checkpoint row, the
  job's latest checkpoint), by rank 0 after its metrics when rank 0 reported one, else by each rank
  that did (the same URI, stored once); the service's `keep_last`/`keep_best` retention then
  applies to it. With `checkpoint_upload_mode=ASYNC` it is recorded at a later report or at the end
  (where the function's uploads are waited for). The checkpoint a worker group resumes from is
  recorded by rank 0 at the group's start (the attempt that wrote it may have died before recording
  it);
- then the ranks agree on rank 0's word from the control plane (`ray.train.collective.
  broadcast_from_rank_zero`, one small round trip per report): when the job was asked to stop (a
  preemption, its max_runtime_s), every rank leaves the function there, at the same report, by an
  exception that `run_ray_function` catches (a `BaseException`, so the function's own `except
  Exception` cannot swallow it). The worker group then ends as a finished run, and the service
  requeues the job: its next attempt is the same Ray Train run (one run name, one storage folder),
  so `ray.train.get_checkpoint()` hands the function its latest checkpoint, as it does after a
  worker-group restart inside an attempt.

Nothing else changes: `ray.train.get_dataset_shard("train")` (when the spec has a dataset),
`get_context()`, the collectives and Ray's upload modes are Ray's own.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
import time
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

import ray
import ray.train
import ray.train.collective
import ray.util

from service.contract.protocol import (
    GROUP_STARTED,
    MAX_METRIC_NAME_CHARS,
    MAX_VALUES_PER_POINT,
    LaunchRequest,
)
from service.contract.storage import checkpoint_uri
from trainers.checkpoint import checkpoint_dir_name as dir_name_for
from trainers.loop_config import LoopConfig
from trainers.ray_private import intercept_report, wait_for_checkpoint_uploads
from trainers.telemetry import Telemetry

logger = logging.getLogger(__name__)

# The metric a function may report to set the step of a report; without it, reports are counted.
STEP_METRIC = "step"
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)$")


class StopRequested(BaseException):
    """The control plane asked the job to stop: raised out of `ray.train.report` on every rank at the
    same report, and caught by `run_ray_function`."""


def step_of_checkpoint(path: str) -> int | None:
    """The step in a checkpoint folder's name, or None for a name the function chose."""
    found = _CHECKPOINT_DIR.match(PurePosixPath(path).name)
    return int(found.group(1)) if found else None


def call_with_config(function: Callable[..., Any], config: dict[str, Any]) -> Any:
    """Call a Ray Train function as Ray does: with `config` when it takes one, else with nothing.

    Raises ValueError for a function that needs more than one argument."""
    required = [
        parameter
        for parameter in inspect.signature(function).parameters.values()
        if parameter.kind is parameter.VAR_POSITIONAL
        or (
            parameter.default is parameter.empty
            and parameter.kind not in (parameter.VAR_KEYWORD, parameter.KEYWORD_ONLY)
        )
    ]
    if len(required) > 1:
        raise ValueError(
            f"a Ray Train function takes no argument or one (config); "
            f"{getattr(function, '__name__', function)} requires {len(required)}"
        )
    return function(config) if required else function()


class Reports:
    """One rank's view of the function's reports: steps, telemetry, checkpoints, the stop request."""

    def __init__(self, request: LaunchRequest, *, telemetry: Telemetry, rank: int) -> None:
        self.request = request
        self.telemetry = telemetry
        self.rank = rank
        self.step = 0
        self._recorded: str | None = None  # the path of the last checkpoint this rank recorded
        self._steps: dict[str, int] = {}  # checkpoint folder name -> step, of this rank's own reports

    def start(self) -> int | None:
        """Join the group (a collective): where the run resumes (the step of `ray.train.get_checkpoint()`;
        None on a fresh run), told to the control plane by rank 0."""
        self.telemetry.node = (
            f"{ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()[:8]})"
        )
        # Which start of the worker group this is: rank 0's clock, shared by every rank.
        self.telemetry.segment = ray.train.collective.broadcast_from_rank_zero(time.time_ns() // 1_000_000)
        world_size = ray.train.get_context().get_world_size()
        return self.resume_from(ray.train.get_checkpoint(), world_size=world_size)

    def resume_from(self, resumed: ray.train.Checkpoint | None, *, world_size: int) -> int | None:
        """`start` once Ray said where the group resumes (no Ray call here): the step it resumes from,
        and rank 0's event and record of that checkpoint."""
        resumed_from = None
        if resumed is not None:
            self._recorded = resumed.path
            resumed_from = step_of_checkpoint(resumed.path)
            if resumed_from is None:
                resumed_from = 0
                if self.rank == 0:
                    logger.warning(
                        "resumed from %s, whose name the function chose: its step is not known, so "
                        "reports are counted from 0 again (report a %r metric to set it)",
                        resumed.path,
                        STEP_METRIC,
                    )
            self.step = resumed_from
        if self.rank == 0:
            self.telemetry.event(
                GROUP_STARTED,
                step=resumed_from or 0,
                message=f"worker group of {world_size} started (attempt {self.request.attempt}) "
                + (f"from its checkpoint at step {resumed_from}" if resumed is not None else "from step 0"),
                world_size=world_size,
            )
            if resumed is not None:
                # Complete (Ray Train persisted it): recorded here in case the attempt that wrote it
                # died before its report left, as the built-in loop does (trainers.context).
                name = PurePosixPath(resumed.path).name
                uri = checkpoint_uri(
                    storage_uri=self.request.storage_uri, run_name=self.request.run_name, name=name
                )
                self.telemetry.checkpoint_saved(resumed_from or 0, uri, resumed=True)
        self.telemetry.progress("compute")
        return resumed_from if resumed is not None else None

    def report(
        self,
        forward: Callable[..., None],
        metrics: dict[str, Any],
        checkpoint: ray.train.Checkpoint | None,
        checkpoint_dir_name: str | None,
        options: dict[str, Any],
    ) -> None:
        """`ray.train.report`, with Apiary's bookkeeping after it (see the module docstring)."""
        step = _reported_step(metrics)
        step = self.step + 1 if step is None else step
        name = checkpoint_dir_name or dir_name_for(step)
        self.telemetry.record(step, _numeric(metrics))
        if checkpoint is not None:
            # Ray Train resumes a restarted group from this checkpoint once every rank reported it: the
            # points up to it must have left this rank by then, or a rank killed later loses them.
            self.telemetry.deliver_before_checkpoint()
        self.telemetry.progress("sync")
        forward(metrics, checkpoint=checkpoint, checkpoint_dir_name=name, **options)
        self.step = step
        if checkpoint is not None:
            self._steps[name] = step
        # Rank 0 records the group's checkpoint after its own metrics (retention's keep_best reads them
        # at the checkpoint's step); another rank only when rank 0 reported none.
        stop, rank0_saved = ray.train.collective.broadcast_from_rank_zero(
            (self.telemetry.stop_requested.is_set(), checkpoint is not None)
        )
        if self.saved_any and (self.rank == 0 or not rank0_saved):
            self.record_checkpoint()  # this report's, or one uploaded in the background since
        self.telemetry.progress("compute", step=step)
        if stop:
            raise StopRequested

    @property
    def saved_any(self) -> bool:
        """Whether this rank reported a checkpoint in this group."""
        return bool(self._steps)

    def record_checkpoint(self) -> None:
        """Tell the control plane of the checkpoint Ray Train persisted for this rank, if it is new."""
        latest = ray.train.get_checkpoint()
        if latest is None or latest.path == self._recorded:
            return
        self._recorded = latest.path
        name = PurePosixPath(latest.path).name
        step = self._steps.get(name, step_of_checkpoint(name))
        if step is None:
            step = self.step
        uri = checkpoint_uri(storage_uri=self.request.storage_uri, run_name=self.request.run_name, name=name)
        self.telemetry.checkpoint_saved(step, uri)


def run_ray_function(function: Callable[..., Any], loop_config: dict[str, Any]) -> None:
    """On a worker: run a Ray Train function with the spec's `config`, its reports seen by Apiary."""
    config = LoopConfig.from_dict(loop_config)
    request = config.request
    rank = ray.train.get_context().get_world_rank()
    with Telemetry(
        url=request.telemetry_url, attempt=request.attempt, rank=rank, token=config.token()
    ) as telemetry:
        reports = Reports(request, telemetry=telemetry, rank=rank)
        resumed_from = reports.start()
        if rank == 0 and resumed_from is not None:
            logger.info("resumed from its checkpoint at step %d", resumed_from)
        with intercept_report(reports.report):
            try:
                call_with_config(function, copy.deepcopy(request.spec.config))
            except StopRequested:
                if rank == 0:
                    logger.info("stopped at step %d, as the control plane asked", reports.step)
        if reports.saved_any:
            wait_for_checkpoint_uploads()  # ASYNC uploads still in flight: recorded once persisted
            reports.record_checkpoint()
        telemetry.progress("done", step=reports.step)


def _reported_step(metrics: dict[str, Any]) -> int | None:
    value = metrics.get(STEP_METRIC)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 0:
        return None
    return int(value)


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a telemetry point can carry: numbers (numpy's scalars too) under names of at most
    MAX_METRIC_NAME_CHARS, at most MAX_VALUES_PER_POINT of them; anything else stays Ray's alone."""
    values: dict[str, float] = {}
    for name, value in metrics.items():
        if (
            name == STEP_METRIC
            or not isinstance(name, str)
            or len(name) > MAX_METRIC_NAME_CHARS
            or isinstance(value, bool | str | bytes)
        ):
            continue
        try:
            values[name] = float(value)
        except (TypeError, ValueError):
            continue
        if len(values) == MAX_VALUES_PER_POINT:
            break
    return values
