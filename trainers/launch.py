"""Entrypoint of one training job on the Ray cluster.

The service submits it as a Ray job, with a `LaunchPointer` as JSON in `APIARY_LAUNCH`
(`service.contract.protocol`); the `LaunchRequest` itself (the spec with it) is in the attempt's handoff
folder
in storage (`service.contract.handoff`):

    APIARY_LAUNCH='{"job_id": 1, "attempt": 1, "handoff_uri": "file:///.../job-1/_apiary/attempt-1"}' \
        python -m trainers.launch

`main()` connects to the job's cluster and calls `run()`, which checks the dataset on the driver
(footers only), caps the job's Ray Data CPU use at `request.data_cpus` (so data tasks can never take
the CPUs the train workers need, nor the reverse starve data), and runs Ray Train's data-parallel
trainer (torch process groups: gloo on CPU, nccl on GPU) under `{storage_uri}/{run_name}`, where Ray
Train also finds the checkpoint to resume from when a job is resubmitted with the same run name.

The trainer is Ray Train V2's `DataParallelTrainer` with `trainers.backend.ProcessGroupConfig`,
which is what `TorchTrainer` is with `TorchConfig`, minus the torch import: neither this driver nor
the Train controller imports torch (each import delays the workers' start). So this module
imports no torch either: the recipes' train loop is reached through `recipe_train_loop`. What the
spec's `trainer` is, a recipe, an own loop or a Ray function (`trainer_kind`), is read from its
module's source; a recipe's module is imported here, for its config schema and column check (the
built-ins' module imports no torch), a function's only on the workers (`context_train_loop` for an
own loop, which gets its `trainers.context.TrainContext`; `run_custom_trainer` for a Ray function).
`ApiaryTrainer` (`trainers.ray_private`) also leaves out
two of Ray Train's helper actors, a process each per job. Every process of the job prints its
start-up marks (`trainers.startup`) for `benchmarks/overhead.py`.

Exit status 0 means the job reached `max_steps`. Anything else exits 1 with, as the last line on
stderr, `apiary-error: <one-line reason a user can act on>` when the job failed for good (its code,
its data, its failure budget spent) or `apiary-retry: <reason>` when something outside it failed
(`service.contract.protocol.error_line`); the service's reconciler reads the last such line from the Ray
job's logs and recovers a retryable failure from the latest checkpoint.

Failures inside the run: Ray Train restarts the worker group from the latest checkpoint when a worker
dies, at most `request.failures_left` times (what is left of the spec's `max_failures`). The failure
policy (`trainers.ray_private.ApiaryFailurePolicy`, with `is_own_failure` and `post_restart` from
here) changes one thing in Ray Train's default policy: a group whose ranks raised exceptions of their
own (none died, and none is a collective broken by another rank's death) failed by the job's own
code, which fails again the same way: it is not retried. Each restart it allows is posted to the
control plane as a `worker_failed` event.

Every name this package takes from Ray's private API is in `trainers.ray_private`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import ray
import ray.data
import ray.train
from pydantic import ValidationError
from ray.data import ExecutionOptions, ExecutionResources
from ray.train.v2.api.config import FailureConfig
from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError

from service.contract.errors import DatasetError, one_line
from service.contract.handoff import pointer_from_env, read_launch, read_token, redeem_credentials
from service.contract.protocol import (
    LAUNCH_ENV_VAR,
    WORKER_FAILED,
    LaunchPointer,
    LaunchRequest,
    clip_reason,
    error_line,
    find_module,
)
from service.contract.spec import ON_DEMAND_SELECTOR, JobSpec, SpotUse
from service.contract.storage import checkpoint_uri, resolve_uri, use_s3_credentials
from service.contract.trainer_kind import (
    CONTEXT_TYPE,
    TrainerKind,
    TrainerNotDefined,
    kind_of_trainer,
    kind_refusal,
)
from trainers import startup
from trainers.backend import ProcessGroupConfig
from trainers.data import DatasetInfo, inspect_dataset
from trainers.data_order import Slice
from trainers.data_stream import build_epoch_dataset
from trainers.loop_config import LoopConfig
from trainers.ray_private import (
    ApiaryTrainer,
    install_failure_policy,
    is_ray_train_error,
    unwrap_user_exception,
)
from trainers.recipe import BUILTIN_RECIPES, Recipe, import_trainer, recipe_for
from trainers.telemetry import Telemetry

logger = logging.getLogger(__name__)

# What a custom trainer passes to `ray.train.get_dataset_shard`.
DATASET_NAME = "train"


class TrainingFailed(RuntimeError):
    """The worker group failed for good (after `max_failures` restarts); str() is the user-facing reason.

    `retryable`: the failure was Ray Train's own (its controller), not the job's."""

    def __init__(self, reason: str, *, retryable: bool = False) -> None:
        super().__init__(reason)
        self.retryable = retryable


# A rank's exception that is the collateral of another rank's death (a collective whose peer is gone).
_COLLATERAL = re.compile(
    r"gloo|nccl|connection (closed|reset) by peer|broken pipe|DistBackendError|DistNetworkError",
    re.IGNORECASE,
)


def is_own_failure(training_failed_error: TrainingFailedError) -> bool:
    """Whether a worker group failed by the job's own code: every failed rank raised an exception of
    its own (not a dead worker, not a Ray system error, not a collective broken by a dead peer). It
    fails again the same way, so Ray Train does not retry it; everything else it retries within
    `max_failures`."""
    failures = _worker_failures(training_failed_error)
    if failures and all(_is_own_error(error) for error in failures.values()):
        logger.error("the job's own code failed: not retried")
        return True
    return False


def post_restart(
    training_failed_error: TrainingFailedError, *, request: LaunchRequest, token: str | None
) -> None:
    """Tell the job's telemetry that Ray Train restarts the worker group (a `worker_failed` event)."""
    ranks = ", ".join(
        f"rank {rank}: {_error_text(error)[:300]}"
        for rank, error in sorted(_worker_failures(training_failed_error).items())
    )
    telemetry = Telemetry(
        url=request.telemetry_url,
        attempt=request.attempt,
        rank=0,
        token=token,
        close_retry_s=5.0,
    )
    telemetry.event(
        WORKER_FAILED,
        step=0,
        message=f"worker group failed ({ranks or 'the controller'}); Ray Train restarts it from "
        "the latest checkpoint",
    )
    telemetry.close()


