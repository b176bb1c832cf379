from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from service.contract.spec import JobSpec, parse_spec_text


def valid(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "run-1",
        "trainer": "gpt",
        "num_workers": 2,
        "dataset": {"uri": "file:///data/tokens"},
        "max_steps": 10,
        "batch_size": 4,
        "config": {"vocab_size": 64},
    }
    spec.update(overrides)
    return spec


def error_fields(spec: dict[str, Any]) -> list[str]:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(spec)
    return [".".join(str(p) for p in error["loc"]) for error in info.value.errors()]


def test_defaults_are_filled_and_builtin_config_is_completed() -> None:
    spec = JobSpec.model_validate(valid())
    assert spec.queue == "research"
    assert spec.priority == 0
    assert spec.resources_per_worker == {"CPU": 1.0}
    assert spec.strategy == "ddp"
    assert spec.checkpoint.every_steps is None
    assert spec.config["d_model"] == 64  # GPTConfig defaults are stored, so the trainer runs exactly this
    assert spec.dataset.format == "parquet"
    assert spec.on_anomaly == "rollback"
    assert spec.anomaly.max_rollbacks == 3 and spec.anomaly.min_steps <= spec.anomaly.window
    # FSDP's units follow the device (trainers.parallel.fsdp_units); block units reshard after forward.
    assert spec.fsdp.units == "auto" and spec.fsdp.reshard_after_forward is True


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"unknown": 1}, "unknown"),
        ({"num_workers": 0}, "num_workers"),
        ({"num_workers": {"min": 0, "max": 2}}, "num_workers"),
        ({"num_workers": {"min": 3, "max": 2}}, "num_workers"),
        ({"num_workers": {"min": 1}}, "num_workers"),
        ({"num_workers": {"min": 1, "max": 2, "step": 1}}, "num_workers"),
        ({"num_workers": "two"}, "num_workers"),
        ({"queue": "urgent"}, "queue"),
        ({"trainer": "not a module"}, "trainer"),
        ({"strategy": "zero3"}, "strategy"),
        ({"precision": "fp8"}, "precision"),
        ({"fsdp": {"units": "layers"}}, "fsdp.units"),
        ({"fsdp": {"reshard_after_forward": "sometimes"}}, "fsdp.reshard_after_forward"),
        ({"dataset": {"uri": "file:///x", "shuffle_buffer_rows": 0}}, "dataset.shuffle_buffer_rows"),
        ({"dataset": {"uri": "relative/path"}}, "dataset.uri"),
        ({"dataset": {"uri": "file:///x", "format": "csv"}}, "dataset.format"),
        ({"checkpoint": {"every_steps": 0}}, "checkpoint.every_steps"),
        ({"resources_per_worker": {"CPU": -1}}, "resources_per_worker"),
        ({"config": {"vocab_size": 1}}, "config"),
        ({"config": {"vocab_size": 64, "d_model": 30, "n_heads": 4}}, "config"),
        ({"name": "has space"}, "name"),
        ({"on_anomaly": "ignore"}, "on_anomaly"),
        ({"anomaly": {"zscore": 0}}, "anomaly.zscore"),
        ({"anomaly": {"window": 1}}, "anomaly.window"),
        ({"anomaly": {"max_rollbacks": -1}}, "anomaly.max_rollbacks"),
        ({"anomaly": {"window": 10, "min_steps": 11}}, "anomaly"),
        ({"anomaly": {"threshold": 3}}, "anomaly.threshold"),
        ({"on_plateau": "stop"}, "on_plateau"),  # stop needs the rule
        ({"on_plateau": "halt", "plateau": {"window_steps": 5}}, "on_plateau"),
        ({"plateau": {}}, "plateau.window_steps"),
        ({"plateau": {"window_steps": 10}}, "plateau"),  # max_steps is 10: it could never fire
        ({"plateau": {"window_steps": 5, "min_rel_improvement": 1}}, "plateau.min_rel_improvement"),
        ({"plateau": {"window_steps": 5, "smoothing_steps": -1}}, "plateau.smoothing_steps"),
        ({"plateau": {"window_steps": 5, "metric": "bad name"}}, "plateau.metric"),
        ({"plateau": {"window_steps": 5, "patience": 3}}, "plateau.patience"),
        ({"profile": {"steps": 2}}, "profile.start_step"),
        ({"profile": {"start_step": 0}}, "profile.start_step"),
        ({"profile": {"start_step": 2, "steps": 0}}, "profile.steps"),
        ({"profile": {"start_step": 2, "steps": 51}}, "profile.steps"),
        ({"profile": {"start_step": 10, "steps": 2}}, "profile"),  # max_steps is 10: step 11 never runs
        ({"profile": {"start_step": 2, "every": 3}}, "profile.every"),
    ],
)
def test_bad_values_name_the_field(overrides: dict[str, Any], field: str) -> None:
    assert field in error_fields(valid(**overrides))


