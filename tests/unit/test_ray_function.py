"""A Ray Train function's pieces that need no cluster (`trainers.ray_function`): how it is called, the
step of a report, the metrics a telemetry point carries. The run itself: tests/ray/test_ray_function.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ray.train import Checkpoint

from service.contract.protocol import MAX_VALUES_PER_POINT
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.ray_function import Reports, _numeric, _reported_step, call_with_config, step_of_checkpoint
from trainers.telemetry import Telemetry


def test_a_function_is_called_as_ray_calls_it() -> None:
    """With the config when it takes one argument, with nothing when it takes none (as Ray Train)."""
    config = {"lr": 0.1}
    assert call_with_config(lambda: "none", config) == "none"
    assert call_with_config(lambda config: config["lr"], config) == 0.1
    assert call_with_config(lambda config=None, *, debug=False: config, config) is None  # nothing required

    def two(config: dict[str, Any], other: int) -> None: ...

    with pytest.raises(ValueError, match=re.escape("no argument or one (config); two requires 2")):
        call_with_config(two, config)


def test_the_step_of_a_report_is_its_step_metric_when_it_has_one() -> None:
    assert _reported_step({"step": 12, "loss": 1.0}) == 12
    assert _reported_step({"step": 12.0}) == 12
    for metrics in ({"loss": 1.0}, {"step": 1.5}, {"step": True}, {"step": "3"}, {"step": -1}):
        assert _reported_step(metrics) is None  # then reports are counted


def test_a_point_carries_the_numbers_of_a_report() -> None:
    metrics = {
        "loss": 0.5,
        "epoch": 3,
        "acc": np.float32(0.25),
        "step": 7,  # the point's step, not a value
        "done": True,
        "name": "x",
        "hist": [1, 2],
        "x" * 200: 1.0,
    }
    assert _numeric(metrics) == {"loss": 0.5, "epoch": 3.0, "acc": 0.25}
    assert (
        len(_numeric({f"m{i}": float(i) for i in range(MAX_VALUES_PER_POINT + 10)})) == MAX_VALUES_PER_POINT
    )


def test_a_checkpoint_folder_names_its_step_unless_the_function_named_it() -> None:
    assert step_of_checkpoint("/storage/run/checkpoint_00000012") == 12
    assert step_of_checkpoint("s3://bucket/run/checkpoint_00000003") == 3
    assert step_of_checkpoint("/storage/run/epoch-3") is None


class Forwarded(Exception):
    """Raised by the stand-in for Ray Train's report, once it has seen what had been delivered."""


def test_a_report_with_a_checkpoint_goes_to_ray_train_after_its_points_were_delivered(
    tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    # Ray Train resumes a restarted group from a reported checkpoint: a rank killed after it must not
    # take the points up to it down with its buffer.
    spec = make_spec(trainer="tests.support.own_loop:train", name="fn", dataset="file:///unused", config={})
    telemetry = Telemetry(url=telemetry_server.url, attempt=1, rank=1)  # its thread never started
    reports = Reports(make_request(spec, storage=tmp_path, run_name="run"), telemetry=telemetry, rank=1)
    delivered: list[list[int]] = []

    def forward(metrics: dict[str, Any], **options: Any) -> None:
        delivered.append([point["step"] for batch in telemetry_server.batches for point in batch["points"]])
        raise Forwarded

    reports.step = 1  # as after a report without a checkpoint, whose point waits for the next post
    telemetry.record(1, {"loss": 1.0})
    with pytest.raises(Forwarded):
        reports.report(forward, {"loss": 0.5}, Checkpoint(str(tmp_path)), None, {})
    assert delivered == [[1, 2]]


def test_a_group_that_resumes_records_the_checkpoint_it_resumed_from(
    tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    # The attempt that wrote it may have died before its report left: the control plane would never
    # know the checkpoint the run goes on from.
    spec = make_spec(trainer="tests.support.own_loop:train", name="fn", dataset="file:///unused", config={})
    request = make_request(spec, storage=tmp_path, run_name="run")
    folder = tmp_path / "run" / "checkpoint_00000012"
    telemetry = Telemetry(url=telemetry_server.url, attempt=2, rank=0)
    assert (
        Reports(request, telemetry=telemetry, rank=0).resume_from(Checkpoint(str(folder)), world_size=2) == 12
    )
    assert telemetry.flush()
    [checkpoint] = [batch["checkpoint"] for batch in telemetry_server.batches if batch["checkpoint"]]
    assert (checkpoint["step"], checkpoint["uri"]) == (12, folder.as_uri())
