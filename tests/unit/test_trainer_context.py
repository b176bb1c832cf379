"""The training context's pieces in one process (no Ray): metrics, the step boundary's rules, saving and
restoring the loop's state with its data position, and batches a rollback skipped.

Only the registration of a complete checkpoint with Ray Train (`Checkpointer._report`, a Ray Train
barrier) is left out; tests/ray/test_own_loop.py runs the whole context under Ray Train."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch
from torch import nn

from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.checkpoint import Checkpointer, checkpoint_dir_name, checkpoint_problem, load_checkpoint
from trainers.context import TrainContext, metric_values
from trainers.data import DatasetInfo
from trainers.telemetry import Telemetry


@pytest.fixture(autouse=True)
def no_ray_train_report(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    reported: list[int] = []
    monkeypatch.setattr(Checkpointer, "_report", lambda self, path, *, step: reported.append(step))
    return reported


def open_context(storage: Path, *, telemetry_url: str | None = None, **fields: Any) -> TrainContext:
    spec = make_spec(
        trainer="tests.support.own_loop:train",
        name="own-loop",
        dataset=storage,  # never read: these tests feed batches themselves
        config={},
        num_workers=1,
        **{"max_steps": 10, "checkpoint": {"every_steps": 3, "async": False}, **fields},
    )
    request = make_request(spec, storage=storage, run_name="run")
    telemetry = Telemetry(url=telemetry_url, attempt=1, rank=0)
    device = torch.device("cpu")
    checkpointer = Checkpointer(
        request,
        row_shape={},
        rank=0,
        telemetry=telemetry,
        device=device,
        storage=(str(storage / "run"), pafs.LocalFileSystem()),
    )
    context = TrainContext(
        request=request,
        dataset=DatasetInfo(uri=storage.as_uri(), files=[], columns=[], num_rows=0),
        rank=0,
        world_size=1,
        device=device,
        telemetry=telemetry,
        checkpointer=checkpointer,
    )
    context._begin()
    return context


class Batches:
    """A stand-in for this rank's data stream: (epoch, batch) with batch {"x": [index]}, 4 per epoch."""

    def __init__(self, *, epoch: int = 0, index: int = 0) -> None:
        self.position = (epoch, index)

    def __next__(self) -> tuple[int, dict[str, torch.Tensor]]:
        epoch, index = self.position
        if index == 4:  # the position after an epoch's last batch: the next epoch
            epoch, index = epoch + 1, 0
        self.position = (epoch, index + 1)
        return epoch, {"x": torch.tensor([[float(epoch * 4 + index)]])}

    def close(self) -> None:
        pass


def feed(context: TrainContext) -> None:
    """Open `context`'s batches on the stand-in stream, at its data position."""
    position = context._state.data_position(batch_size=1)
    context._stream = Batches(epoch=position.epoch, index=position.sample)  # type: ignore[assignment]


