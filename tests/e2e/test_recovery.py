"""Recovery for real: a SIGKILLed train worker, job driver, `apiary serve` and local Ray, a frozen
worker and a preemption each cost at most the work since the last checkpoint, and the run ends
bit-identical to the undisturbed one (every parameter `torch.equal`, and the loss at every step of the
curve that counted equal).

A job's start (a Ray job's driver, a Train worker group) costs ~20 s of both cores here and its steps
take milliseconds, so the disturbances are chained: one long run takes several, each past a periodic
checkpoint, and is compared once with one undisturbed run. FSDP's sharded restore after a group restart
is checked bit for bit by tests/ray/test_hf_gpt2.py."""

from __future__ import annotations

import contextlib
import os
import re
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

STEPS = 1200
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
def reference(served: Served, dataset: str) -> dict[str, Any]:
    """The undisturbed run: its final checkpoint and every rank's loss at every step."""
    with ApiaryClient(served.url) as client:
        job = client.wait(client.submit(long_spec(dataset, "whole")).id, timeout_s=400)
        assert job.state == "succeeded", job
        return {"job": job, "loss": loss_curve(client, job.id)}


def loss_curve(client: ApiaryClient, job_id: int) -> dict[tuple[int, int], float]:
    return {(p.step, p.rank): p.values["loss"] for p in client.metrics(job_id)}


def assert_same_run(client: ApiaryClient, job: JobPublic, whole: dict[str, Any]) -> None:
    assert job.state == "succeeded", job
    assert job.latest_checkpoint_step == STEPS, reasons(client, job.id)
    # The curve that counted: every step of every rank, each equal to the undisturbed run's.
    assert loss_curve(client, job.id) == whole["loss"]
    final = build_model_from_checkpoint(urlparse(job.latest_checkpoint).path).state_dict()
    expected = build_model_from_checkpoint(urlparse(whole["job"].latest_checkpoint).path).state_dict()
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], tensor) for name, tensor in expected.items())


def wait_for_step(client: ApiaryClient, job_id: int, step: int) -> None:
    def reached() -> bool:
        job = client.get(job_id)
        assert job.state in ("queued", "admitted", "running", "recovering"), job
        return (job.latest_step or 0) >= step

    wait_until(reached, timeout_s=300, interval_s=0.2, what=f"job {job_id} at step {step}")


def local_ray(served: Served) -> int:
    """Serve's local Ray's first process: its processes, and its jobs' drivers and workers, descend
    from it."""
    return int(served.ray_state()["pid"])


def wait_for_checkpoint(client: ApiaryClient, job_id: int, step: int, *, attempt: int = 1) -> int:
    """Wait until the job's attempt `attempt` runs and its latest checkpoint is at `step` or later, and
    return that step: a disturbance after it lands mid-run, with the run's steps (milliseconds each)
    far from their end whatever the machine's load does to the service's view of them."""

    def reached() -> int | None:
        job = client.get(job_id)
        assert job.state in ("queued", "admitted", "running", "recovering"), job
        latest = job.latest_checkpoint_step or 0
        return latest if job.attempt == attempt and latest >= step else None

    return wait_until(reached, timeout_s=300, interval_s=0.2, what=f"job {job_id}'s checkpoint {step}")


def reasons(client: ApiaryClient, job_id: int) -> list[str]:
    return [event.reason for event in client.events(job_id)]


def test_a_killed_worker_a_preemption_and_a_killed_driver_each_resume_and_the_run_is_the_same(
    client: ApiaryClient, served: Served, dataset: str, reference: dict[str, Any]
) -> None:
    job = client.submit(long_spec(dataset, "worker-preempt-driver"))

    # 1. A train worker SIGKILLed past its first checkpoint: Ray Train restarts the group from it.
    wait_for_checkpoint(client, job.id, EVERY)
    workers = train_workers(local_ray(served))
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    restarted = wait_until(
        lambda: next(
            (r for r in reasons(client, job.id) if "worker group restarted by Ray Train" in r), None
        ),
        timeout_s=120,
        what="the group restart's event",
    )
    restarted_at = int(re.findall(r"resumed from step (\d+)", restarted)[0])
    assert restarted_at in range(EVERY, STEPS, EVERY), restarted
    said = reasons(client, job.id)
    assert any("worker group failed (rank" in reason and "[worker_failed]" in reason for reason in said), said

    # 2. Preempted by hand past the restarted group's first checkpoint: it checkpoints at its next step
    # boundary, goes back to the queue and is readmitted where it stopped.
    wait_for_checkpoint(client, job.id, restarted_at + EVERY)
    assert client.preempt(job.id).state == "preempting"
    wait_until(lambda: client.get(job.id).attempt == 2, timeout_s=300, what="attempt 2")
    said = reasons(client, job.id)
    assert "preempted by e2e" in said, said
    resumed = next(reason for reason in said if "resumes from its checkpoint at step" in reason)
    stopped_at = int(resumed.split("checkpoint at step ")[1].split()[0])
    assert restarted_at + EVERY <= stopped_at < STEPS, resumed

    # 3. Its driver SIGKILLed past attempt 2's first periodic checkpoint: resubmitted as attempt 3.
    killed_after = wait_for_checkpoint(client, job.id, stopped_at + 1, attempt=2)
    driver = job_driver(job.id, local_ray(served))
    assert driver is not None
    os.kill(driver, signal.SIGKILL)

    job = client.wait(job.id, timeout_s=400)
    assert_same_run(client, job, reference)
    assert (job.attempt, job.restarts, job.failures, job.preemptions) == (3, 1, 2, 1), job
    said = reasons(client, job.id)
    assert any("resubmitted as attempt 3, resuming from its newest complete checkpoint" in r for r in said), (
        said
    )
    # The new attempt's worker group says where it resumed: a periodic checkpoint taken before the kill
    # (the service hears of steps a moment late, so the kill may land after the next one).
    started = next(r for r in said if r.startswith("worker group of 2 started (attempt 3)"))
    resumed_at = int(started.split("from its checkpoint at step ")[1].split()[0])
    assert resumed_at in range(killed_after, STEPS, EVERY), started
    # The preempted attempt's steps end where it stopped; attempt 2 began right after.
    points = client.metrics(job.id, rank=0)
    assert min(p.step for p in points if p.attempt == 2) == stopped_at + 1
    # The abandoned steps are kept apart: on request, steps past the group restart's checkpoint
    # appear twice.
    replayed = [p for p in client.metrics(job.id, rank=0, segments="all") if p.step == restarted_at + 1]
    assert len({p.segment for p in replayed}) == 2


