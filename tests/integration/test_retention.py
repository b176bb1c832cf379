"""Checkpoint retention over real HTTP and a real database (SQLite and PostgreSQL), with real folders:
a local run folder on disk, and a run folder on the S3 server (moto on loopback) reached through a
proxy that the test stops and starts, so that a deletion fails and is retried later."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow.fs as pafs
import pytest

from service.cluster import RayJobStatus
from service.contract.storage import checkpoint_uri, resolve_uri
from service.scheduling.retention import TOMBSTONE
from service.scheduling.scheduler import run_name
from tests.conftest import S3
from tests.integration.conftest import Service
from tests.integration.test_recovery import post
from tests.integration.test_scheduler import run_to_running
from tests.support.proxy import TcpProxy

EVERY = 5


def job_spec(dataset: str, **checkpoint: Any) -> dict[str, Any]:
    return {
        "name": "long-run",
        "trainer": "mlp",
        "num_workers": 1,
        "dataset": {"uri": dataset},
        "max_steps": 100,
        "batch_size": 8,
        "checkpoint": {"every_steps": EVERY, **checkpoint},
        "config": {"task": "classification", "num_classes": 3},
    }


def folder_of(service: Service, job_id: int, step: int) -> str:
    return checkpoint_uri(
        storage_uri=service.runtime.settings.resolved_storage_uri,
        run_name=run_name(job_id),
        name=f"checkpoint_{step:08d}",
    )


def write_checkpoint(uri: str, *, s3_endpoint_url: str | None = None) -> None:
    """A checkpoint folder as the trainers leave it: a file, and a folder of shards."""
    path, filesystem = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    filesystem.create_dir(f"{path}/sharded")
    for name in ("state.pt", "sharded/__0_0.distcp"):
        with filesystem.open_output_stream(f"{path}/{name}") as out:
            out.write(b"weights")


def contents(uri: str, *, s3_endpoint_url: str | None = None) -> set[str]:
    path, filesystem = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
    return {
        info.path[len(path) + 1 :]
        for info in filesystem.get_file_info(selector)
        if info.type == pafs.FileType.File
    }


def report(service: Service, job_id: int, step: int, *, loss: float) -> None:
    """Rank 0's telemetry of the steps since the last checkpoint, and the checkpoint at `step`."""
    points = [
        {"step": s, "rank": rank, "time": time.time(), "values": {"loss": loss + 0.01 * (step - s)}}
        for s in range(step - EVERY + 1, step + 1)
        for rank in (0, 1)
    ]
    post(
        service,
        job_id,
        {
            "attempt": 1,
            "points": points,
            "checkpoint": {"step": step, "uri": folder_of(service, job_id, step)},
        },
    )


def listed(service: Service, job_id: int) -> dict[int, dict[str, Any]]:
    response = service.http.get(f"/jobs/{job_id}/checkpoints")
    assert response.status_code == 200, response.text
    return {c["step"]: c for c in response.json()["data"]}


def loss_at(step: int) -> float:
    """Falling slowly, with two dips that keep_best keeps: step 35 (best) and step 60."""
    return {35: 0.05, 60: 0.07}.get(step, 2.0 - step / 100)


