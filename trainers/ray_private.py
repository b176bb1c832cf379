"""The one door to Ray's private API: every name Apiary takes from Ray that Ray does not promise to keep.

Checked against ray 2.60.0 (`CHECKED_RAY_VERSION`, the pin in pyproject.toml). When Ray is upgraded,
`tests/unit/test_ray_private.py` fails until someone re-reads Ray's source for each name below and
sets `CHECKED_RAY_VERSION` to the new pin; it also fails when one of them moves, is renamed or changes shape.

What each name is for:

- `ray.train.v2.api.data_parallel_trainer.create_failure_policy`: the module-level factory that
  `DataParallelTrainer.fit()` calls to build the Train controller's failure policy.
  `install_failure_policy` replaces it in this process (the job's driver runs one job) with one that
  builds an `ApiaryFailurePolicy`.
- `ray.train.v2._internal.execution.failure_handling.{DefaultFailurePolicy, FailureDecision}`: Ray
  Train's default policy (the retry budgets of `FailureConfig`), which `ApiaryFailurePolicy` extends,
  and its decisions.
- `ray.train.v2._internal.exceptions.{RayTrainError, UserExceptionWithTraceback}`: Ray Train's own
  errors (a dead worker is a `WorkerHealthCheckFailedError`), and the wrapper that older releases put
  around a rank's exception (`._base_exc`): `is_ray_train_error`, `unwrap_user_exception`.
- `DataParallelTrainer._create_default_callbacks` and the callbacks
  `ray.train.v2._internal.callbacks.{DatasetsCallback, PlacementGroupCleanerCallback}`: the helper
  actors that `ApiaryTrainer` leaves out.
- `ray.train._internal.utils.get_address_and_port`: the rendezvous address, run on rank 0 by
  `trainers.backend` as `TorchConfig`'s backend does.
- `ray.train.v2._internal.util.TrainingFramework`: what `BackendConfig.framework` returns.
- the worker group that Ray hands a `Backend`
  (`ray.train._internal.base_worker_group.BaseWorkerGroup`: `execute`, `execute_async`,
  `execute_single`, `execute_single_async`, `len`), which `trainers.backend` uses untyped (Ray's
  own annotations of its object refs do not agree with each other).
- `ray.train.v2._internal.execution.train_fn_utils.{get_train_fn_utils, set_train_fn_utils}`: the
  worker's holder of the object behind Ray Train's public functions (`ray.train.report`,
  `get_checkpoint`, `get_dataset_shard`, `ray.train.collective.*` all call
  `get_train_fn_utils().<name>(...)`; Ray sets it before the train function starts and documents it
  as the place to change those functions' behaviour). `intercept_report` puts a proxy there for
  the length of a block, whose `report` goes through a hook (`trainers.ray_function`) and whose
  every other member is the original's.
- `ray.train.v2._internal.execution.context.get_train_context().checkpoint_upload_threadpool`: the
  worker's threads of `checkpoint_upload_mode=ASYNC` uploads, which Ray shuts down (waiting) once the
  train function has returned; `wait_for_checkpoint_uploads` waits for them a moment earlier, at the
  end of a Ray Train function, so that its last checkpoint is recorded.
- `ray.train.torch.config`'s private helpers (`TORCH_SET_ENV_VARS`, `TORCH_SETUP_PROCESS_GROUP`,
  `TORCH_SHUTDOWN`), called by name on the workers by `trainers.backend`: that module imports
  torch, which the driver and the controller must not, so they are named here and imported only
  where they run.

This module imports no torch. The service uses only Ray's public client APIs (`ray.job_submission`,
`ray.util.state`) and has no door of its own; `tests/unit/test_layering.py` keeps every other module
of the repository off Ray's private paths.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ray.train._internal.utils import get_address_and_port
from ray.train.v2._internal.callbacks import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.exceptions import RayTrainError, UserExceptionWithTraceback
from ray.train.v2._internal.execution.context import get_train_context
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils, set_train_fn_utils
from ray.train.v2._internal.util import TrainingFramework
from ray.train.v2.api import data_parallel_trainer
from ray.train.v2.api.config import FailureConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.train.v2.api.exceptions import TrainingFailedError

__all__ = [
    "CHECKED_RAY_VERSION",
    "TORCH_SETUP_PROCESS_GROUP",
    "TORCH_SET_ENV_VARS",
    "TORCH_SHUTDOWN",
    "ApiaryFailurePolicy",
    "ApiaryTrainer",
    "ReportHook",
    "TrainingFramework",
    "get_address_and_port",
    "install_failure_policy",
    "intercept_report",
    "is_ray_train_error",
    "unwrap_user_exception",
    "wait_for_checkpoint_uploads",
]

logger = logging.getLogger(__name__)

CHECKED_RAY_VERSION = "2.60.0"

# `ray.train.torch.config`'s helpers behind `TorchConfig`'s backend, which `trainers.backend` calls
# by name on each worker: the environment variables of torch.distributed, the process group (keyword
# arguments backend, world_rank, world_size, init_method, timeout_s), and its end
# (destroy_process_group).
TORCH_SET_ENV_VARS = "_set_torch_distributed_env_vars"
TORCH_SETUP_PROCESS_GROUP = "_setup_torch_process_group"
TORCH_SHUTDOWN = "_shutdown_torch"


class ApiaryFailurePolicy(DefaultFailurePolicy):
    """Ray Train's default failure policy, with a say before it and a word after each retry.

    Built in the driver, pickled to the Train controller and run there: `is_final` and `on_retry`
    must pickle (module-level functions, or partials of them). A failure that `is_final` calls final
    is raised at once, without spending the retry budget; every other one is Ray's default decision,
    and `on_retry` hears of each retry it allows.
    """

    def __init__(
        self,
        failure_config: FailureConfig,
        *,
        is_final: Callable[[TrainingFailedError], bool],
        on_retry: Callable[[TrainingFailedError], None],
    ) -> None:
        super().__init__(failure_config)
        self.is_final = is_final
        self.on_retry = on_retry

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        if self.is_final(training_failed_error):
            return FailureDecision.RAISE
        decision = super().make_decision(training_failed_error)
        if decision is FailureDecision.RETRY:
            self.on_retry(training_failed_error)
        return decision


def install_failure_policy(
    *,
    is_final: Callable[[TrainingFailedError], bool],
    on_retry: Callable[[TrainingFailedError], None],
) -> None:
    """Have every later `DataParallelTrainer.fit()` in this process run an `ApiaryFailurePolicy`
    with these hooks, on its run's `FailureConfig`."""

    def create_failure_policy(failure_config: FailureConfig) -> ApiaryFailurePolicy:
        return ApiaryFailurePolicy(failure_config, is_final=is_final, on_retry=on_retry)

    # Ray's factory is typed with V1's FailureConfig; fit() passes the run's V2 one.
    data_parallel_trainer.create_failure_policy = create_failure_policy  # type: ignore[assignment]