def test_missing_required_fields_are_named() -> None:
    spec = valid()
    del spec["dataset"], spec["max_steps"]
    assert set(error_fields(spec)) >= {"dataset", "max_steps"}


def test_trainer_config_errors_name_the_inner_field() -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(valid(trainer="mlp", config={"task": "classification"}))
    assert "num_classes" in str(info.value)


def test_custom_trainer_config_is_passed_through() -> None:
    spec = JobSpec.model_validate(valid(trainer="my_pkg.train:loop", config={"anything": [1, 2]}))
    assert spec.config == {"anything": [1, 2]}


def test_yaml_and_json_load_alike(tmp_path: Any) -> None:
    yaml_path = tmp_path / "job.yaml"
    yaml_path.write_text(
        "name: run-1\ntrainer: gpt\nnum_workers: 2\ndataset: {uri: 'file:///data/tokens'}\n"
        "max_steps: 10\nbatch_size: 4\nconfig: {vocab_size: 64}\n"
    )
    json_path = tmp_path / "job.json"
    json_path.write_text(JobSpec.model_validate(valid()).model_dump_json())
    assert JobSpec.model_validate(parse_spec_text(yaml_path.read_text())) == JobSpec.model_validate(
        parse_spec_text(json_path.read_text())
    )


def test_fixed_num_workers_is_a_gang_of_that_size() -> None:
    spec = JobSpec.model_validate(valid(num_workers=3, resources_per_worker={"CPU": 0.5, "GPU": 1}))
    assert (spec.num_workers, spec.min_workers, spec.max_workers, spec.is_elastic) == (3, 3, 3, False)
    assert spec.uses_gpu


def test_elastic_num_workers_admits_at_min_and_round_trips() -> None:
    spec = JobSpec.model_validate(valid(num_workers={"min": 1, "max": 4}))
    assert (spec.min_workers, spec.max_workers, spec.is_elastic) == (1, 4, True)
    # The trainer gets the spec as JSON (LaunchRequest): it must come back the same.
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
    assert spec.model_dump(mode="json")["num_workers"] == {"min": 1, "max": 4}


def test_elastic_with_min_equal_max_is_a_fixed_group() -> None:
    spec = JobSpec.model_validate(valid(num_workers={"min": 2, "max": 2}))
    assert (spec.min_workers, spec.max_workers, spec.is_elastic) == (2, 2, False)


def test_elastic_errors_say_what_is_wrong() -> None:
    with pytest.raises(ValidationError, match=r"max \(2\) must be >= min \(3\)"):
        JobSpec.model_validate(valid(num_workers={"min": 3, "max": 2}))
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        JobSpec.model_validate(valid(num_workers=0))


def test_a_function_trainer_may_leave_out_dataset_steps_and_batch_size() -> None:
    """A Ray Train function reads its own data and ends when it returns; a built-in (a recipe) cannot."""
    spec = JobSpec.model_validate({"name": "fn", "trainer": "lab.train:train_func", "num_workers": 2})
    assert spec.dataset is None and spec.max_steps is None and spec.batch_size is None
    with pytest.raises(ValueError, match=re.escape("max_steps: required for trainer lab.train:train_func")):
        _ = spec.required_max_steps
    for field in ("dataset", "max_steps", "batch_size"):
        builtin = valid()
        del builtin[field]
        assert error_fields(builtin) == [field]