def test_a_long_run_keeps_its_last_and_best_checkpoints_and_deletes_the_rest_from_disk(
    service: Service, classification_dataset: str
) -> None:
    spec = job_spec(
        classification_dataset, keep_last=3, keep_best={"metric": "loss", "mode": "min", "count": 2}
    )
    job_id = service.submit(spec)["id"]
    run_to_running(service, [job_id])
    steps = list(range(EVERY, 101, EVERY))  # 20 checkpoints
    for step in steps:
        write_checkpoint(folder_of(service, job_id, step))
        report(service, job_id, step, loss=loss_at(step))
        if step % 25 == 0:
            service.tick()  # retention runs as the checkpoints come, not only at the end
    report(service, job_id, 100, loss=loss_at(100))  # a re-post (its answer was lost): still one row
    service.tick()

    expected = {35, 60, 90, 95, 100}
    on_disk = {step for step in steps if contents(folder_of(service, job_id, step))}
    full = {s for s in steps if "state.pt" in contents(folder_of(service, job_id, s))}
    assert full == expected
    assert on_disk == set(steps)  # deleted ones keep their tombstone only (service.scheduling.retention)
    for step in set(steps) - expected:
        assert contents(folder_of(service, job_id, step)) == {TOMBSTONE}
    rows = listed(service, job_id)
    assert sorted(rows) == steps
    assert {s for s, row in rows.items() if row["state"] == "kept"} == expected
    assert {row["state"] for s, row in rows.items() if s not in expected} == {"deleted"}
    assert rows[35]["metrics"]["loss"] == pytest.approx(0.05) and rows[100]["uri"] == folder_of(
        service, job_id, 100
    )
    assert service.job(job_id)["latest_checkpoint"] == folder_of(service, job_id, 100)

    # The job ends; its latest checkpoint and the kept ones stay, and a later tick changes nothing.
    service.backend.statuses[service.backend.submission_of(job_id)] = RayJobStatus.SUCCEEDED
    service.tick()
    service.tick()
    assert service.job(job_id)["state"] == "succeeded"
    assert {s for s, row in listed(service, job_id).items() if row["state"] == "kept"} == expected
    events = [e["reason"] for e in service.http.get(f"/jobs/{job_id}/events").json()["data"]]
    assert any(
        "deleting" in e and "keep_last 3 and keep_best 2 by min loss" in e and "resumes from step" in e
        for e in events
    )


def test_the_checkpoint_a_job_resumes_from_is_kept_when_newer_ones_come_late(
    service: Service, classification_dataset: str
) -> None:
    job_id = service.submit(job_spec(classification_dataset, keep_last=1))["id"]
    run_to_running(service, [job_id])
    for step in (5, 10, 15):
        write_checkpoint(folder_of(service, job_id, step))
        report(service, job_id, step, loss=1.0)
    service.tick()
    # A late post of an older checkpoint (its answer was lost, then the run moved on): it is not the
    # one the job resumes from, and not newer than it: it goes.
    write_checkpoint(folder_of(service, job_id, 12))
    report(service, job_id, 12, loss=1.0)
    service.tick()
    rows = listed(service, job_id)
    assert {s: row["state"] for s, row in rows.items()} == {
        5: "deleted",
        10: "deleted",
        12: "deleted",
        15: "kept",
    }
    assert service.job(job_id)["latest_checkpoint_step"] == 15
    assert "state.pt" in contents(folder_of(service, job_id, 15))


def test_retention_settings_are_validated_at_submission(
    service: Service, classification_dataset: str
) -> None:
    for checkpoint, field in (
        ({"keep_last": 0}, "keep_last"),
        ({"keep_best": {"metric": "loss", "mode": "best"}}, "mode"),
    ):
        response = service.http.post("/jobs", json=job_spec(classification_dataset, **checkpoint))
        assert response.status_code == 422
        assert field in response.text
    assert service.http.get("/jobs/999/checkpoints").status_code == 404


@pytest.fixture
def proxy(s3: S3) -> Iterator[TcpProxy]:
    host, port = s3.endpoint_url.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port))
    yield proxy
    proxy.close()