def _worker_failures(training_failed_error: TrainingFailedError) -> dict[int, Exception]:
    if isinstance(training_failed_error, WorkerGroupError):
        return training_failed_error.worker_failures
    return {}


def _is_own_error(error: BaseException) -> bool:
    """Whether a rank's failure is an exception of the job's own code (Ray hands the rank's exception
    over as raised; older releases wrapped it in UserExceptionWithTraceback)."""
    error = unwrap_user_exception(error)
    if (is_ray_train_error(error) or isinstance(error, ray.exceptions.RayError)) and not isinstance(
        error, ray.exceptions.RayTaskError
    ):
        return False  # a dead or unresponsive worker (WorkerHealthCheckFailedError), Ray's own trouble
    return not _COLLATERAL.search(f"{type(error).__name__}: {error}")


@dataclass(frozen=True, kw_only=True)
class RunResult:
    run_name: str
    # Rank 0's metrics at the last checkpoint ("step", "samples_consumed" and the step metrics).
    metrics: dict[str, Any] = field(default_factory=dict)
    # The latest checkpoint as a URI (see service.contract.storage.checkpoint_uri) and as Ray reported it.
    checkpoint_uri: str | None = None
    checkpoint_path: str | None = None
    elapsed_s: float = 0.0

    @property
    def step(self) -> int:
        """Rank 0's step at the last checkpoint; 0 without one."""
        return int(self.metrics.get("step", 0))


