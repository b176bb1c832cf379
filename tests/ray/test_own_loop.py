"""An own loop on the training context (`examples/own_loop`, `trainers.context`) on a real local Ray:
preempted mid-run, it resumes exactly (its final parameters, optimizer and own state equal an
undisturbed run's, with `torch.equal`), its metrics reach the control plane and its checkpoints are
recorded."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from service.contract.protocol import GROUP_STARTED
from service.contract.trainer_kind import TrainerKind
from tests.support.datasets import write_classes
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer, trained
from tests.support.wait import wait_until
from trainers.checkpoint import checkpoint_dir_name, checkpoint_problem, load_checkpoint
from trainers.launch import run, trainer_kind

pytestmark = [pytest.mark.timeout(400)]

LOOP = "tests.support.own_loop:train"
MAX_STEPS = 32  # 2 epochs of 512 rows in steps of 2 x 16: room to stop after step 5 (0.15 s a step)
CONFIG = {"hidden": 32, "num_classes": 3, "lr": 1e-2, "dropout": 0.2, "warmup_steps": 4}
METRICS = {"loss", "grad_norm", "lr", "running_accuracy"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_classes(tmp_path_factory.mktemp("data") / "cls", rows=512, num_features=8, num_classes=3)


def request(dataset: Path, storage: Path, *, step_delay_s: float = 0.0, **fields: Any) -> Any:
    spec = make_spec(
        trainer=LOOP,
        name="own-loop",
        dataset=dataset,
        config={**CONFIG, "step_delay_s": step_delay_s},
        max_steps=MAX_STEPS,
        checkpoint={"every_steps": 5},
    )
    return make_request(spec, storage=storage, run_name="run", **fields)


def final_state(result: Any) -> dict[str, Any]:
    assert result.checkpoint_path is not None
    return load_checkpoint(result.checkpoint_path)


def test_the_example_is_an_own_loop() -> None:
    assert trainer_kind("examples.own_loop.train:train") is TrainerKind.LOOP
    assert trainer_kind(LOOP) is TrainerKind.LOOP


def test_a_preempted_own_loop_resumes_exactly(
    ray_cluster: str, dataset: Path, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    whole = run(request(dataset, tmp_path / "whole"))
    assert whole.step == MAX_STEPS
    reference = final_state(whole)

    # Preempted once rank 0 reported step 5: the control plane's reply says stop, the ranks agree at
    # their next report, and the loop returns with that step's checkpoint complete.
    storage = tmp_path / "preempted"

    def preempt() -> None:
        wait_until(
            lambda: any(p["step"] >= 5 for p in telemetry_server.points()), timeout_s=300, what="step 5"
        )
        telemetry_server.stop = True

    threading.Thread(target=preempt, daemon=True).start()
    first = run(request(dataset, storage, step_delay_s=0.15, telemetry_url=telemetry_server.url))
    stopped_at = first.step
    assert 5 <= stopped_at < MAX_STEPS
    assert checkpoint_problem(str(storage / "run" / checkpoint_dir_name(stopped_at)), _local()) is None
    saved = [record["step"] for record in telemetry_server.checkpoints()]
    assert saved[-1] == stopped_at and {5} <= set(saved)

    # Admitted again: the same run resumes from that checkpoint and ends as the undisturbed run did.
    telemetry_server.stop = False
    second = run(request(dataset, storage, telemetry_url=telemetry_server.url))
    assert second.step == MAX_STEPS
    final = final_state(second)
    assert final["model"].keys() == reference["model"].keys()
    assert all(torch.equal(final["model"][name], value) for name, value in reference["model"].items())
    assert _equal(final["optimizer"], reference["optimizer"])
    assert final["recipe_state"] == reference["recipe_state"]  # the loop's own state
    assert final["recipe_state"]["samples"] == MAX_STEPS * 16

    # Every step's metrics of both ranks reached the control plane, each step once.
    points = telemetry_server.points()
    for rank in (0, 1):
        assert sorted(p["step"] for p in points if p["rank"] == rank) == list(range(1, MAX_STEPS + 1))
    assert all(set(trained(p)) == METRICS for p in points)
    saved = [record["step"] for record in telemetry_server.checkpoints()]
    assert {*range(5, MAX_STEPS, 5), MAX_STEPS} <= set(saved) and saved[-1] == MAX_STEPS
    started = [event for event in telemetry_server.events() if event["kind"] == GROUP_STARTED]
    assert [event["step"] for event in started] == [0, stopped_at]


def _equal(left: Any, right: Any) -> bool:
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and torch.equal(left, right)
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(_equal(left[key], right[key]) for key in left)
    if isinstance(left, list | tuple):
        return len(left) == len(right) and all(_equal(a, b) for a, b in zip(left, right, strict=True))
    return bool(left == right)


def _local() -> Any:
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()
