"""Metrics in TensorBoard (and MLflow, tests below): the service's exporter writes rank 0's points, read
back with TensorBoard's own reader, on local storage and on S3 (moto on loopback)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from service.cluster import RayJobStatus
from service.contract.storage import resolve_uri
from service.tracking import CURSOR_FILE, TensorBoardSink
from tests.conftest import S3
from tests.integration.conftest import Service
from tests.support.jobs import classification_job


def start_job(service: Service, dataset: str, *, lr: float = 0.1) -> tuple[int, str]:
    spec = classification_job(
        dataset, name="tb-run", num_workers=2, config={"task": "classification", "num_classes": 3, "lr": lr}
    )
    return service.start(spec)


def post(service: Service, job_id: int, steps: range, *, eval_every: int = 5) -> None:
    now = time.time()
    points = [
        {
            "step": step,
            "rank": rank,
            "time": now + step,
            "values": {
                "loss": 2.0 / step + rank,  # rank 1's differ: only rank 0's are exported
                "samples_per_s": 100.0,
                **({"eval_loss": 3.0 / step} if step % eval_every == 0 else {}),
                # What the rank's process uses, on a point of each post that sampled it (trainers.system).
                **({"sys_cpu_percent": 50.0 + rank, "sys_rss_bytes": 2.0**30} if step % 5 == 0 else {}),
            },
        }
        for step in steps
        for rank in (0, 1)
    ]
    assert service.report(job_id, {"attempt": 1, "points": points}).status_code == 202


def read_back(logdir: str, local: Path, *, s3_endpoint_url: str | None) -> EventAccumulator:
    """TensorBoard's reader over the job's folder (copied from S3 first: the reader has no endpoint)."""
    path, filesystem = resolve_uri(logdir, s3_endpoint_url=s3_endpoint_url)
    local.mkdir(parents=True, exist_ok=True)
    for info in filesystem.get_file_info(pafs.FileSelector(path)):
        with filesystem.open_input_stream(info.path) as source:
            (local / info.base_name).write_bytes(source.read())
    accumulator = EventAccumulator(str(local), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_every_job_writes_tensorboard_scalars_and_hparams(
    start_service: Any,
    classification_dataset: str,
    tmp_path: Path,
    where: str,
    request: pytest.FixtureRequest,
) -> None:
    settings: dict[str, Any] = {}
    endpoint = None
    if where == "s3":
        s3: S3 = request.getfixturevalue("s3")
        settings = {"storage_uri": s3.checkpoints_uri, "s3_endpoint_url": s3.endpoint_url}
        endpoint = s3.endpoint_url
    service = start_service(**settings)
    exporter = service.runtime.exporter
    assert exporter is not None
    job_id, submission_id = start_job(service, classification_dataset)
    post(service, job_id, range(1, 11))
    assert exporter.export_once() == 10  # rank 0's ten steps
    post(service, job_id, range(11, 21))
    service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
    service.tick()
    assert exporter.export_once() == 10
    assert exporter.export_once() == 0  # nothing new: the job's export is finished

    logdir = TensorBoardSink(service.runtime.settings).logdir(job_id)
    events = read_back(logdir, tmp_path / "tb", s3_endpoint_url=endpoint)
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 21))
    assert [e.value for e in loss] == pytest.approx([2.0 / step for step in range(1, 21)])  # rank 0's
    assert [e.step for e in events.Scalars("eval/loss")] == [5, 10, 15, 20]
    assert "train/samples_per_s" in events.Tags()["scalars"]
    cpu = events.Scalars("system/cpu_percent")  # rank 0's process
    assert [(e.step, e.value) for e in cpu] == [(step, 50.0) for step in (5, 10, 15, 20)]
    assert "system/rss_bytes" in events.Tags()["scalars"]
    hparams = events.SummaryMetadata("_hparams_/session_start_info").plugin_data
    assert hparams.plugin_name == "hparams" and b"config.lr" in hparams.content

    # A new exporter (a restarted or new leader) goes on from the cursor beside the files: no repeats.
    path, filesystem = resolve_uri(logdir, s3_endpoint_url=endpoint)
    with filesystem.open_input_stream(f"{path}/{CURSOR_FILE}") as stream:
        assert b'"finished": true' in stream.read()
    restarted = type(exporter)(
        db=exporter.db,
        sinks=[TensorBoardSink(service.runtime.settings)],
        metrics=exporter.metrics,
        is_leader=lambda: True,
    )
    assert restarted.export_once() == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_tensorboard_can_be_turned_off(start_service: Any, classification_dataset: str) -> None:
    service = start_service(tensorboard=False)
    assert service.runtime.exporter is None


def test_apiary_tensorboard_prints_the_folders(
    service: Service, classification_dataset: str, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from api.cli import app

    job_id, _ = start_job(service, classification_dataset)
    env = {"APIARY_URL": str(service.http.base_url), "APIARY_CONFIG": str(tmp_path / "none.toml")}
    one = CliRunner().invoke(app, ["tensorboard", str(job_id), "--print"], env=env)
    assert one.exit_code == 0, one.output
    assert one.stdout.strip().endswith(f"job-{job_id}/tensorboard")
    root = CliRunner().invoke(app, ["tensorboard", "--print"], env=env)
    assert root.stdout.strip() == service.runtime.settings.resolved_storage_uri.removeprefix("file://")
    missing = service.http.get("/tensorboard", params={"job": [999]})
    assert missing.status_code == 404


# -- MLflow: a real `mlflow server` (SQLite backend), read back with MlflowClient -------------------


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_every_job_is_one_mlflow_run_through_restarts(
    start_service: Any, classification_dataset: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from service.tracking import MlflowSink
    from tests.support.mlflow_server import mlflow_server

    with mlflow_server(tmp_path / "mlflow") as tracking_uri:
        service = start_service(mlflow_tracking_uri=tracking_uri, tensorboard=False)
        exporter = service.runtime.exporter
        assert exporter is not None and [sink.name for sink in exporter.sinks] == ["mlflow"]
        job_id, submission_id = start_job(service, classification_dataset, lr=0.03)
        post(service, job_id, range(1, 11))
        assert exporter.export_once() == 10

        client = MlflowClient(tracking_uri=tracking_uri)
        experiment = client.get_experiment_by_name("tb-run")  # the job's name
        assert experiment is not None
        (run,) = client.search_runs([experiment.experiment_id])
        assert run.data.tags["apiary.job_id"] == str(job_id)
        assert run.data.params["config.lr"] == "0.03" and run.data.params["max_steps"] == "20.0"
        assert run.info.status == "RUNNING"

        # A restarted service (a new exporter, a new sink) finds the run again and goes on from its
        # cursor: one run, no point twice.
        exporter.sinks = [MlflowSink(tracking_uri)]
        exporter._progress.clear()
        post(service, job_id, range(11, 21))
        service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
        service.tick()
        assert exporter.export_once() == 10
        exporter.export_once()  # nothing new: the run is ended with the job's state

        (run,) = client.search_runs([experiment.experiment_id])
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert [m.step for m in history] == list(range(1, 21))
        assert [m.value for m in history] == pytest.approx([2.0 / step for step in range(1, 21)])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")] == [5, 10, 15, 20]
        assert run.info.status == "FINISHED"
        assert run.data.tags["apiary.state"] == "succeeded" and run.data.tags["apiary.finished"] == "true"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_tracker_that_is_down_never_stops_a_job_and_its_points_are_dropped_after_a_bound(
    start_service: Any, classification_dataset: str
) -> None:
    from service.cluster import free_port
    from service.tracking import EXPORT_GIVE_UP_S

    service = start_service(mlflow_tracking_uri=f"http://127.0.0.1:{free_port()}")  # nothing listens
    exporter = service.runtime.exporter
    assert exporter is not None and [sink.name for sink in exporter.sinks] == ["tensorboard", "mlflow"]
    job_id, _ = start_job(service, classification_dataset)
    post(service, job_id, range(1, 11))
    started = time.time()
    assert exporter.export_once(now=started) == 10  # TensorBoard took them; MLflow failed, retried later
    assert time.time() - started < 30
    post(service, job_id, range(11, 13))
    exporter.export_once(now=started + 1)
    assert "dropped" not in str(service.http.get(f"/jobs/{job_id}/events").json())
    exporter.export_once(now=started + EXPORT_GIVE_UP_S + 1)
    reasons = [event["reason"] for event in service.http.get(f"/jobs/{job_id}/events").json()["data"]]
    assert any(reason.startswith("mlflow export dropped 12 points") for reason in reasons), reasons
    assert 'apiary_export_dropped_points_total{sink="mlflow"} 12.0' in service.http.get("/metrics").text
    assert service.job(job_id)["state"] == "running"


def test_tensorboard_refuses_job_ids_out_of_range(service: Service) -> None:
    for bad in ("0", "34056286880906911618401566720"):
        refused = service.http.get("/tensorboard", params={"job": [bad]})
        assert refused.status_code == 422, refused.text
