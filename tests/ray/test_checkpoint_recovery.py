"""Checkpoints written in the background resume exactly, and a half-written one is never resumed from.

Both tests compare the final parameters of an interrupted run with those of one uninterrupted run
(no checkpoint but the final one), with `torch.equal`: resuming must take exactly the same steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.datasets import write_classes
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.checkpoint import (
    MARKER_FILE,
    build_model_from_checkpoint,
    checkpoint_dir_name,
    checkpoint_problem,
    latest_complete_checkpoint,
)
from trainers.launch import run

pytestmark = [pytest.mark.timeout(400)]

MAX_STEPS = 16
MLP = {"num_classes": 3, "hidden_sizes": [32, 32], "lr": 1e-2}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_classes(tmp_path_factory.mktemp("data") / "cls", rows=512, num_features=8, num_classes=3)


def request(
    dataset: Path, storage: Path, *, max_steps: int, checkpoint: dict[str, Any], **fields: Any
) -> Any:
    spec = make_spec(trainer="mlp", dataset=dataset, config=MLP, max_steps=max_steps, checkpoint=checkpoint)
    return make_request(spec, storage=storage, run_name="run", **fields)


def final_parameters(result: Any) -> dict[str, torch.Tensor]:
    assert result.checkpoint_path is not None
    return build_model_from_checkpoint(result.checkpoint_path).state_dict()


@pytest.fixture(scope="module")
def uninterrupted(
    ray_cluster: str, dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    result = run(request(dataset, tmp_path_factory.mktemp("whole"), max_steps=MAX_STEPS, checkpoint={}))
    assert result.step == MAX_STEPS
    return final_parameters(result)


def assert_same_parameters(parameters: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert parameters.keys() == reference.keys()
    assert all(torch.equal(parameters[name], value) for name, value in reference.items())


def test_async_checkpoints_resume_exactly(
    uninterrupted: dict[str, Any], dataset: Path, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    # Every 3 steps and every 0.2 s, whichever comes first: writes overlap training, and the one
    # still in flight when the next is due is waited for.
    checkpoint = {"every_steps": 3, "every_s": 0.2, "async": True}
    first = run(
        request(dataset, tmp_path, max_steps=10, checkpoint=checkpoint, telemetry_url=telemetry_server.url)
    )
    assert first.step == 10
    run_dir = tmp_path / "run"
    saved = [record["step"] for record in telemetry_server.checkpoints()]
    assert {3, 6, 9, 10} <= set(saved) and saved == sorted(saved) and saved[-1] == 10
    for step in saved:  # every announced checkpoint is complete in storage
        assert checkpoint_problem(str(run_dir / checkpoint_dir_name(step)), _local()) is None

    second = run(
        request(
            dataset, tmp_path, max_steps=MAX_STEPS, checkpoint=checkpoint, telemetry_url=telemetry_server.url
        )
    )
    assert second.step == MAX_STEPS
    rank_0_steps = sorted(p["step"] for p in telemetry_server.points() if p["rank"] == 0)
    assert rank_0_steps == list(range(1, MAX_STEPS + 1))  # went on at step 11
    assert_same_parameters(final_parameters(second), uninterrupted)


def test_a_half_written_newest_checkpoint_is_skipped_and_removed(
    uninterrupted: dict[str, Any], dataset: Path, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    checkpoint = {"every_steps": 3}
    first = run(request(dataset, tmp_path, max_steps=10, checkpoint=checkpoint))
    assert first.step == 10
    run_dir = tmp_path / "run"
    newest = run_dir / checkpoint_dir_name(10)
    (newest / MARKER_FILE).unlink()  # as if the job died before its last rank's files were in
    assert latest_complete_checkpoint(str(run_dir), _local()) == str(run_dir / checkpoint_dir_name(9))

    second = run(
        request(
            dataset, tmp_path, max_steps=MAX_STEPS, checkpoint=checkpoint, telemetry_url=telemetry_server.url
        )
    )
    assert second.step == MAX_STEPS
    # The resumed run went on from step 9, not 10, and removed the half-written folder.
    rank_0_steps = sorted(p["step"] for p in telemetry_server.points() if p["rank"] == 0)
    assert rank_0_steps == list(range(10, MAX_STEPS + 1))
    assert not newest.exists()
    # The checkpoint it resumed from is reported first (the control plane may have missed it).
    assert [record["step"] for record in telemetry_server.checkpoints()] == [9, 12, 15, 16]
    assert_same_parameters(final_parameters(second), uninterrupted)


def _local() -> Any:
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()
