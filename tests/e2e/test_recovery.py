"""Recovery for real: a SIGKILLed train worker, job driver, `apiary serve` and local Ray each cost at
most the work since the last checkpoint, and the run ends bit-identical to the undisturbed one (every
parameter `torch.equal`, and the loss at every step of the curve that counted equal)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch

from api.client import ApiaryClient
from api.schemas import JobPublic
from tests.e2e.conftest import Served, mlp_spec, serving, start_serve, stop_serve
from tests.support.processes import job_driver, train_workers
from tests.support.wait import wait_until
from trainers.checkpoint import build_model_from_checkpoint

pytestmark = [pytest.mark.timeout(600)]

STEPS = 600
EVERY = 200
KILL_AFTER = 260  # a step past the first checkpoint, well before the end


# A hang is declared after 10 s without a step (60 s by default), so that the hang test is short.
HANG_FLOOR_S = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("e2e"), env={"APIARY_HANG_FLOOR_S": str(HANG_FLOOR_S)}) as served:
        yield served


def long_spec(dataset: str, name: str, **overrides: Any) -> dict[str, Any]:
    return mlp_spec(
        dataset, name=name, max_steps=STEPS, checkpoint={"every_steps": EVERY}, max_failures=2, **overrides
    )


@pytest.fixture(scope="module")
def reference(served: Served, dataset: str) -> dict[str, dict[str, Any]]:
    """The undisturbed runs, DDP and FSDP: their final checkpoint and rank 0's loss at every step."""
    runs = {}
    with ApiaryClient(served.url) as client:
        for strategy in ("ddp", "fsdp"):
            job = client.wait(
                client.submit(long_spec(dataset, f"whole-{strategy}", strategy=strategy)).id, timeout_s=400
            )
            assert job.state == "succeeded", job
            runs[strategy] = {"job": job, "loss": loss_curve(client, job.id)}
    return runs


def loss_curve(client: ApiaryClient, job_id: int) -> dict[tuple[int, int], float]:
    return {(p.step, p.rank): p.values["loss"] for p in client.metrics(job_id)}


def assert_same_run(client: ApiaryClient, job: JobPublic, whole: dict[str, Any]) -> None:
    assert job.state == "succeeded", job
    assert job.latest_checkpoint_step == STEPS
    # The curve that counted: every step of every rank, each equal to the undisturbed run's.
    assert loss_curve(client, job.id) == whole["loss"]
    final = build_model_from_checkpoint(urlparse(job.latest_checkpoint).path).state_dict()
    expected = build_model_from_checkpoint(urlparse(whole["job"].latest_checkpoint).path).state_dict()
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], tensor) for name, tensor in expected.items())


def wait_for_step(client: ApiaryClient, job_id: int, step: int) -> None:
    def reached() -> bool:
        job = client.get(job_id)
        assert job.state in ("queued", "admitted", "running"), job
        return (job.latest_step or 0) >= step

    wait_until(reached, timeout_s=300, interval_s=0.2, what=f"job {job_id} at step {step}")


def reasons(client: ApiaryClient, job_id: int) -> list[str]:
    return [event.reason for event in client.events(job_id)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_killed_train_worker_restarts_the_group_from_the_checkpoint_and_the_run_is_the_same(
    client: ApiaryClient,
    dataset: str,
    reference: dict[str, dict[str, Any]],
    strategy: str,
) -> None:
    job = client.submit(long_spec(dataset, f"worker-kill-{strategy}", strategy=strategy))
    wait_for_step(client, job.id, KILL_AFTER)
    workers = train_workers()
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)

    job = client.wait(job.id, timeout_s=400)
    assert_same_run(client, job, reference[strategy])
    assert (job.attempt, job.restarts, job.failures) == (1, 1, 1)
    said = reasons(client, job.id)
    assert any("worker group failed (rank" in reason and "[worker_failed]" in reason for reason in said), said
    restart = next(reason for reason in said if "worker group restarted by Ray Train" in reason)
    assert f"resumed from step {EVERY}" in restart, restart
    # The abandoned steps are kept apart: on request, steps past the checkpoint appear twice.
    replayed = [p for p in client.metrics(job.id, rank=0, segments="all") if p.step == EVERY + 1]
    assert len({p.segment for p in replayed}) == 2


