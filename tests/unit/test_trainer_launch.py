"""The job entrypoint (`trainers.launch`) without a cluster: failure reasons and worker-group settings."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import ray.train
from ray import cloudpickle

from service.contract.errors import DatasetError
from service.contract.protocol import LAUNCH_ENV_VAR, MAX_REASON_CHARS, WORKER_FAILED, error_line
from service.contract.trainer_kind import TrainerKind
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.launch import (
    TrainingFailed,
    build_scaling_config,
    failure_reason,
    is_own_failure,
    load_custom_trainer,
    main,
    post_restart,
    recipe_train_loop,
    run,
    train_function_for,
    trainer_kind,
)


def last_stderr_line(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err.rstrip("\n").splitlines()[-1]


def test_main_without_a_request_fails_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(LAUNCH_ENV_VAR, raising=False)
    assert main() == 1
    assert last_stderr_line(capsys) == error_line(
        f"{LAUNCH_ENV_VAR} is not set: this entrypoint is started by the Apiary service"
    )


def test_main_with_an_invalid_request_names_the_field(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(LAUNCH_ENV_VAR, '{"job_id": 1}')
    assert main() == 1
    line = last_stderr_line(capsys)
    assert line.startswith(error_line(f"{LAUNCH_ENV_VAR} is not a valid launch pointer:"))
    assert "attempt" in line


def test_failure_reasons_are_one_line() -> None:
    assert failure_reason(DatasetError("dataset file:///x has no column 'tokens'")) == (
        "dataset file:///x has no column 'tokens'"
    )
    assert failure_reason(TrainingFailed("out of memory")) == "out of memory"
    assert failure_reason(RuntimeError("boom\n  at line 3")) == "RuntimeError: boom at line 3"
    assert len(failure_reason(ValueError("x" * 5000))) == MAX_REASON_CHARS


def test_worker_group_errors_name_the_rank_or_the_user_mistake() -> None:
    value_error = ray.train.WorkerGroupError("snippet", {1: DatasetError("label 3 is outside [0, 2)")})
    assert failure_reason(value_error) == "label 3 is outside [0, 2)"
    crash: dict[int, Any] = {0: RuntimeError("NCCL timeout"), 1: RuntimeError("NCCL timeout")}
    assert failure_reason(ray.train.WorkerGroupError("snippet", crash)) == (
        "training failed on rank 0 (and others): RuntimeError: NCCL timeout"
    )


@pytest.mark.parametrize(
    ("num_workers", "expected"),
    [(2, 2), ({"min": 1, "max": 3}, (1, 3)), ({"min": 2, "max": 2}, 2)],
)
def test_scaling_config_is_fixed_or_elastic(num_workers: Any, expected: Any) -> None:
    spec = make_spec(
        trainer="gpt", dataset="file:///unused", config={"vocab_size": 8}, num_workers=num_workers
    )
    scaling = build_scaling_config(spec)
    assert scaling.num_workers == expected
    assert scaling.elasticity_enabled == isinstance(expected, tuple)
    assert (scaling.min_workers, scaling.max_workers) == (spec.min_workers, spec.max_workers)
    assert not scaling.use_gpu and scaling.resources_per_worker == {"CPU": 1.0}
    assert scaling.placement_strategy == "PACK"
    spread = build_scaling_config(spec.model_copy(update={"placement": "strict_spread"}))
    assert spread.placement_strategy == "STRICT_SPREAD"


def test_a_trainers_kind_is_told_on_the_driver_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver finds the module and reads the name's kind from its source (a typo fails before any
    worker starts), and imports nothing when the source tells: a function trainer's module, which
    imports torch, is imported on the workers."""
    package = tmp_path / "labtrainers"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loops.py").write_text(
        "raise SystemExit('imported on the driver')\n"
        "from math import sqrt as helper\n"
        "try:\n    import torch\nexcept ImportError:\n    torch = None\n"
        "def train(config):\n    inner = 1\n    return inner\n"
        "def own(ctx: TrainContext):\n    pass\n"
        "class Model(Recipe):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert trainer_kind("labtrainers.loops:train") is TrainerKind.RAY_FUNCTION
    assert trainer_kind("labtrainers.loops:own") is TrainerKind.LOOP
    assert trainer_kind("labtrainers.loops:Model") is TrainerKind.RECIPE
    assert trainer_kind("gpt") is trainer_kind("mlp") is TrainerKind.RECIPE
    function = train_function_for(TrainerKind.RAY_FUNCTION, "labtrainers.loops:train")
    assert isinstance(function, functools.partial) and function.args == ("labtrainers.loops:train",)
    assert train_function_for(TrainerKind.RECIPE, "gpt") is recipe_train_loop
    assert "labtrainers.loops" not in sys.modules
    with pytest.raises(ValueError, match=r"module 'labtrainers\.loops' has no 'inner'"):
        trainer_kind("labtrainers.loops:inner")  # a local of a function is not the module's
    with pytest.raises(ValueError, match=r"cannot find module 'labtrainers\.nope'"):
        trainer_kind("labtrainers.nope:train")
    with pytest.raises(ValueError, match=r"package\.module:Name"):
        trainer_kind("labtrainers.loops")
    # A name the source cannot tell (an import) is looked at after importing the module, here.
    with pytest.raises(SystemExit, match="imported on the driver"):
        trainer_kind("labtrainers.loops:helper")


