"""Bad numerics on a real local Ray cluster: a NaN that a data row puts in rank 1's loss at step 7.

The dataset is not shuffled, so rank r trains on rows [r * 192, (r + 1) * 192) in order, 16 a batch:
the NaN row (291) is in rank 1's batch 6 of epoch 0, which step 7 takes. A rollback skips batch 6 on
every rank, so the run must end exactly as a run on the same rows without both ranks' batch 6 (rows
96-111 and 288-303), which contains no NaN at all: that run is the reference, trained independently
of the anomaly machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from api.demo import classification_table, write_shards
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.checkpoint import build_model_from_checkpoint, checkpoint_dir_name, load_checkpoint
from trainers.launch import RunResult, TrainingFailed, run

pytestmark = [pytest.mark.timeout(600)]

ROWS, BATCH, NAN_ROW, NAN_STEP, MAX_STEPS = 384, 16, 291, 7, 10
SKIPPED_ROWS = [*range(96, 112), *range(288, 304)]  # batch 6 of rank 0 and of rank 1


def write_rows(folder: Path, *, nan_row: int | None = None, drop: Sequence[int] = ()) -> Path:
    table = classification_table(num_rows=ROWS, num_features=8, num_classes=3)
    features = np.stack(table.column("features").to_numpy(zero_copy_only=False)).astype(np.float32)
    if nan_row is not None:
        features[nan_row, 0] = np.nan
    table = table.set_column(1, "features", pa.array(list(features), pa.list_(pa.float32())))
    keep = np.setdiff1d(np.arange(ROWS), np.asarray(drop, dtype=np.int64))
    write_shards(table.take(pa.array(keep)), folder.as_uri(), num_shards=3)
    return folder


def train(
    data: Path, storage: Path, name: str, *, telemetry_url: str | None = None, **fields: Any
) -> RunResult:
    spec = make_spec(
        trainer="mlp",
        dataset={"uri": data.as_uri(), "shuffle": False},
        config={"num_classes": 3, "lr": 1e-2},
        max_steps=MAX_STEPS,
        batch_size=BATCH,
        **fields,
    )
    return run(make_request(spec, storage=storage, run_name=name, telemetry_url=telemetry_url))


def weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    return build_model_from_checkpoint(checkpoint).state_dict()


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_a_nan_rolls_back_skipping_its_batch_or_stops_the_job(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    bad = write_rows(tmp_path / "bad", nan_row=NAN_ROW)
    storage = tmp_path / "storage"
    reference = train(
        write_rows(tmp_path / "clean", drop=SKIPPED_ROWS), storage, "reference", checkpoint={"every_steps": 9}
    )
    assert reference.step == MAX_STEPS
    want = weights(reference.checkpoint_path or "")
    assert all(torch.isfinite(tensor).all() for tensor in want.values())

    # Rollback to the checkpoint at step 4, then on past the skipped batch.
    rolled = train(
        bad, storage, "rollback", telemetry_url=telemetry_server.url, checkpoint={"every_steps": 4}
    )
    assert rolled.step == MAX_STEPS
    assert_same_weights(weights(rolled.checkpoint_path or ""), want)
    final = load_checkpoint(storage / "rollback" / checkpoint_dir_name(MAX_STEPS))
    assert final["skipped_batches"] == [[0, 6]]
    assert final["batches_in_epoch"] == MAX_STEPS + 1  # the skipped batch was read, not trained on
    events = numerics_events(telemetry_server)
    assert [(e["kind"], e["rank"], e["step"]) for e in events] == [("anomaly", 1, 7), ("rollback", 0, 7)]
    anomaly, rollback = events
    assert anomaly["message"] == "loss is NaN at step 7 on rank 1 (on_anomaly: rollback)"
    assert anomaly["data"] == {"anomaly": "nan", "metric": "loss", "value": "NaN"}
    assert rollback["data"] == {
        "restored_step": 4,
        "skipped_epoch": 0,
        "skipped_batch": 6,
        "rollbacks": 1,
    }
    # Every step's metrics once per rank, none of the NaN step's; steps 5 and 6 were replayed.
    steps = sorted(p["step"] for p in telemetry_server.points() if p["rank"] == 1)
    assert steps == [1, 2, 3, 4, 5, 5, 6, 6, 7, 8, 9, 10]

    # Without a checkpoint yet, the rollback restarts from the seed's initial weights.
    fresh = train(bad, storage, "rollback-from-start")
    assert_same_weights(weights(fresh.checkpoint_path or ""), want)

    # on_anomaly: warn drops the NaN step's update but counts the step: 9 updates on the other batches.
    warned = train(bad, storage, "warn", telemetry_url=telemetry_server.url, on_anomaly="warn")
    assert warned.step == MAX_STEPS
    assert_same_weights(
        weights(warned.checkpoint_path or ""), weights(storage / "reference" / checkpoint_dir_name(9))
    )
    assert [e["message"] for e in numerics_events(telemetry_server)[2:]] == [
        "loss is NaN at step 7 on rank 1 (on_anomaly: warn)"
    ]

    # on_anomaly: stop fails the job with the step, the rank and the value.
    with pytest.raises(TrainingFailed) as failed:
        train(bad, storage, "stop", on_anomaly="stop")
    assert str(failed.value) == "loss is NaN at step 7 on rank 1; stopped (on_anomaly: stop)"


def numerics_events(server: TelemetryServer) -> list[dict[str, Any]]:
    """The anomaly and rollback events (each worker group also posts that it started)."""
    return [event for event in server.events() if event["kind"] in ("anomaly", "rollback")]
