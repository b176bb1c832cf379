"""The Hugging Face ViT image classifier recipe (`examples/hf_image`) on a synthetic image parquet dataset
(`examples/hf_image/make_images.py`), on a real local Ray: it learns, and its accuracy reaches the
telemetry, as a step metric and as an eval metric."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.hf_image.make_images import write_images
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.launch import run

pytestmark = [pytest.mark.timeout(400)]


def test_the_vit_classifier_learns_the_synthetic_images(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    train = write_images(tmp_path / "images", rows=512, size=16, classes=4, shards=2)
    held_out = write_images(tmp_path / "held-out", rows=64, size=16, classes=4, shards=1, seed=1)
    spec = make_spec(
        trainer="examples.hf_image.hf_vit:ViTClassifier",
        name="hf-vit",
        dataset=train,
        config={"num_classes": 4, "patch_size": 4, "hidden_size": 32, "lr": 3e-3, "warmup_steps": 5},
        max_steps=40,
        batch_size=16,
        eval={"dataset": {"uri": held_out.as_uri()}, "every_steps": 20},
    )
    result = run(
        make_request(spec, storage=tmp_path / "storage", run_name="vit", telemetry_url=telemetry_server.url)
    )
    assert result.step == 40

    points = [p for p in telemetry_server.points() if p["rank"] == 0]
    assert all("accuracy" in p["values"] for p in points)
    evals = {p["step"]: p["values"] for p in points if "eval_loss" in p["values"]}
    assert sorted(evals) == [20, 40]
    loss = {p["step"]: p["values"]["loss"] for p in points}
    assert sum(loss[s] for s in range(31, 41)) < sum(loss[s] for s in range(1, 11))
    assert evals[40]["eval_accuracy"] > 0.4  # four classes: 0.25 by chance