def run(request: LaunchRequest, *, pointer: LaunchPointer | None = None) -> RunResult:
    """Train one job to `max_steps` on the connected Ray cluster.

    `pointer`: the attempt's handoff (service.contract.handoff), whose report token every post to the control
    plane carries; None for a run without one (telemetry then goes without a token).

    Raises `ValueError` for a job that cannot run as specified (dataset, storage, trainer), found
    before any worker starts, and `TrainingFailed` when training itself failed.
    """
    started = time.monotonic()
    spec = request.spec
    token = read_token(pointer) if pointer is not None else None
    kind = trainer_kind(spec.trainer)
    # A recipe's module is imported here: its config and its column check run before any worker starts.
    recipe = recipe_for(spec) if kind is TrainerKind.RECIPE else None
    refused = kind_refusal(spec, kind)
    if refused is not None:
        raise ValueError(f"{refused.field}: {refused.message}")
    train_fn = train_function_for(kind, spec.trainer)
    # A function trainer may have no dataset: it reads its own data.
    dataset_info = (
        inspect_dataset(spec, recipe=recipe, s3_endpoint_url=request.s3_endpoint_url)
        if spec.dataset is not None
        else None
    )
    eval_info = (
        inspect_eval_dataset(spec, recipe=recipe, train=dataset_info, s3_endpoint_url=request.s3_endpoint_url)
        if dataset_info is not None
        else None
    )
    startup.mark("checked")
    storage_path, storage_filesystem = resolve_uri(
        request.storage_uri, s3_endpoint_url=request.s3_endpoint_url
    )
    logger.info(
        "job %d attempt %d: %s (%s) on %s workers, %s, %s, run %s/%s",
        request.job_id,
        request.attempt,
        spec.trainer,
        kind,
        f"{spec.min_workers}-{spec.max_workers}" if spec.is_elastic else spec.max_workers,
        f"{spec.max_steps} steps" if spec.max_steps is not None else "until the function returns",
        f"dataset {dataset_info.uri} ({dataset_info.num_rows} rows, {len(dataset_info.files)} files)"
        if dataset_info is not None
        else "no dataset",
        request.storage_uri,
        request.run_name,
    )

    failure_config = FailureConfig(
        max_failures=spec.max_failures if request.failures_left is None else request.failures_left
    )
    # Pickled to the Train controller with the policy: a module-level function and a partial of one.
    install_failure_policy(
        is_final=is_own_failure, on_retry=functools.partial(post_restart, request=request, token=token)
    )
    trainer = ApiaryTrainer(
        train_fn,
        # The handoff pointer, not the token: Ray Train keeps the loop config; each worker reads the
        # token from storage (trainers.loop_config.LoopConfig.token).
        train_loop_config=LoopConfig(
            request=request, dataset=dataset_info, eval_dataset=eval_info, handoff=pointer
        ).to_dict(),
        backend_config=ProcessGroupConfig(backend="nccl" if spec.uses_gpu else "gloo"),
        scaling_config=build_scaling_config(spec),
        run_config=ray.train.RunConfig(
            name=request.run_name,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            failure_config=failure_config,
        ),
        # Recipes and own loops read their own deterministic per-rank streams (trainers.data_stream);
        # a Ray function still gets the whole dataset through `ray.train.get_dataset_shard`.
        datasets=(
            {DATASET_NAME: build_ray_dataset(dataset_info, s3_endpoint_url=request.s3_endpoint_url)}
            if kind is TrainerKind.RAY_FUNCTION and dataset_info is not None
            else None
        ),
        dataset_config=ray.train.DataConfig(
            # The dataset's own DataContext execution options: this job's data tasks stay within
            # data_cpus whatever else runs on the cluster.
            execution_options=ExecutionOptions(
                resource_limits=ExecutionResources.for_limits(cpu=request.data_cpus)
            ),
        ),
    )
    startup.mark("fit_called")
    startup.emit("driver")
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as err:
        raise TrainingFailed(
            failure_reason(err), retryable=isinstance(err, ray.train.ControllerError)
        ) from err

    checkpoint = result.checkpoint
    return RunResult(
        run_name=request.run_name,
        metrics=dict(result.metrics or {}),
        checkpoint_uri=(
            checkpoint_uri(
                storage_uri=request.storage_uri,
                run_name=request.run_name,
                name=PurePosixPath(checkpoint.path).name,
            )
            if checkpoint is not None
            else None
        ),
        checkpoint_path=checkpoint.path if checkpoint is not None else None,
        elapsed_s=time.monotonic() - started,
    )


