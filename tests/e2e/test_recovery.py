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
from tests.support.processes import alive, job_driver, train_workers
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


def test_a_killed_train_worker_restarts_the_group_from_the_checkpoint_and_the_run_is_the_same(
    client: ApiaryClient, dataset: str, reference: dict[str, dict[str, Any]]
) -> None:
    # FSDP only: a group restart does not depend on the strategy, and DDP's restore is what the
    # resubmission tests below check; FSDP's sharded restore, bit for bit, is checked only here.
    job = client.submit(long_spec(dataset, "worker-kill-fsdp", strategy="fsdp"))
    wait_for_step(client, job.id, KILL_AFTER)
    workers = train_workers()
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)

    job = client.wait(job.id, timeout_s=400)
    assert_same_run(client, job, reference["fsdp"])
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
    # worker-kill test above checks.
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


@pytest.mark.timeout(1500)  # three jobs, three serves
def test_serve_and_its_local_ray_killed_or_stopped_mid_run_cost_nothing_and_each_run_is_the_same(
    tmp_path: Path,
    postgres_url: str,
    dataset: str,
    reference: dict[str, dict[str, Any]],
) -> None:
    """One database and data folder through each way `apiary serve` and its local Ray go away, one
    after another (every start of a serve, a local Ray and a database costs seconds of both cores):

    1. serve SIGKILLed mid-run: its local Ray outlives it, and the serve restarted on its port
       reuses that Ray and adopts the job, which loses nothing;
    2. a clean stop (SIGTERM) mid-run: the job is checkpointed and requeued, the local Ray stops with
       the service, and the next start resumes the job on a new local Ray;
    3. the whole local Ray SIGKILLed mid-run: the service starts it again and recovers its job.
    """
    data_dir = tmp_path / "data"
    up: list[Served] = []  # the serve that is running, stopped at the end whatever happens

    def start(number: int, **kwargs: Any) -> Served:
        served = start_serve(
            data_dir=data_dir, database_url=postgres_url, log=tmp_path / f"serve-{number}.log", **kwargs
        )
        up[:] = [served]
        return served

    def stop_with_its_ray(served: Served, ray_pid: int) -> None:
        stop_serve(served)
        up.clear()
        wait_until(
            lambda: not alive(ray_pid), timeout_s=30, interval_s=0.5, what="local Ray stopping with serve"
        )
        assert not (data_dir / "ray_cluster.json").exists()

    try:
        # 1. serve SIGKILLed.
        first = start(1)
        ray_pid = int(first.ray_state()["pid"])
        with ApiaryClient(first.url) as client:
            job = client.submit(long_spec(dataset, "serve-kill"))
            wait_for_step(client, job.id, KILL_AFTER)
        first.process.kill()  # no clean shutdown
        first.process.wait(30)
        up.clear()
        assert alive(ray_pid)
        time.sleep(5)  # the job trains on, its telemetry buffered
        # Restarted where the trainers post their telemetry (its supervisor restarts it on its port).
        second = start(2, port=int(first.url.rsplit(":", 1)[1]))
        assert int(second.ray_state()["pid"]) == ray_pid
        with ApiaryClient(second.url) as client:
            job = client.wait(job.id, timeout_s=400)
            assert_same_run(client, job, reference["ddp"])
            assert (job.attempt, job.failures) == (1, 0)  # adopted, not resubmitted

            # 2. A clean stop.
            job = client.submit(long_spec(dataset, "clean-stop"))
            wait_for_step(client, job.id, KILL_AFTER)
        stop_with_its_ray(second, ray_pid)
        third = start(3)
        ray_pid = int(third.ray_state()["pid"])
        with ApiaryClient(third.url) as client:
            job = client.wait(job.id, timeout_s=400)
            assert_same_run(client, job, reference["ddp"])
            assert (job.attempt, job.failures, job.preemptions) == (2, 0, 0)
            said = reasons(client, job.id)
            assert any("the service stopped; requeued in its place" in r for r in said), said

            # 3. The local Ray SIGKILLed.
            job = client.submit(long_spec(dataset, "ray-kill"))
            wait_for_step(client, job.id, KILL_AFTER)
            os.killpg(ray_pid, signal.SIGKILL)  # the whole local Ray: GCS, raylet, driver, workers
            job = client.wait(job.id, timeout_s=400)
            assert_same_run(client, job, reference["ddp"])
            assert (job.attempt, job.failures) == (2, 1)
            new_ray_pid = int(third.ray_state()["pid"])
            assert new_ray_pid != ray_pid
            said = reasons(client, job.id)
            assert any("Ray has no record of the running job" in r for r in said), said
        stop_with_its_ray(third, new_ray_pid)
    finally:
        for served in up:
            stop_serve(served)