@pytest.fixture
def s3_job(
    start_service: Callable[..., Service],
    classification_dataset: str,
    s3: S3,
    proxy: TcpProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[..., tuple[Service, int]]:
    """Starts the service (with `settings`), which reaches S3 through the proxy (the test writes and
    reads S3 directly), and a job that keeps 2 of its 4 checkpoints (steps 5, 10, 15, 20) in S3."""

    def start(**settings: Any) -> tuple[Service, int]:
        monkeypatch.setenv("APIARY_STORAGE_URI", s3.checkpoints_uri)
        monkeypatch.setenv("APIARY_S3_ENDPOINT_URL", f"http://{proxy.address}")
        service = start_service(**settings)
        job_id = service.submit(job_spec(classification_dataset, keep_last=2))["id"]
        run_to_running(service, [job_id])
        assert folder_of(service, job_id, 5).startswith(f"{s3.checkpoints_uri}/job-{job_id}/")
        for step in (5, 10, 15, 20):
            write_checkpoint(folder_of(service, job_id, step), s3_endpoint_url=s3.endpoint_url)
            report(service, job_id, step, loss=1.0)
        return service, job_id

    return start


def test_a_deletion_that_fails_while_s3_is_down_stays_deleting_and_succeeds_later(
    s3_job: Callable[..., tuple[Service, int]], s3: S3, proxy: TcpProxy
) -> None:
    # Each try at an unreachable S3 lasts a second or more (the client's retries): a long lease gives
    # the pass the time for both (its budget is half the lease; the next test bounds it).
    service, job_id = s3_job(scheduler_lease_s=60)
    proxy.close()  # S3 is unreachable for the service
    now = time.time()
    service.tick(now)
    rows = listed(service, job_id)
    for step in (5, 10):
        assert rows[step]["state"] == "deleting" and rows[step]["delete_attempts"] == 1
        assert rows[step]["last_error"]
        assert "state.pt" in contents(folder_of(service, job_id, step), s3_endpoint_url=s3.endpoint_url)
    assert {rows[s]["state"] for s in (15, 20)} == {"kept"}
    service.tick(now + 1)  # before its retry time: not tried again
    assert listed(service, job_id)[5]["delete_attempts"] == 1

    proxy.open()
    service.tick(now + 3600)
    rows = listed(service, job_id)
    assert {s: row["state"] for s, row in rows.items()} == {
        5: "deleted",
        10: "deleted",
        15: "kept",
        20: "kept",
    }
    assert rows[5]["delete_attempts"] == 2 and rows[5]["last_error"] is None
    for step in (5, 10):
        assert contents(folder_of(service, job_id, step), s3_endpoint_url=s3.endpoint_url) == {TOMBSTONE}
    for step in (15, 20):
        assert "state.pt" in contents(folder_of(service, job_id, step), s3_endpoint_url=s3.endpoint_url)


def test_a_pass_stops_deleting_when_its_time_is_up_and_the_next_pass_goes_on(
    s3_job: Callable[..., tuple[Service, int]], proxy: TcpProxy
) -> None:
    # Its ticks carry a time taken before the first: a lease of 60 s still holds at the second whatever
    # the machine's load (with the default 5 s a slow first pass let it lapse, and nothing was tried).
    service, job_id = s3_job(scheduler_lease_s=60.0)
    service.runtime.scheduler.retention.max_pass_s = 0.0  # type: ignore[union-attr]
    proxy.close()  # each try lasts past the budget: one a pass
    now = time.time()
    service.tick(now)
    attempts = {step: row["delete_attempts"] for step, row in listed(service, job_id).items()}
    assert attempts == {5: 1, 10: 0, 15: 0, 20: 0}
    service.tick(now + 1)  # 5 waits for its retry time; 10 is still due
    attempts = {step: row["delete_attempts"] for step, row in listed(service, job_id).items()}
    assert attempts == {5: 1, 10: 1, 15: 0, 20: 0}


def test_retention_keeps_the_newest_across_a_worker_group_restart_and_a_recovery(
    service: Service, classification_dataset: str
) -> None:
    job_id = service.submit({**job_spec(classification_dataset, keep_last=2), "max_failures": 3})["id"]
    run_to_running(service, [job_id])

    def checkpoint(step: int, *, attempt: int, segment: int) -> None:
        write_checkpoint(folder_of(service, job_id, step))
        point = {"step": step, "rank": 0, "time": time.time(), "values": {"loss": 1.0}}
        checkpoint = {"step": step, "uri": folder_of(service, job_id, step)}
        post(
            service,
            job_id,
            {"attempt": attempt, "segment": segment, "points": [point], "checkpoint": checkpoint},
        )

    for step in (5, 10, 15):
        checkpoint(step, attempt=1, segment=1000)
    service.tick()
    for step in (20, 25):  # a worker died: Ray Train restarted the group from step 15
        checkpoint(step, attempt=1, segment=2000)
    service.tick()
    # The driver died: the job is resubmitted as attempt 2, from step 25.
    service.backend.statuses[service.job(job_id)["ray_submission_id"]] = RayJobStatus.FAILED
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["restarts"], job["failures"]) == ("recovering", 1, 2)
    service.backend.statuses[job["ray_submission_id"]] = RayJobStatus.RUNNING
    service.tick()
    for step in (30, 35):
        checkpoint(step, attempt=2, segment=3000)
    service.tick()

    steps = range(5, 36, 5)
    assert {s for s, c in listed(service, job_id).items() if c["state"] == "kept"} == {30, 35}
    assert {s for s in steps if "state.pt" in contents(folder_of(service, job_id, s))} == {30, 35}
