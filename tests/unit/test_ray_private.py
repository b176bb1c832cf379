"""Ray's private API as `trainers.ray_private` uses it: fails when Ray moves, renames or reshapes a name.

The only test module besides the door itself that may name Ray's private paths
(tests/unit/test_layering.py).
"""

from __future__ import annotations

import dataclasses
import dis
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import ray
import ray.train
from ray.exceptions import ActorDiedError
from ray.train._internal.base_worker_group import BaseWorkerGroup
from ray.train.v2._internal.callbacks import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.exceptions import UserExceptionWithTraceback, WorkerHealthCheckFailedError
from ray.train.v2._internal.execution.context import TrainContext
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2._internal.execution.train_fn_utils import (
    TrainFnUtils,
    get_train_fn_utils,
    set_train_fn_utils,
)
from ray.train.v2._internal.execution.worker_group import WorkerGroup
from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker
from ray.train.v2.api import data_parallel_trainer
from ray.train.v2.api.config import FailureConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError

from trainers import ray_private
from trainers.backend import ProcessGroupConfig
from trainers.launch import is_own_failure
from trainers.ray_private import (
    CHECKED_RAY_VERSION,
    TORCH_SET_ENV_VARS,
    TORCH_SETUP_PROCESS_GROUP,
    TORCH_SHUTDOWN,
    ApiaryFailurePolicy,
    ApiaryTrainer,
    TrainingFramework,
    get_address_and_port,
    install_failure_policy,
    intercept_report,
    is_ray_train_error,
    unwrap_user_exception,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_ray_is_the_one_the_door_was_checked_against() -> None:
    pin = re.search(r'"ray\[[^\]]*\]==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None, "pyproject.toml no longer pins ray"
    assert ray.__version__ == pin.group(1) == CHECKED_RAY_VERSION, (
        f"ray {ray.__version__} is installed and {pin.group(1)} pinned in pyproject.toml, but "
        f"trainers/ray_private.py was checked against {CHECKED_RAY_VERSION}: re-read Ray's source for "
        "each private name its docstring lists, fix what moved, then set CHECKED_RAY_VERSION"
    )


def test_fit_builds_its_failure_policy_from_the_module_level_factory() -> None:
    """`install_failure_policy` replaces a module global: it works only while fit() looks it up there."""
    fit = DataParallelTrainer.fit
    assert fit.__globals__ is vars(data_parallel_trainer)
    assert any(
        instruction.opname == "LOAD_GLOBAL" and instruction.argval == "create_failure_policy"
        for instruction in dis.get_instructions(fit)
    ), "DataParallelTrainer.fit() no longer calls the module's create_failure_policy"
    assert list(inspect.signature(data_parallel_trainer.create_failure_policy).parameters) == [
        "failure_config"
    ]


def test_install_failure_policy_has_fit_build_the_apiary_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Put Ray's factory back after the test, whatever install_failure_policy sets.
    monkeypatch.setattr(
        data_parallel_trainer, "create_failure_policy", data_parallel_trainer.create_failure_policy
    )
    retried: list[TrainingFailedError] = []
    install_failure_policy(is_final=is_own_failure, on_retry=retried.append)
    policy = data_parallel_trainer.create_failure_policy(FailureConfig(max_failures=2))  # type: ignore[arg-type]
    assert isinstance(policy, ApiaryFailurePolicy)
    assert policy.failure_config.max_failures == 2
    assert policy.is_final is is_own_failure and policy.on_retry == retried.append


def test_a_final_failure_is_raised_at_once_and_each_retry_is_heard_of() -> None:
    retried: list[TrainingFailedError] = []
    policy = ApiaryFailurePolicy(
        FailureConfig(max_failures=1), is_final=is_own_failure, on_retry=retried.append
    )
    own = WorkerGroupError("snippet", {0: ValueError("label 2 is outside [0, 2)")})
    dead = WorkerGroupError("snippet", {1: WorkerHealthCheckFailedError("worker 1 died", ActorDiedError())})
    assert policy.make_decision(own) is FailureDecision.RAISE
    assert retried == []
    # The job's own failure spent none of the budget: Ray's default policy still retries once.
    assert policy.make_decision(dead) is FailureDecision.RETRY
    assert retried == [dead]
    assert policy.make_decision(dead) is FailureDecision.RAISE
    assert retried == [dead]


def test_ray_train_errors_and_wrapped_user_exceptions() -> None:
    """A dead worker reaches the policy as one of Ray Train's own errors; older releases wrapped a
    rank's own exception."""
    dead = WorkerHealthCheckFailedError("worker 1 died", ActorDiedError())
    assert is_ray_train_error(dead) and not is_ray_train_error(ValueError("x"))
    inner = KeyError("x")
    assert unwrap_user_exception(UserExceptionWithTraceback(inner, "Traceback ...")) is inner
    assert unwrap_user_exception(inner) is inner


def test_the_trainer_starts_no_helper_actor_that_a_run_of_its_own_ray_job_does_not_need() -> None:
    """No PlacementGroupCleaner (Ray removes a finished job's placement groups), and no
    DatasetManager for a built-in trainer, which passes no datasets; a custom trainer's dataset still
    gets its shards. Each is a Python process fewer on the way to step 1."""

    def callbacks(trainer_class: type[DataParallelTrainer], **kwargs: Any) -> set[type]:
        trainer = trainer_class(
            lambda config: None,
            backend_config=ProcessGroupConfig(),
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            **kwargs,
        )
        return {type(callback) for callback in trainer._create_default_callbacks()}

    # What Ray's own trainer starts, and so what there is to leave out.
    assert {PlacementGroupCleanerCallback, DatasetsCallback} <= callbacks(DataParallelTrainer)
    builtin = callbacks(ApiaryTrainer)
    assert PlacementGroupCleanerCallback not in builtin and DatasetsCallback not in builtin
    custom = callbacks(ApiaryTrainer, datasets={"train": lambda: None})
    assert PlacementGroupCleanerCallback not in custom and DatasetsCallback in custom


def test_the_backends_ray_names_have_the_shape_it_uses() -> None:
    assert inspect.signature(get_address_and_port).parameters == {}
    assert ray_private.get_address_and_port.__module__ == "ray.train._internal.utils"  # pickled by reference
    assert TrainingFramework.TORCH.value == "torch"
    # The worker group a Backend gets, and what trainers.backend calls on it.
    assert issubclass(WorkerGroup, BaseWorkerGroup)
    assert callable(WorkerGroup.__len__)
    # Called as execute[_async](fn, *args, **kwargs) and execute_single[_async](rank, fn, *args, **kwargs).
    for name, leading in [
        ("execute", 1),
        ("execute_async", 1),
        ("execute_single", 2),
        ("execute_single_async", 2),
    ]:
        kinds = [p.kind for p in inspect.signature(getattr(WorkerGroup, name)).parameters.values()][1:]
        assert kinds == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * leading + [
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ], name


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        (TORCH_SET_ENV_VARS, set()),
        (TORCH_SETUP_PROCESS_GROUP, {"backend", "world_rank", "world_size", "init_method", "timeout_s"}),
        (TORCH_SHUTDOWN, {"destroy_process_group"}),
    ],
)
def test_the_torch_config_helpers_take_the_arguments_the_backend_passes(
    name: str, arguments: set[str]
) -> None:
    from ray.train.torch import config  # imports torch: only here and on the workers

    parameters = inspect.signature(getattr(config, name)).parameters
    required = {key for key, value in parameters.items() if value.default is inspect.Parameter.empty}
    assert required <= arguments <= set(parameters), list(parameters)


