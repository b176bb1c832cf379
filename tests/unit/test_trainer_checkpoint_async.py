"""Complete checkpoints (completion marker, refusal of half-written folders) and the background writer."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.fs as pafs
import pytest
import torch

from service.contract.spec import JobSpec
from tests.support.jobs import make_spec
from trainers.checkpoint import (
    MARKER_FILE,
    STATE_FILE,
    CheckpointWriter,
    TrainParts,
    TrainState,
    WriteOutcome,
    capture_rng_state,
    checkpoint_dir_name,
    checkpoint_problem,
    finish_checkpoint,
    latest_complete_checkpoint,
    load_checkpoint,
    save_checkpoint,
    take_snapshot,
)
from trainers.recipe import recipe_for

MLP = {"num_classes": 3, "hidden_sizes": [32]}
ROW_SHAPE = {"input_size": 6}
LOCAL = pafs.LocalFileSystem()


def build_parts(spec: JobSpec) -> TrainParts:
    trainer = recipe_for(spec)
    model = trainer.build_model(ROW_SHAPE)
    optimizer, lr_schedule = trainer.build_optimizer(model, max_steps=spec.max_steps)
    return TrainParts(model=model, optimizer=optimizer, lr_schedule=lr_schedule)


def train_one_step(parts: TrainParts) -> None:
    loss = parts.model(torch.randn(4, 6)).sum()
    parts.optimizer.zero_grad()
    loss.backward()
    parts.optimizer.step()
    parts.lr_schedule.step()


def snapshot_at(parts: TrainParts, step: int, spec: JobSpec) -> Any:
    return take_snapshot(
        parts, TrainState(step=step), spec=spec, row_shape=ROW_SHAPE, rng=[capture_rng_state()], rank=0
    )


def write_complete(writer: CheckpointWriter, parts: TrainParts, step: int, spec: JobSpec) -> str:
    writer.submit(snapshot_at(parts, step, spec))
    outcome = writer.wait()
    path = writer.checkpoint_path(step)
    assert finish_checkpoint(path, writer.filesystem, outcomes=[outcome])
    return path


@pytest.fixture
def spec() -> JobSpec:
    return make_spec(trainer="mlp", dataset="file:///unused", config=MLP, max_steps=100)


class RecordingHandler(pafs.FSSpecHandler):
    """A local filesystem seen through pyarrow's Python filesystem (as S3 is: no rename, uploads), that
    records the files it opens for writing, in order, and can hold writes until released."""

    def __init__(self) -> None:
        super().__init__(fsspec.filesystem("file"))
        self.opened: list[str] = []
        self.release = threading.Event()
        self.release.set()
        self.fail = False

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        self.release.wait(timeout=30)
        if self.fail:
            raise OSError(f"storage refused {path}")
        self.opened.append(path)
        return super().open_output_stream(path, metadata)


def test_the_marker_lists_every_file_with_its_checksum_and_is_written_last(
    tmp_path: Path, spec: JobSpec
) -> None:
    handler = RecordingHandler()
    storage = pafs.PyFileSystem(handler)
    writer = CheckpointWriter(run_path=str(tmp_path / "run"), filesystem=storage)
    parts = build_parts(spec)
    path = write_complete(writer, parts, 10, spec)

    assert handler.opened[-1] == f"{path}/{MARKER_FILE}"
    assert handler.opened[:-1] == [f"{path}/{STATE_FILE}"]
    marker = json.loads(Path(path, MARKER_FILE).read_text())
    assert marker["step"] == 10 and marker["format_version"] == 4
    data = Path(path, STATE_FILE).read_bytes()
    assert marker["files"] == {
        STATE_FILE: {"size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    }
    assert checkpoint_problem(path, storage) is None
    assert load_checkpoint(path)["step"] == 10


def test_every_ranks_files_go_into_the_marker(tmp_path: Path) -> None:
    folder = tmp_path / "run" / checkpoint_dir_name(5)
    (folder / "sharded").mkdir(parents=True)
    files = {STATE_FILE: b"state", "sharded/__0_0.distcp": b"rank 0", "sharded/__1_0.distcp": b"rank 1"}
    for name, data in files.items():
        (folder / name).write_bytes(data)

    def digest(name: str) -> dict[str, Any]:
        return {"size_bytes": len(files[name]), "sha256": hashlib.sha256(files[name]).hexdigest()}

    outcomes = [
        WriteOutcome(step=5, files={name: digest(name) for name in (STATE_FILE, "sharded/__0_0.distcp")}),
        WriteOutcome(step=5, files={"sharded/__1_0.distcp": digest("sharded/__1_0.distcp")}),
    ]
    assert finish_checkpoint(str(folder), LOCAL, outcomes=outcomes)
    assert set(json.loads((folder / MARKER_FILE).read_text())["files"]) == set(files)
    assert checkpoint_problem(str(folder), LOCAL) is None
    (folder / "sharded/__1_0.distcp").unlink()  # one rank's file lost: not complete any more
    assert checkpoint_problem(str(folder), LOCAL) == "sharded/__1_0.distcp is missing"


def test_half_written_folders_are_refused_and_removed_and_the_newest_complete_one_is_chosen(
    tmp_path: Path, spec: JobSpec, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    writer = CheckpointWriter(run_path=str(run), filesystem=LOCAL)
    parts = build_parts(spec)
    paths = {}
    for step in (10, 20, 30, 40, 50):
        train_one_step(parts)
        paths[step] = write_complete(writer, parts, step, spec)
    assert latest_complete_checkpoint(str(run), LOCAL) == paths[50]

    Path(paths[50], MARKER_FILE).unlink()  # never completed
    state = Path(paths[40], STATE_FILE)
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    state.write_bytes(bytes(data))
    Path(paths[30], STATE_FILE).unlink()  # a file missing
    assert checkpoint_problem(paths[50], LOCAL) is not None
    assert checkpoint_problem(paths[40], LOCAL) == f"{STATE_FILE} fails its sha256 check"
    assert checkpoint_problem(paths[30], LOCAL) == f"{STATE_FILE} is missing"

    # Without removing (what any reader may ask), nothing changes on disk.
    assert latest_complete_checkpoint(str(run), LOCAL) == paths[20]
    assert all(Path(path).is_dir() for path in paths.values())
    # At resume, rank 0 removes the half-written folders newer than the one it resumes from.
    with caplog.at_level("WARNING", logger="trainers.checkpoint"):
        assert latest_complete_checkpoint(str(run), LOCAL, remove_incomplete=True) == paths[20]
    assert sorted(p.name for p in run.iterdir()) == [checkpoint_dir_name(10), checkpoint_dir_name(20)]
    assert sum("removing half-written checkpoint" in r.getMessage() for r in caplog.records) == 3


def test_a_folder_written_before_markers_is_not_resumed_from_but_kept(tmp_path: Path, spec: JobSpec) -> None:
    run = tmp_path / "run"
    writer = CheckpointWriter(run_path=str(run), filesystem=LOCAL)
    parts = build_parts(spec)
    complete = write_complete(writer, parts, 10, spec)
    legacy = run / checkpoint_dir_name(20)
    legacy.mkdir()
    save_checkpoint(legacy, parts, TrainState(step=20), spec=spec, row_shape=ROW_SHAPE, rng=[])
    contents = torch.load(legacy / STATE_FILE, weights_only=True)
    contents["format_version"] = 3
    torch.save(contents, legacy / STATE_FILE)

    assert latest_complete_checkpoint(str(run), LOCAL, remove_incomplete=True) == complete
    assert legacy.is_dir()
    assert load_checkpoint(legacy)["step"] == 20  # still readable when a user asks for it


def test_the_snapshot_is_not_changed_by_steps_taken_after_it(tmp_path: Path, spec: JobSpec) -> None:
    parts = build_parts(spec)
    train_one_step(parts)  # the optimizer has state (exp_avg, ...) to copy
    expected_model = {name: value.clone() for name, value in parts.model.state_dict().items()}
    expected_exp_avg = parts.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    handler = RecordingHandler()
    handler.release.clear()  # the write waits until training moved on
    writer = CheckpointWriter(run_path=str(tmp_path / "run"), filesystem=pafs.PyFileSystem(handler))

    writer.guard(parts.optimizer)
    snapshot = snapshot_at(parts, 1, spec)
    # Parameters and optimizer state are copied in the writer's thread, and the next optimizer step
    # waits for that copy (buffers, RNG, LR schedule are copied at once).
    assert isinstance(snapshot.contents, dict) and not snapshot.copied.is_set()
    writer.submit(snapshot)
    train_one_step(parts)
    assert snapshot.copied.is_set()
    for _ in range(2):
        train_one_step(parts)
    with torch.no_grad():
        for parameter in parts.model.parameters():
            parameter.add_(1.0)
    assert writer.busy  # still held by the storage: what it writes is the copy
    handler.release.set()
    outcome = writer.wait()
    assert outcome.error is None

    contents = load_checkpoint(writer.checkpoint_path(1))
    assert contents["step"] == 1 and contents["lr_schedule"]["last_epoch"] == 1
    assert all(torch.equal(contents["model"][name], value) for name, value in expected_model.items())
    assert torch.equal(contents["optimizer"]["state"][0]["exp_avg"], expected_exp_avg)
    assert not torch.equal(parts.optimizer.state_dict()["state"][0]["exp_avg"], expected_exp_avg)


def test_at_most_one_write_is_in_flight(tmp_path: Path, spec: JobSpec) -> None:
    handler = RecordingHandler()
    handler.release.clear()
    writer = CheckpointWriter(run_path=str(tmp_path / "run"), filesystem=pafs.PyFileSystem(handler))
    parts = build_parts(spec)
    writer.submit(snapshot_at(parts, 1, spec))
    assert writer.in_flight == 1 and writer.busy
    with pytest.raises(RuntimeError, match="step 1 is still in flight"):
        writer.submit(snapshot_at(parts, 2, spec))
    handler.release.set()
    assert writer.wait().step == 1
    assert writer.in_flight is None and not writer.busy
    writer.submit(snapshot_at(parts, 2, spec))  # once waited for, the next may go
    assert writer.wait().error is None


def test_a_failed_write_leaves_the_previous_checkpoint_the_latest(
    tmp_path: Path, spec: JobSpec, caplog: pytest.LogCaptureFixture
) -> None:
    handler = RecordingHandler()
    storage = pafs.PyFileSystem(handler)
    run = tmp_path / "run"
    writer = CheckpointWriter(run_path=str(run), filesystem=storage)
    parts = build_parts(spec)
    previous = write_complete(writer, parts, 10, spec)

    handler.fail = True
    writer.submit(snapshot_at(parts, 20, spec))
    outcome = writer.wait()  # the failure is an outcome, not an exception in the training thread
    assert outcome.error is not None and "storage refused" in outcome.error
    with caplog.at_level("WARNING", logger="trainers.checkpoint"):
        assert not finish_checkpoint(writer.checkpoint_path(20), storage, outcomes=[outcome])
    assert "the latest checkpoint stays the previous one" in caplog.text
    assert not Path(writer.checkpoint_path(20)).exists()
    assert latest_complete_checkpoint(str(run), storage) == previous

    handler.fail = False  # the next due step tries again
    assert write_complete(writer, parts, 30, spec) == latest_complete_checkpoint(str(run), storage)


def test_the_spec_takes_async_and_every_s() -> None:
    spec = make_spec(
        trainer="mlp", dataset="file:///unused", config=MLP, checkpoint={"every_s": 600, "async": False}
    )
    assert spec.checkpoint.async_ is False and spec.checkpoint.every_s == 600
    assert spec.model_dump(mode="json")["checkpoint"] == {
        "every_steps": None,
        "keep_last": 3,
        "keep_best": None,
        "every_s": 600.0,
        "async": False,
        "auto": False,
    }
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec  # as the trainers receive it
    assert make_spec(trainer="mlp", dataset="file:///unused", config=MLP).checkpoint.async_ is True
    with pytest.raises(ValueError, match="greater than 0"):
        make_spec(trainer="mlp", dataset="file:///unused", config=MLP, checkpoint={"every_s": 0})