def test_a_trainer_the_source_cannot_tell_is_imported_to_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "labdynamic.py").write_text(
        "from __future__ import annotations\n"
        "import functools\n"
        "from tests.support.jobs import make_spec as helper\n"
        "class TrainContext: ...\n"
        "def _own(ctx: TrainContext) -> None: ...\n"
        "def _plain(config): ...\n"
        "class _Recipe: ...\n"
        "own = functools.wraps(_own)(lambda ctx: None)\n"
        "own.__annotations__ = {'ctx': 'TrainContext'}\n"
        "plain, recipe, number = _plain, _Recipe, 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert trainer_kind("labdynamic:own") is TrainerKind.LOOP
    assert trainer_kind("labdynamic:plain") is TrainerKind.RAY_FUNCTION
    assert trainer_kind("labdynamic:recipe") is TrainerKind.RECIPE
    assert trainer_kind("labdynamic:helper") is TrainerKind.RAY_FUNCTION
    with pytest.raises(ValueError, match="neither a recipe class nor a function"):
        trainer_kind("labdynamic:number")


def test_load_custom_trainer() -> None:
    import os.path

    assert load_custom_trainer("os.path:join") is os.path.join
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg\.mod'"):
        load_custom_trainer("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="has no 'nope'"):
        load_custom_trainer("os.path:nope")
    with pytest.raises(ValueError, match=r"package\.module:Name"):
        load_custom_trainer("os.path")


def test_only_the_jobs_own_exceptions_are_final_for_ray_train() -> None:
    """A dead worker as Ray Train reports it is checked with the door (tests/unit/test_ray_private.py)."""
    from ray.exceptions import ActorDiedError

    from trainers.launch import _is_own_error

    assert _is_own_error(ValueError("label 2 is outside [0, num_classes=2)"))
    assert _is_own_error(KeyError("x"))
    # A dead worker, and the collective a dead peer broke on a surviving rank: Ray Train restarts them.
    assert not _is_own_error(ActorDiedError())
    assert not _is_own_error(
        RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]")
    )
    own = {0: ValueError("label 2"), 1: KeyError("x")}
    assert is_own_failure(ray.train.WorkerGroupError("snippet", own))
    assert not is_own_failure(ray.train.WorkerGroupError("snippet", {**own, 2: ActorDiedError()}))
    assert not is_own_failure(ray.train.ControllerError(RuntimeError("controller")))


def test_each_restart_is_posted_as_a_worker_failed_event(
    tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    """The failure policy's hooks, as the Train controller unpickles them."""
    spec = make_spec(trainer="gpt", dataset="file:///unused", config={"vocab_size": 8})
    request = make_request(spec, storage=tmp_path, run_name="r", telemetry_url=telemetry_server.url)
    hook = cloudpickle.loads(cloudpickle.dumps(functools.partial(post_restart, request=request, token=None)))
    failures: dict[int, Any] = {1: RuntimeError("NCCL\nerror"), 0: RuntimeError("Connection reset by peer")}
    hook(ray.train.WorkerGroupError("snippet", failures))
    hook(ray.train.ControllerError(RuntimeError("controller")))
    then = "Ray Train restarts it from the latest checkpoint"
    ranks = "rank 0: Connection reset by peer, rank 1: NCCL error"
    assert [(event["kind"], event["message"]) for event in telemetry_server.events()] == [
        (WORKER_FAILED, f"worker group failed ({ranks}); {then}"),
        (WORKER_FAILED, f"worker group failed (the controller); {then}"),
    ]


def test_a_recipe_config_error_fails_the_job_on_the_driver_naming_the_field(tmp_path: Path) -> None:
    """Before any worker starts (no Ray here at all), with one line: the job's reason."""
    spec = make_spec(
        trainer="tests.support.recipes:CountingLM",
        name="counting-lm",
        dataset=tmp_path / "unused",
        config={"vocab_size": 32, "lr": -1},
    )
    with pytest.raises(ValueError) as caught:
        run(make_request(spec, storage=tmp_path, run_name="r"))
    assert failure_reason(caught.value) == "config.lr: Input should be greater than 0"
    not_a_recipe = spec.model_copy(update={"trainer": "tests.support.recipes:NotARecipe"})
    with pytest.raises(
        ValueError, match=r"NotARecipe is not a recipe \(a subclass of trainers\.recipe\.Recipe\)"
    ):
        run(make_request(not_a_recipe, storage=tmp_path, run_name="r"))