def test_a_killed_driver_is_resubmitted_from_the_checkpoint_and_the_run_is_the_same(
    client: ApiaryClient, dataset: str, reference: dict[str, dict[str, Any]]
) -> None:
    # DDP only: resubmission does not depend on the strategy, and FSDP's sharded restore is what the
    # worker-kill test above checks for both.
    job = client.submit(long_spec(dataset, "driver-kill"))
    wait_for_step(client, job.id, KILL_AFTER)
    driver = job_driver(job.id)
    assert driver is not None
    os.kill(driver, signal.SIGKILL)

    job = client.wait(job.id, timeout_s=400)
    assert_same_run(client, job, reference["ddp"])
    assert (job.attempt, job.failures) == (2, 1)
    said = reasons(client, job.id)
    assert any("resubmitted as attempt 2, resuming from its newest complete checkpoint" in r for r in said), (
        said
    )
    # The new attempt's worker group says where it resumed: a checkpoint taken before the kill (the
    # service hears of steps a moment late, so the kill may land after the second one).
    started = next(r for r in said if r.startswith("worker group of 2 started (attempt 2)"))
    resumed = int(started.split("from its checkpoint at step ")[1].split()[0])
    assert resumed in range(EVERY, STEPS, EVERY), started


def test_a_frozen_train_worker_is_detected_and_its_job_restarted_from_the_checkpoint(
    client: ApiaryClient, dataset: str, reference: dict[str, dict[str, Any]]
) -> None:
    job = client.submit(long_spec(dataset, "frozen-worker"))
    wait_for_step(client, job.id, KILL_AFTER)
    workers = train_workers()
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGSTOP)  # alive, and making no progress: a hang
    try:
        job = client.wait(job.id, timeout_s=400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[-1], signal.SIGKILL)
    assert_same_run(client, job, reference["ddp"])
    assert (job.attempt, job.failures) == (2, 1)
    hung = next(r for r in reasons(client, job.id) if "no rank completed a step" in r)
    assert "stopped reporting" in hung and "frozen, or cut off" in hung, hung


def test_serve_killed_mid_run_loses_nothing_and_the_run_is_the_same(
    tmp_path: Path,
    postgres_url: str,
    dataset: str,
    reference: dict[str, dict[str, Any]],
) -> None:
    data_dir = tmp_path / "data"
    first = start_serve(data_dir=data_dir, database_url=postgres_url, log=tmp_path / "serve-1.log")
    with ApiaryClient(first.url) as client:
        job = client.submit(long_spec(dataset, "serve-kill"))
        wait_for_step(client, job.id, KILL_AFTER)
    first.process.kill()
    first.process.wait(30)
    time.sleep(5)  # the job trains on, its telemetry buffered
    # Restarted where the trainers post their telemetry (its supervisor restarts it on its port).
    port = int(first.url.rsplit(":", 1)[1])
    second = start_serve(
        data_dir=data_dir, database_url=postgres_url, log=tmp_path / "serve-2.log", port=port
    )
    try:
        assert second.ray_state()["pid"] == first.ray_state()["pid"]
        with ApiaryClient(second.url) as client:
            job = client.wait(job.id, timeout_s=400)
            assert_same_run(client, job, reference["ddp"])
            assert (job.attempt, job.failures) == (1, 0)  # adopted, not resubmitted
    finally:
        stop_serve(second)


def test_a_dead_local_ray_is_started_again_and_its_job_recovered(
    tmp_path: Path,
    postgres_url: str,
    dataset: str,
    reference: dict[str, dict[str, Any]],
) -> None:
    served = start_serve(data_dir=tmp_path / "data", database_url=postgres_url, log=tmp_path / "serve.log")
    try:
        old_ray = int(served.ray_state()["pid"])
        with ApiaryClient(served.url) as client:
            job = client.submit(long_spec(dataset, "ray-kill"))
            wait_for_step(client, job.id, KILL_AFTER)
            os.killpg(old_ray, signal.SIGKILL)  # the whole local Ray: GCS, raylet, driver, workers
            job = client.wait(job.id, timeout_s=400)
            assert_same_run(client, job, reference["ddp"])
            assert (job.attempt, job.failures) == (2, 1)
            assert int(served.ray_state()["pid"]) != old_ray
            said = reasons(client, job.id)
            assert any("Ray has no record of the running job" in r for r in said), said
    finally:
        stop_serve(served)


def test_a_clean_stop_checkpoints_and_requeues_and_the_next_start_resumes(
    tmp_path: Path,
    postgres_url: str,
    dataset: str,
    reference: dict[str, dict[str, Any]],
) -> None:
    data_dir = tmp_path / "data"
    first = start_serve(data_dir=data_dir, database_url=postgres_url, log=tmp_path / "serve-1.log")
    with ApiaryClient(first.url) as client:
        job = client.submit(long_spec(dataset, "clean-stop"))
        wait_for_step(client, job.id, KILL_AFTER)
    stop_serve(first)
    second = start_serve(data_dir=data_dir, database_url=postgres_url, log=tmp_path / "serve-2.log")
    try:
        with ApiaryClient(second.url) as client:
            job = client.wait(job.id, timeout_s=400)
            assert_same_run(client, job, reference["ddp"])
            assert (job.attempt, job.failures, job.preemptions) == (2, 0, 0)
            said = reasons(client, job.id)
            assert any("the service stopped; requeued in its place" in r for r in said), said
    finally:
        stop_serve(second)