def inspect_eval_dataset(
    spec: JobSpec, *, recipe: Recipe[Any] | None, train: DatasetInfo, s3_endpoint_url: str | None
) -> DatasetInfo | None:
    """The spec's eval dataset, checked on the driver as the training data is (its rows must have the
    training data's shape: the model is sized by it); None without `eval`, or for a function trainer."""
    if spec.eval is None or recipe is None:
        return None
    info = inspect_dataset(
        spec.model_copy(update={"dataset": spec.eval.dataset}), recipe=recipe, s3_endpoint_url=s3_endpoint_url
    )
    if info.row_shape != train.row_shape:
        raise DatasetError(
            f"eval dataset {info.uri}: rows of shape {info.row_shape}, the training data's are "
            f"{train.row_shape}",
            field="eval.dataset.uri",
        )
    return info


def trainer_kind(trainer: str) -> TrainerKind:
    """What `trainer` is (a recipe, an own loop, a Ray function), or ValueError saying why it cannot run.

    Read from its module's source (`service.contract.trainer_kind`), which a typo fails before any
    worker starts; only when the source cannot tell (the name is assigned, imported, decorated) is
    the module imported here to look at the object.
    """
    if trainer in BUILTIN_RECIPES:
        return TrainerKind.RECIPE
    module_name, attr = _split_trainer(trainer)
    if find_module(module_name) is None:
        raise ValueError(f"trainer {trainer!r}: cannot find module {module_name!r}")
    try:
        kind = kind_of_trainer(trainer)
    except TrainerNotDefined:
        raise ValueError(f"trainer {trainer!r}: module {module_name!r} has no {attr!r}") from None
    if kind is not None:
        return kind
    found = import_trainer(trainer)
    if isinstance(found, type):
        return TrainerKind.RECIPE
    if not callable(found):
        raise ValueError(f"trainer {trainer!r}: {attr} is neither a recipe class nor a function")
    try:
        parameters = list(inspect.signature(found).parameters.values())
    except (TypeError, ValueError):
        return TrainerKind.RAY_FUNCTION
    if parameters and _type_name(parameters[0].annotation) == CONTEXT_TYPE:
        return TrainerKind.LOOP
    return TrainerKind.RAY_FUNCTION


def _type_name(annotation: Any) -> str | None:
    """The last dotted name of an annotation (a class, or a string under postponed evaluation)."""
    if isinstance(annotation, str):
        return annotation.rsplit(".", 1)[-1].strip() or None
    return getattr(annotation, "__name__", None)


def train_function_for(kind: TrainerKind, trainer: str) -> Callable[[dict[str, Any]], Any]:
    """The per-worker function Ray Train runs for a trainer of `kind`: Apiary's loop for a recipe, the
    trainer itself for a function (imported on the workers only)."""
    if kind is TrainerKind.RECIPE:
        return recipe_train_loop
    if kind is TrainerKind.LOOP:
        return functools.partial(context_train_loop, trainer)
    return functools.partial(run_custom_trainer, trainer)


def recipe_train_loop(loop_config: dict[str, Any]) -> None:
    """`trainers.loop.train_loop_per_worker`, imported on the worker that runs it (with torch)."""
    startup.mark("loop_entered")
    from trainers.loop import train_loop_per_worker

    startup.mark("loop_imported")

    train_loop_per_worker(loop_config)


