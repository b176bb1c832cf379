from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from service.spec import JobSpec, LaunchRequest, load_spec


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
    assert spec.gang_resources() == {"CPU": 2.0}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"unknown": 1}, "unknown"),
        ({"num_workers": 0}, "num_workers"),
        ({"queue": "urgent"}, "queue"),
        ({"trainer": "not a module"}, "trainer"),
        ({"strategy": "fsdp"}, "strategy"),
        ({"dataset": {"uri": "relative/path"}}, "dataset.uri"),
        ({"dataset": {"uri": "file:///x", "format": "csv"}}, "dataset.format"),
        ({"checkpoint": {"every_steps": 0}}, "checkpoint.every_steps"),
        ({"resources_per_worker": {"CPU": -1}}, "resources_per_worker"),
        ({"config": {"vocab_size": 1}}, "config"),
        ({"config": {"vocab_size": 64, "d_model": 30, "n_heads": 4}}, "config"),
        ({"name": "has space"}, "name"),
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
    assert spec.trainer_config() is None


def test_yaml_and_json_load_alike(tmp_path: Any) -> None:
    yaml_path = tmp_path / "job.yaml"
    yaml_path.write_text(
        "name: run-1\ntrainer: gpt\nnum_workers: 2\ndataset: {uri: 'file:///data/tokens'}\n"
        "max_steps: 10\nbatch_size: 4\nconfig: {vocab_size: 64}\n"
    )
    json_path = tmp_path / "job.json"
    json_path.write_text(JobSpec.model_validate(valid()).model_dump_json())
    assert load_spec(yaml_path) == load_spec(json_path)


def test_launch_request_round_trips_through_the_environment() -> None:
    request = LaunchRequest(
        job_id=3,
        attempt=1,
        spec=JobSpec.model_validate(valid()),
        storage_uri="/tmp/ckpt",
        run_name="job-3",
        report_url="http://127.0.0.1:8000/internal/jobs/3/reports",
    )
    assert LaunchRequest.from_env(request.to_env()) == request