def test_an_eval_section_is_a_dataset_and_a_cadence() -> None:
    spec = JobSpec.model_validate(valid(eval={"dataset": {"uri": "file:///data/held-out"}, "every_steps": 5}))
    assert spec.eval is not None and spec.eval.dataset.uri == "file:///data/held-out"
    assert spec.eval.every_steps == 5 and spec.eval.max_batches is None
    assert JobSpec.model_validate(valid()).eval is None
    assert error_fields(valid(eval={"every_steps": 5})) == ["eval.dataset"]
    assert error_fields(valid(eval={"dataset": {"uri": "/rel"}, "max_batches": 0})) == [
        "eval.dataset.uri",
        "eval.max_batches",
    ]


def test_keep_best_by_an_eval_metric_needs_an_eval_section() -> None:
    keep_best = {"keep_best": {"metric": "eval_loss", "mode": "min"}}
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(valid(checkpoint=keep_best))
    (error,) = info.value.errors()
    assert (
        error["loc"] == ("eval",)
        and "checkpoint.keep_best.metric 'eval_loss' is an eval metric" in error["msg"]
    )
    with_eval = JobSpec.model_validate(valid(checkpoint=keep_best, eval={"dataset": {"uri": "file:///d"}}))
    assert with_eval.checkpoint.keep_best is not None


def test_plateau_detection_is_off_unless_asked_and_by_an_eval_metric_needs_an_eval_section() -> None:
    spec = JobSpec.model_validate(valid())
    assert spec.plateau is None and spec.on_plateau == "warn"
    stop = JobSpec.model_validate(valid(plateau={"window_steps": 5}, on_plateau="stop"))
    assert stop.plateau is not None
    assert (stop.plateau.metric, stop.plateau.min_rel_improvement) == ("loss", 0.01)
    by_eval = {"plateau": {"metric": "eval_loss", "window_steps": 5}}
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(valid(**by_eval))
    (error,) = info.value.errors()
    assert error["loc"] == ("eval",) and "plateau.metric 'eval_loss' is an eval metric" in error["msg"]
    with_eval = JobSpec.model_validate(valid(**by_eval, eval={"dataset": {"uri": "file:///d"}}))
    assert with_eval.plateau is not None


def test_deferrable_takes_exactly_one_of_finish_by_and_within_h() -> None:
    spec = JobSpec.model_validate(valid(deferrable={"finish_by": "2027-01-01T10:00:00+02:00"}))
    assert spec.deferrable is not None and spec.deferrable.finish_by == "2027-01-01T08:00:00Z"
    assert spec.deferrable.deadline(0) == 1798790400.0
    # The stored form reads back alike.
    again = JobSpec.model_validate(valid(deferrable=spec.deferrable.model_dump(mode="json")))
    assert again.deferrable == spec.deferrable
    within = JobSpec.model_validate(valid(deferrable={"within_h": 12}))
    assert within.deferrable is not None and within.deferrable.deadline(1000.0) == 1000.0 + 12 * 3600
    for bad in ({}, {"finish_by": 1798790400, "within_h": 1}, {"finish_by": "friday"}, {"within_h": 0}):
        assert error_fields(valid(deferrable=bad))[0].startswith("deferrable")


def test_a_profile_window_is_off_unless_asked_and_must_fit_in_the_run() -> None:
    assert JobSpec.model_validate(valid()).profile is None
    spec = JobSpec.model_validate(valid(profile={"start_step": 6}))
    assert spec.profile is not None and (spec.profile.start_step, spec.profile.end_step) == (6, 10)
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(valid(profile={"start_step": 8, "steps": 5}))
    (error,) = info.value.errors()
    assert error["loc"] == ("profile",)
    assert "steps 8-12 end past max_steps (10): start_step must be <= 6 for 5 steps" in error["msg"]
    # An own loop may run without max_steps: its window is its own to reach.
    own = JobSpec.model_validate(valid(trainer="pkg.train:loop", max_steps=None, profile={"start_step": 99}))
    assert own.profile is not None