def is_ray_train_error(error: BaseException) -> bool:
    """Whether `error` is one of Ray Train's own (a dead or unresponsive worker, a failed start)."""
    return isinstance(error, RayTrainError)


def unwrap_user_exception(error: BaseException) -> BaseException:
    """A rank's exception as raised: Ray hands it over as such; older releases wrapped it."""
    return error._base_exc if isinstance(error, UserExceptionWithTraceback) else error


class ApiaryTrainer(DataParallelTrainer):
    """Ray Train's data-parallel trainer without two helper actors that a run of its own Ray job
    does not need. Each helper is one more Python process per job (Ray, Ray Train and pandas
    imported), started beside the worker group on the way to step 1 (benchmarks/overhead.py):

    - the `PlacementGroupCleaner`, a detached actor that removes the worker group's placement group
      if the controller dies while its driver lives on (Ray Tune's case). Here the driver exits when
      the controller fails (`fit()` raises), which ends the Ray job, and Ray removes the placement
      groups of a finished job itself;
    - for a built-in trainer, which reads its own per-rank streams (`trainers.data_stream`) and passes
      no datasets, the `DatasetManager` that would hand out shards of none.
    """

    def _create_default_callbacks(self) -> list[Any]:
        return [
            callback
            for callback in super()._create_default_callbacks()
            if not isinstance(callback, PlacementGroupCleanerCallback)
            and not (isinstance(callback, DatasetsCallback) and not self.datasets)
        ]


class ReportHook(Protocol):
    """What `intercept_report` calls in place of Ray's `report`: `forward(metrics, checkpoint=...,
    checkpoint_dir_name=..., **options)` is Ray's own, and `options` the other keyword arguments the
    caller gave (`checkpoint_upload_mode`, ...)."""

    def __call__(
        self,
        forward: Callable[..., None],
        metrics: dict[str, Any],
        checkpoint: Any,
        checkpoint_dir_name: str | None,
        options: dict[str, Any],
    ) -> None: ...


class _ReportProxy:
    """Ray's train function utilities with `report` going through a hook; everything else is theirs."""

    def __init__(self, original: Any, hook: ReportHook) -> None:
        self._original = original
        self._hook = hook

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint: Any = None,
        checkpoint_dir_name: str | None = None,
        **options: Any,
    ) -> None:
        # `ray.train.report` passes every argument by keyword (ray/train/v2/api/train_fn_utils.py).
        self._hook(self._original.report, metrics, checkpoint, checkpoint_dir_name, options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


@contextlib.contextmanager
def intercept_report(hook: ReportHook) -> Iterator[None]:
    """On a Ray Train worker: inside the block, every `ray.train.report(...)` (however the caller
    imported it) calls `hook` with Ray's own report to forward to."""
    original = get_train_fn_utils()
    set_train_fn_utils(_ReportProxy(original, hook))
    try:
        yield
    finally:
        set_train_fn_utils(original)


def wait_for_checkpoint_uploads() -> None:
    """On a Ray Train worker: return once this worker's background checkpoint uploads are done (Ray
    does the same right after the train function returns; doing it twice is harmless)."""
    get_train_context().checkpoint_upload_threadpool.shutdown(wait=True)