def context_train_loop(trainer: str, loop_config: dict[str, Any]) -> None:
    """An own loop (`def train(ctx: TrainContext)`), called on every worker with its training context
    (`trainers.context`, imported here: it imports torch)."""
    startup.mark("loop_entered")
    from trainers.context import run_loop

    startup.mark("loop_imported")
    run_loop(import_trainer(trainer), loop_config)


def run_custom_trainer(trainer: str, loop_config: dict[str, Any]) -> None:
    """On a worker: the start-up marks (what follows is the trainer's own), then the trainer.

    A function trainer (`trainer: "package.module:function"`) is run as Ray Train runs one: with the
    spec's `config` if it takes an argument, else with none (`trainers.ray_function`, which also sees
    its reports).

    It reads its shard with `ray.train.get_dataset_shard("train")` and must call `ray.train.report`
    the same number of times on every rank. Its module is imported on the workers only: it imports
    torch, which would cost the driver seconds on the way to step 1 (benchmarks/overhead.py).
    """
    startup.mark("loop_entered")
    startup.emit(f"rank {ray.train.get_context().get_world_rank()}")
    from trainers.ray_function import run_ray_function

    run_ray_function(load_custom_trainer(trainer), loop_config)


def load_custom_trainer(trainer: str) -> Callable[[dict[str, Any]], Any]:
    """Import `package.module:function` and return the function, or raise ValueError saying why not."""
    function = import_trainer(trainer)
    if not callable(function):
        module_name, attr = _split_trainer(trainer)
        raise ValueError(f"trainer {trainer!r}: module {module_name!r} has no function {attr!r}")
    return function


def _split_trainer(trainer: str) -> tuple[str, str]:
    module_name, _, attr = trainer.partition(":")
    if not module_name or not attr:
        raise ValueError(f"trainer {trainer!r} must look like 'package.module:Name'")
    return module_name, attr


def build_scaling_config(spec: JobSpec) -> ray.train.ScalingConfig:
    """Ray Train's worker group: a fixed size, or `(min, max)` for elastic training (spec.ElasticWorkers)."""
    num_workers: int | tuple[int, int] = (
        (spec.min_workers, spec.max_workers) if spec.is_elastic else spec.max_workers
    )
    return ray.train.ScalingConfig(
        # Ray Train V2 (the default in 2.60) takes the (min, max) tuple; the type stubs are V1's.
        num_workers=num_workers,  # type: ignore[arg-type]
        use_gpu=spec.uses_gpu,
        resources_per_worker=dict(spec.resources_per_worker),
        placement_strategy=spec.placement.upper(),
        # A `never` job's placement group is held off spot nodes (those labelled spot=true).
        label_selector=dict(ON_DEMAND_SELECTOR) if spec.spot_use is SpotUse.NEVER else None,  # type: ignore[call-arg]
    )


def build_ray_dataset(info: DatasetInfo, *, s3_endpoint_url: str | None = None) -> ray.data.Dataset:
    """A lazy Ray Data dataset over exactly the units `inspect_dataset` checked, in canonical order."""
    return build_epoch_dataset(
        info.shard_source(s3_endpoint_url=s3_endpoint_url),
        [Slice(unit, 0, unit.num_rows) for unit in info.read_units()],
    )