def test_a_frozen_train_worker_is_detected_and_its_job_restarted_from_the_checkpoint(
    client: ApiaryClient, served: Served, dataset: str, reference: dict[str, Any]
) -> None:
    job = client.submit(long_spec(dataset, "frozen-worker"))
    wait_for_step(client, job.id, KILL_AFTER)
    workers = train_workers(local_ray(served))
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGSTOP)  # alive, and making no progress: a hang
    try:
        job = client.wait(job.id, timeout_s=400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[-1], signal.SIGKILL)
    assert_same_run(client, job, reference)
    assert (job.attempt, job.failures) == (2, 1)
    hung = next(r for r in reasons(client, job.id) if "no rank completed a step" in r)
    assert "stopped reporting" in hung and "frozen, or cut off" in hung, hung


@pytest.mark.timeout(1500)  # two jobs, three serves
def test_serve_and_its_local_ray_killed_or_stopped_mid_run_cost_nothing_and_each_run_is_the_same(
    tmp_path: Path,
    postgres_url: str,
    dataset: str,
    reference: dict[str, Any],
) -> None:
    """One database and data folder through each way `apiary serve` and its local Ray go away, one
    after another (every start of a serve, a local Ray and a database costs seconds of both cores):

    1. serve SIGKILLed mid-run: its local Ray outlives it, and the serve restarted on its port
       reuses that Ray and adopts the job, which loses nothing;
    2. a clean stop (SIGTERM) mid-run: the job is checkpointed and requeued, the local Ray stops with
       the service, and the next start resumes the job on a new local Ray;
    3. then that whole local Ray SIGKILLed mid-run: the service starts it again and recovers the job.
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
            assert_same_run(client, job, reference)
            assert (job.attempt, job.failures) == (1, 0)  # adopted, not resubmitted

            # 2. A clean stop.
            job = client.submit(long_spec(dataset, "clean-stop-then-ray-kill"))
            wait_for_step(client, job.id, KILL_AFTER)
        stop_with_its_ray(second, ray_pid)
        third = start(3)
        ray_pid = int(third.ray_state()["pid"])
        with ApiaryClient(third.url) as client:
            wait_until(lambda: client.get(job.id).attempt == 2, timeout_s=120, what="attempt 2")
            said = reasons(client, job.id)
            assert any("the service stopped; requeued in its place" in r for r in said), said
            stopped_at = int(
                next(r for r in said if "resumes from its checkpoint at step" in r)
                .split("checkpoint at step ")[1]
                .split()[0]
            )
            assert KILL_AFTER <= stopped_at < STEPS, said

            # 3. The same job's new local Ray SIGKILLed, past its next periodic checkpoint.
            wait_for_checkpoint(client, job.id, stopped_at + 1, attempt=2)
            os.killpg(ray_pid, signal.SIGKILL)  # the whole local Ray: GCS, raylet, driver, workers
            job = client.wait(job.id, timeout_s=400)
            assert_same_run(client, job, reference)
            # The clean stop is neither a failure nor a preemption; the lost Ray is a failure.
            assert (job.attempt, job.failures, job.preemptions) == (3, 1, 0), job
            new_ray_pid = int(third.ray_state()["pid"])
            assert new_ray_pid != ray_pid
            said = reasons(client, job.id)
            assert any("Ray has no record of the running job" in r for r in said), said
        stop_with_its_ray(third, new_ray_pid)
    finally:
        for served in up:
            stop_serve(served)