def test_every_public_train_function_goes_through_the_replaceable_utilities() -> None:
    """`intercept_report` replaces the worker's train function utilities: it sees every report only
    while `ray.train.report` looks them up at each call, and passes Ray's arguments by keyword."""
    report = inspect.unwrap(ray.train.report)
    assert any(
        instruction.opname == "LOAD_GLOBAL" and instruction.argval == "get_train_fn_utils"
        for instruction in dis.get_instructions(report)
    ), "ray.train.report no longer calls get_train_fn_utils()"
    assert list(inspect.signature(TrainFnUtils.report).parameters)[1:4] == [
        "metrics",
        "checkpoint",
        "checkpoint_dir_name",
    ]


def test_intercept_report_hooks_report_and_leaves_the_rest_for_the_block() -> None:
    class Utilities:
        def __init__(self) -> None:
            self.reports: list[tuple[Any, ...]] = []

        def report(
            self,
            metrics: dict[str, Any],
            checkpoint: Any = None,
            checkpoint_dir_name: Any = None,
            **options: Any,
        ) -> None:
            self.reports.append((metrics, checkpoint, checkpoint_dir_name, options))

        def broadcast_from_rank_zero(self, data: Any) -> Any:
            return ("broadcast", data)

    original = Utilities()
    seen: list[dict[str, Any]] = []

    def hook(
        forward: Any,
        metrics: dict[str, Any],
        checkpoint: Any,
        checkpoint_dir_name: Any,
        options: dict[str, Any],
    ) -> None:
        seen.append(metrics)
        forward(metrics, checkpoint=checkpoint, checkpoint_dir_name="named", **options)

    set_train_fn_utils(original)
    try:
        with intercept_report(hook):
            get_train_fn_utils().report(
                metrics={"loss": 1.0}, checkpoint=None, checkpoint_dir_name=None, validation=False
            )
            assert get_train_fn_utils().broadcast_from_rank_zero(3) == ("broadcast", 3)
        assert get_train_fn_utils() is original
    finally:
        set_train_fn_utils(None)
    assert seen == [{"loss": 1.0}]
    assert original.reports == [({"loss": 1.0}, None, "named", {"validation": False})]


def test_a_workers_async_uploads_run_on_the_pool_ray_shuts_down_after_the_train_function() -> None:
    """`wait_for_checkpoint_uploads` waits for the pool that ASYNC uploads run on, as Ray does once the
    train function has returned."""
    fields = {field.name: field for field in dataclasses.fields(TrainContext)}
    assert "checkpoint_upload_threadpool" in fields
    assert "checkpoint_upload_threadpool.submit" in inspect.getsource(TrainContext.report)
    assert "checkpoint_upload_threadpool.shutdown()" in inspect.getsource(RayTrainWorker.run_train_fn)
