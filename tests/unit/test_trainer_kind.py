"""The kind of a trainer, read from its source (`service.contract.trainer_kind`): nothing is imported."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from service.contract.spec import JobSpec
from service.contract.trainer_kind import (
    Refusal,
    TrainerKind,
    TrainerNotDefined,
    kind_of,
    kind_of_trainer,
    kind_refusal,
)


def kind(source: str, name: str = "Train") -> TrainerKind | None:
    return kind_of(textwrap.dedent(source), name)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("class Train(Recipe):\n    pass", TrainerKind.RECIPE),
        ("@dataclass\nclass Train:\n    lr: float = 0.1", TrainerKind.RECIPE),
        ("def Train(ctx: TrainContext): ...", TrainerKind.LOOP),
        ("def Train(ctx: apiary.TrainContext) -> None: ...", TrainerKind.LOOP),
        ("def Train(ctx: 'trainers.context.TrainContext'): ...", TrainerKind.LOOP),
        ("def Train(ctx: TrainContext, /): ...", TrainerKind.LOOP),
        ("def Train(): ...", TrainerKind.RAY_FUNCTION),
        ("def Train(config): ...", TrainerKind.RAY_FUNCTION),
        ("def Train(config: dict): ...", TrainerKind.RAY_FUNCTION),
        ("def Train(*, ctx: TrainContext): ...", TrainerKind.RAY_FUNCTION),  # not the first positional
        ("def Train(ctx: NotAContext): ...", TrainerKind.RAY_FUNCTION),
        ("def Train(ctx: 'not python('): ...", TrainerKind.RAY_FUNCTION),
    ],
)
def test_a_top_level_definition_tells_the_kind(source: str, expected: TrainerKind) -> None:
    assert kind(source) is expected


@pytest.mark.parametrize(
    "source",
    [
        "Train = make_trainer()",
        "from elsewhere import Train",
        "import Train",
        "from elsewhere import thing as Train",
        "if FLAG:\n    class Train: ...",
        "try:\n    from fast import Train\nexcept ImportError:\n    def Train(): ...",
        "@decorate\ndef Train(ctx: TrainContext): ...",
        "async def Train(): ...",
        "def __getattr__(name): ...",
        "from elsewhere import *",
        "globals()['Train'] = object",
        "class Train: ...\nTrain = wrap(Train)",  # the last binding wins, and it is an assignment
    ],
)
def test_a_name_bound_any_other_way_is_left_to_the_driver(source: str) -> None:
    assert kind(source) is None


def test_the_last_definition_wins() -> None:
    assert kind("class Train: ...\ndef Train(): ...") is TrainerKind.RAY_FUNCTION
    assert kind("def Train(): ...\nclass Train: ...") is TrainerKind.RECIPE


def test_a_name_the_module_does_not_define_is_refused() -> None:
    source = """
        import os
        class Other: ...
        def train(ctx: TrainContext): ...
        def helper():
            Train = 1
    """
    with pytest.raises(TrainerNotDefined):
        kind(source)


def test_a_class_body_or_a_function_body_does_not_define_a_module_name() -> None:
    with pytest.raises(TrainerNotDefined):
        kind("class Other:\n    Train = 1\n    def Train(self): ...")


def test_source_that_is_not_python_raises() -> None:
    with pytest.raises(SyntaxError):
        kind("def Train(:")


def test_builtins_are_recipes() -> None:
    assert kind_of_trainer("mlp") is TrainerKind.RECIPE
    assert kind_of_trainer("gpt") is TrainerKind.RECIPE


def test_an_installed_module_is_read_not_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "kindpkg"
    package.mkdir()
    # Importing the package or the module would raise: the kind is read from the files.
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "mod.py").write_text(
        "raise RuntimeError('imported')\n"
        "class MyRecipe: ...\n"
        "def loop(ctx: TrainContext): ...\n"
        "def ray_train(config): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert kind_of_trainer("kindpkg.mod:MyRecipe") is TrainerKind.RECIPE
    assert kind_of_trainer("kindpkg.mod:loop") is TrainerKind.LOOP
    assert kind_of_trainer("kindpkg.mod:ray_train") is TrainerKind.RAY_FUNCTION
    with pytest.raises(TrainerNotDefined):
        kind_of_trainer("kindpkg.mod:missing")
    assert kind_of_trainer("kindpkg.absent:train") is None
    assert "kindpkg" not in sys.modules


def test_an_unreadable_module_is_left_to_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kindbroken.py").write_text("def train(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert kind_of_trainer("kindbroken:train") is None


def test_the_repository_custom_trainers() -> None:
    # tests.support.custom_trainer: functions of Apiary's launch request, the old custom-trainer form.
    assert kind_of_trainer("tests.support.custom_trainer:train") is TrainerKind.RAY_FUNCTION


def ray_function_spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "fn", "trainer": "lab.train:train_func", "num_workers": 2, **fields}
    )


def test_a_ray_function_with_the_defaults_is_accepted() -> None:
    spec = ray_function_spec(checkpoint={"keep_last": 2, "keep_best": {"metric": "loss", "mode": "min"}})
    assert kind_refusal(spec, TrainerKind.RAY_FUNCTION) is None
    assert kind_refusal(spec, None) is None  # the kind is not known: the driver decides


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"strategy": "fsdp"}, "strategy"),
        ({"precision": "bf16"}, "precision"),
        ({"on_anomaly": "stop"}, "on_anomaly"),
        ({"checkpoint": {"every_steps": 10}}, "checkpoint.every_steps"),
        ({"checkpoint": {"every_s": 60}}, "checkpoint.every_s"),
        ({"checkpoint": {"auto": True}}, "checkpoint.auto"),
        ({"checkpoint": {"async": False}}, "checkpoint.async"),
        ({"profile": {"start_step": 1}}, "profile"),
    ],
)
def test_what_a_ray_function_cannot_honor_is_refused_by_name(fields: dict[str, Any], field: str) -> None:
    refused = kind_refusal(ray_function_spec(**fields), TrainerKind.RAY_FUNCTION)
    assert refused is not None and refused.field == field


def test_checkpoint_async_given_at_its_default_is_refused_where_it_is_known() -> None:
    spec = ray_function_spec(checkpoint={"async": True})
    assert kind_refusal(spec, TrainerKind.RAY_FUNCTION) is None  # the driver cannot tell it was given
    refused = kind_refusal(spec, TrainerKind.RAY_FUNCTION, given={"checkpoint.async"})
    assert refused is not None and refused.field == "checkpoint.async"


def test_a_recipe_needs_its_data_steps_and_batch_size() -> None:
    refused = kind_refusal(ray_function_spec(), TrainerKind.RECIPE)
    assert refused == Refusal("dataset", "required for trainer lab.train:train_func (a recipe)")


def test_an_own_loop_honors_strategy_precision_and_checkpoints_not_anomalies_or_eval() -> None:
    honored = ray_function_spec(
        strategy="fsdp",
        precision="bf16",
        checkpoint={"every_steps": 10, "auto": True},
        profile={"start_step": 2},
    )
    assert kind_refusal(honored, TrainerKind.LOOP) is None
    refused = kind_refusal(ray_function_spec(on_anomaly="warn"), TrainerKind.LOOP)
    assert refused is not None and refused.field == "on_anomaly"
    spec = ray_function_spec(
        dataset={"uri": "file:///data/train"}, eval={"dataset": {"uri": "file:///data/eval"}}
    )
    refused = kind_refusal(spec, TrainerKind.LOOP)
    assert refused is not None and refused.field == "eval"


def test_an_own_loop_reports_its_own_eval() -> None:
    spec = ray_function_spec(eval={"dataset": {"uri": "file:///held-out"}})
    refused = kind_refusal(spec, TrainerKind.LOOP)
    assert refused is not None and refused.field == "eval" and "ctx.report" in refused.message
    assert kind_refusal(ray_function_spec(), TrainerKind.LOOP) is None