def build(context: TrainContext, extra: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    context.restore(model=model, optimizer=optimizer, extra=extra)
    return model, optimizer


def train(
    context: TrainContext, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
) -> None:
    """Steps from the context's step to max_steps, as an own loop takes them."""
    for step in range(context.step + 1, context.max_steps + 1):
        batch = context.next_batch()
        loss = model(batch["x"]).square().mean()  # dropout: the RNG state matters
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        extra["seen"].append(int(batch["x"].item()))
        context.report(step, loss=loss)
        if context.should_stop():
            return


def test_metrics_are_numbers() -> None:
    assert metric_values({"a": torch.tensor(2.5), "b": 3, "c": 0.5}) == {"a": 2.5, "b": 3.0, "c": 0.5}
    with pytest.raises(TypeError, match="metric 'v' is a tensor of 2 elements"):
        metric_values({"v": torch.ones(2)})
    with pytest.raises(TypeError, match="metric 'flag' is a bool"):
        metric_values({"flag": True})


def test_report_needs_the_state_and_increasing_steps(tmp_path: Path) -> None:
    context = open_context(tmp_path)
    with pytest.raises(RuntimeError, match=r"call ctx.restore\(model=..., optimizer=...\) before"):
        context.report(1, loss=1.0)
    build(context, {})
    context.report(1, loss=1.0)
    with pytest.raises(ValueError, match="steps are integers that increase, the last was 1"):
        context.report(1, loss=1.0)
    assert context.telemetry.pending_points == 1


def test_a_checkpoint_is_reported_only_once_the_metrics_up_to_it_were_delivered(
    tmp_path: Path, telemetry_server: TelemetryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker killed after a checkpoint is resumed from it: the steps up to it are never taken again,
    # so their points, still in this rank's buffer, would be lost.
    delivered_at_report: dict[int, list[int]] = {}

    def report(self: Checkpointer, path: str | None, *, step: int) -> None:
        delivered_at_report[step] = sorted(
            point["step"] for batch in telemetry_server.batches for point in batch["points"]
        )

    monkeypatch.setattr(Checkpointer, "_report", report)
    context = open_context(tmp_path, telemetry_url=telemetry_server.url)  # its thread never started
    extra: dict[str, Any] = {"seen": []}
    feed(context)
    train(context, *build(context, extra), extra)
    assert delivered_at_report[3] == [1, 2, 3]
    assert delivered_at_report[9] == list(range(1, 10))


def test_a_resumed_loop_takes_exactly_the_steps_of_an_undisturbed_one(
    tmp_path: Path, no_ray_train_report: list[int]
) -> None:
    whole = open_context(tmp_path / "whole")
    whole_extra: dict[str, Any] = {"seen": []}
    feed(whole)
    train(whole, *build(whole, whole_extra), whole_extra)
    whole._finish()
    assert no_ray_train_report == [3, 6, 9, 10]

    # Stopped at step 4 (asked to): a complete checkpoint of step 4, the loop returns.
    first = open_context(tmp_path / "parts")
    first_extra: dict[str, Any] = {"seen": []}
    feed(first)
    model, optimizer = build(first, first_extra)
    original_end_step = first.checkpointer.end_step
    first.checkpointer.end_step = lambda parts, state, *, metrics, stop_requested: original_end_step(  # type: ignore[method-assign]
        parts, state, metrics=metrics, stop_requested=state.step == 4
    )
    train(first, model, optimizer, first_extra)
    first._finish()
    assert first.should_stop() and first.step == 4
    run_path = str(tmp_path / "parts" / "run" / checkpoint_dir_name(4))
    assert checkpoint_problem(run_path, pafs.LocalFileSystem()) is None

    second = open_context(tmp_path / "parts")
    assert second.resumed_from == 4 and second.step == 4
    second_extra: dict[str, Any] = {"seen": []}
    feed(second)
    model, optimizer = build(second, second_extra)
    assert second_extra == {"seen": [0, 1, 2, 3]}  # the loop's own state, restored in place
    train(second, model, optimizer, second_extra)
    second._finish()

    assert second_extra == whole_extra == {"seen": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}
    final = load_checkpoint(tmp_path / "parts" / "run" / checkpoint_dir_name(10))
    reference = load_checkpoint(tmp_path / "whole" / "run" / checkpoint_dir_name(10))
    assert all(torch.equal(final["model"][name], value) for name, value in reference["model"].items())
    assert final["samples_consumed"] == reference["samples_consumed"] == 10 * 16
    assert final["lr_schedule"] == {}  # the loop has none


def test_the_last_reported_step_is_saved_when_the_loop_returns_early(
    tmp_path: Path, no_ray_train_report: list[int]
) -> None:
    context = open_context(tmp_path)
    feed(context)
    extra: dict[str, Any] = {"seen": []}
    build(context, extra)
    for step in (1, 2, 3, 4):
        context.next_batch()
        context.report(step, loss=0.0)
    context._finish()  # the loop returned at step 4, before max_steps: its state is saved
    assert no_ray_train_report == [3, 4]
    assert load_checkpoint(tmp_path / "run" / checkpoint_dir_name(4))["recipe_state"] == {"seen": []}


def test_a_rollback_goes_back_and_skips_the_last_batch(tmp_path: Path) -> None:
    context = open_context(tmp_path, checkpoint={"every_steps": 2, "async": False})
    feed(context)
    extra: dict[str, Any] = {"seen": []}
    build(context, extra)
    taken = []
    for step in (1, 2, 3):
        taken.append(int(context.next_batch()["x"].item()))
        extra["seen"].append(taken[-1])
        context.report(step, loss=0.0)
    assert context.step == 3

    context.roll_back()  # the batch of step 3 (index 2) is left out; back to the checkpoint of step 2
    assert (context.step, context.skipped_batches) == (2, [(0, 2)])
    feed(context)
    build(context, extra)
    assert extra == {"seen": [0, 1]}
    assert [int(context.next_batch()["x"].item()) for _ in range(3)] == [3, 4, 5]


def test_a_rollback_without_a_checkpoint_gives_the_initial_state_back(tmp_path: Path) -> None:
    context = open_context(tmp_path)
    feed(context)
    extra: dict[str, Any] = {"seen": []}
    build(context, extra)
    context.next_batch()
    extra["seen"].append(0)
    context.roll_back()
    assert (context.step, context.skipped_batches) == (0, [(0, 0)])
    build(context, extra)
    assert extra == {"seen": []}


def test_a_group_that_resumes_reports_the_checkpoint_it_resumed_from(tmp_path: Path) -> None:
    """An attempt that died after writing the run's last checkpoint, before its report reached the
    control plane: the next attempt resumes from it with no step left to take, and only its report of
    that checkpoint tells the control plane that the job's latest checkpoint is the final one."""
    whole = open_context(tmp_path)
    feed(whole)
    extra: dict[str, Any] = {"seen": []}
    train(whole, *build(whole, extra), extra)
    whole._finish()
    assert [record.step for record in whole.telemetry._checkpoints] == [3, 6, 9, 10]

    resumed = open_context(tmp_path)
    assert resumed.resumed_from == 10
    feed(resumed)
    train(resumed, *build(resumed, {"seen": []}), {"seen": []})  # no step left
    resumed._finish()
    final = (tmp_path / "run" / checkpoint_dir_name(10)).as_uri()
    assert [(record.step, record.uri) for record in resumed.telemetry._checkpoints] == [(10, final)]

    fresh = open_context(tmp_path / "fresh")
    build(fresh, {"seen": []})
    assert list(fresh.telemetry._checkpoints) == []  # nothing to resume from: nothing reported