def failure_reason(err: BaseException) -> str:
    """One line a user can act on, from whatever stopped the job."""
    if isinstance(err, TrainingFailed | ValueError | ValidationError):
        reason = _error_text(err)
    elif isinstance(err, ray.train.WorkerGroupError) and err.worker_failures:
        rank = min(err.worker_failures)
        cause = _root_cause(err.worker_failures[rank])
        where = f"rank {rank}" if len(err.worker_failures) == 1 else f"rank {rank} (and others)"
        # A ValueError from a worker is a data or config mistake: its message is the whole story.
        reason = (
            _error_text(cause)
            if isinstance(cause, ValueError)
            else f"training failed on {where}: {type(cause).__name__}: {_error_text(cause)}"
        )
    elif isinstance(err, ray.train.ControllerError):
        cause = _root_cause(err.controller_failure)
        reason = f"Ray Train controller failed: {type(cause).__name__}: {_error_text(cause)}"
    else:
        reason = f"{type(err).__name__}: {_error_text(err)}"
    return clip_reason(reason)


def _root_cause(err: BaseException) -> BaseException:
    """The user's exception inside Ray's wrappers (RayTaskError keeps it as `.cause`)."""
    seen: set[int] = set()
    while id(err) not in seen:
        seen.add(id(err))
        inner = getattr(err, "cause", None)
        if isinstance(inner, BaseException):
            err = inner
        elif isinstance(err, ray.exceptions.RayTaskError) and err.__cause__ is not None:
            err = err.__cause__
        else:
            break
    return err


def _error_text(err: BaseException) -> str:
    if isinstance(err, ray.exceptions.RayError):
        # Ray's str() carries the remote traceback; the last line is the exception itself.
        lines = [line for line in str(err).splitlines() if line.strip()]
        return one_line(lines[-1]) if lines else type(err).__name__
    return one_line(err)


def main() -> int:
    startup.mark("imports_done")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        pointer = pointer_from_env()
    except (ValueError, ValidationError) as err:
        return _fail(f"{LAUNCH_ENV_VAR} is not a valid launch pointer: {_error_text(err)}")
    if pointer is None:
        return _fail(f"{LAUNCH_ENV_VAR} is not set: this entrypoint is started by the Apiary service")
    try:
        # In memory only: this process's S3 filesystems, its workers' (loop config) and its read tasks'.
        use_s3_credentials(redeem_credentials(pointer))
    except ValueError as err:
        # The control plane may be unreachable for a moment: a new attempt (a new token) may succeed.
        return _fail(f"cannot fetch the job's credentials: {_error_text(err)}", retryable=True)
    try:
        request = read_launch(pointer)
    except (ValueError, ValidationError) as err:
        # Storage may be unreachable for a moment: a new attempt may succeed.
        return _fail(f"cannot read the launch request: {_error_text(err)}", retryable=True)
    try:
        # Inside a Ray job, RAY_ADDRESS points at the job's cluster and this connects to it.
        ray.init()
        startup.mark("connected")
        result = run(request, pointer=pointer)
    except Exception as err:
        logger.error("job %d attempt %d failed:\n%s", request.job_id, request.attempt, traceback.format_exc())
        return _fail(failure_reason(err), retryable=_is_retryable(err))
    logger.info(
        "job %d attempt %d %s in %.1f s, %s",
        request.job_id,
        request.attempt,
        "stopped early (asked to)"
        if request.spec.max_steps is not None and 0 < result.step < request.spec.max_steps
        else "done",
        result.elapsed_s,
        # Ray Train knows the step only from a checkpoint's metrics: a custom trainer may report none.
        f"last checkpoint {result.checkpoint_uri} at step {result.step}"
        if result.checkpoint_uri is not None
        else "no checkpoint reported",
    )
    ray.shutdown()
    return 0


def _is_retryable(err: Exception) -> bool:
    """Whether a failure of the driver may go away on a new attempt: not the job's code, data or spec."""
    if isinstance(err, TrainingFailed):
        return err.retryable
    return not isinstance(err, ValueError | ValidationError)


def _fail(reason: str, *, retryable: bool = False) -> int:
    # Shut Ray down first: it stops the threads that forward worker logs to this process, so
    # nothing can be printed after the reason and it stays the last line of the job's log.
    if ray.is_initialized():
        ray.shutdown()
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.write(error_line(reason, retryable=retryable) + "\n")
    sys.stderr.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main())
