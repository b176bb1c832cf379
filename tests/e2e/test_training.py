"""Through HTTP to a real local Ray: submit, train on 2 workers, checkpoint; cancel; fail clearly; a
sweep whose ASHA prunes the diverging trial. (A preemption and its exact resume, and what becomes of
serve's local Ray when serve crashes or stops cleanly, are checked in tests/e2e/test_recovery.py, on
the way to recovering a job through each.)"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from api.client import ApiaryClient, ApiaryNotFound
from api.schemas import JobPublic
from service.contract.states import TERMINAL_STATES
from service.logs import strip_ansi
from tests.e2e.conftest import Served, mlp_spec
from tests.support.wait import wait_until
from trainers.checkpoint import build_model_from_checkpoint, load_checkpoint

pytestmark = [pytest.mark.timeout(420)]


def wait_for_state(client: ApiaryClient, job_id: int, state: str, timeout_s: float = 180) -> JobPublic:
    def reached() -> JobPublic | None:
        job = client.get(job_id)
        assert job.state not in TERMINAL_STATES - {state}, job
        return job if job.state == state else None

    job: JobPublic = wait_until(reached, timeout_s=timeout_s, interval_s=0.5, what=f"job {job_id} {state}")
    return job


def test_a_two_worker_job_trains_to_a_checkpoint_that_loads(
    client: ApiaryClient, served: Served, dataset: str
) -> None:
    job = client.submit(mlp_spec(dataset))
    job = client.wait(job.id, timeout_s=300)
    assert job.state == "succeeded", job

    points = client.metrics(job.id)
    assert {p.rank for p in points} == {0, 1}
    for rank in (0, 1):
        steps = [p.step for p in points if p.rank == rank]
        assert steps == list(range(1, 31)), f"rank {rank} reported steps {steps}"
    first = [p.values["loss"] for p in points if p.step <= 5]
    last = [p.values["loss"] for p in points if p.step > 25]
    assert sum(last) / len(last) < 0.8 * sum(first) / len(first)
    assert {"loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "data_wait_s"} <= set(points[0].values)

    assert job.latest_checkpoint_step == 30
    checkpoint = Path(urlparse(job.latest_checkpoint).path)
    assert checkpoint.is_dir()

    state = load_checkpoint(checkpoint)
    assert state["step"] == 30
    model = build_model_from_checkpoint(checkpoint)
    assert sum(p.numel() for p in model.parameters()) > 0

    events = [e.to_state for e in client.events(job.id)]
    assert events[0] == "queued" and events[-1] == "succeeded"
    assert {"admitted", "running"} <= set(events)

    # Rank 0's progress lines: step 1, the last step, and one per trainers.loop.LOG_INTERVAL_S
    # between (these 30 steps take a few seconds), not one per step. Read through Apiary's logs
    # route, which reads the Ray job's log (the driver's, with the ranks' lines forwarded into it).
    raw = served.ray_jobs_api("GET", f"{job.ray_submission_id}/logs")["logs"]
    assert client.logs(job.id, raw=True) == raw
    logs = client.logs(job.id)  # Ray's colours stripped (service.logs)
    assert logs == strip_ansi(raw)
    progress = [line for line in logs.splitlines() if "trainers.loop INFO step " in line]
    assert "step 1/30 " in progress[0] and "step 30/30 " in progress[-1], progress
    assert len(progress) <= 4, progress
    assert client.logs(job.id, attempt=1, tail=3) == "".join(logs.splitlines(keepends=True)[-3:])
    assert "".join(client.follow_logs(job.id)) == logs  # the Ray job has ended: the stream ends too
    with pytest.raises(ApiaryNotFound, match="no attempt 2"):
        client.logs(job.id, attempt=2)


def test_cancel_stops_the_ray_job(client: ApiaryClient, served: Served, dataset: str) -> None:
    job = client.submit(mlp_spec(dataset, name="e2e-long", max_steps=1_000_000, checkpoint={}))
    wait_for_state(client, job.id, "running")
    cancelled = client.cancel(job.id)
    assert cancelled.state == "cancelled"

    wait_until(
        lambda: served.ray_job_status(cancelled.ray_submission_id) == "STOPPED",
        timeout_s=60,
        interval_s=0.5,
        what="the Ray job stopping",
    )
    time.sleep(2)  # a reconcile tick after the stop must not move the job
    assert client.get(job.id).state == "cancelled"


def test_the_local_rays_workers_run_at_nice_0_without_the_preemption_watcher(served: Served) -> None:
    """The local Ray's single-machine profile (service.cluster.LOCAL_RAY_ENV) reaches its workers:
    a 1-CPU task, as a train worker is scheduled, reports its niceness and the Train settings."""
    probe = (
        "import os, ray; ray.init(); "
        "print('probe', *ray.get(ray.remote(num_cpus=1)(lambda: (os.nice(0), "
        "os.environ.get('RAY_TRAIN_ENABLE_PREEMPTION_WATCHER'), "
        "os.environ.get('RAY_TRAIN_METRICS_ENABLED'), "
        "os.environ.get('RAY_LOG_MONITOR_MANY_FILES_THRESHOLD'))).remote()))"
    )
    submitted = served.ray_jobs_api(
        "POST", "", json={"entrypoint": f"{sys.executable} -c {shlex.quote(probe)}"}
    )

    def finished() -> str | None:
        status = served.ray_job_status(submitted["submission_id"])
        return status if status in {"SUCCEEDED", "FAILED"} else None

    status = wait_until(finished, timeout_s=120, interval_s=0.5, what="the probe job finishing")
    logs = served.ray_jobs_api("GET", f"{submitted['submission_id']}/logs")["logs"]
    assert status == "SUCCEEDED", logs
    assert "probe 0 0 0 0" in logs, logs


def test_a_bad_dataset_fails_with_a_reason_a_user_can_act_on(client: ApiaryClient, dataset: str) -> None:
    # The data has `features`/`label`; the gpt trainer needs `tokens`.
    job = client.submit(mlp_spec(dataset, name="e2e-wrong-columns", trainer="gpt", config={"vocab_size": 16}))
    job = client.wait(job.id, timeout_s=180)
    assert job.state == "failed"
    assert "tokens" in job.message, job.message


def test_a_sweep_prunes_the_diverging_lr_with_asha_and_reports_the_best(
    client: ApiaryClient, dataset: str
) -> None:
    """A grid over lr (1000 diverges), both trials at once: the diverging trial is compared with the
    other at a rung, stopped with a checkpoint and ends `pruned`; the best is the converging one. The
    trials' steps take milliseconds: 1500 of them outlast the sweep's passes (2 s) and the telemetry's
    round trips (1 s each way) that carry a decision to a trial.
    (A restart mid-sweep and the grid's exact coverage: tests/integration/test_sweeps.py.)"""
    base = mlp_spec(
        dataset,
        name="e2e-sweep",
        num_workers=1,
        max_steps=1500,
        checkpoint={},
        eval={"dataset": {"uri": dataset}, "every_steps": 10, "max_batches": 2},
        on_anomaly="warn",  # a diverging lr is the sweep's to stop, not a failure
    )
    sweep = client.sweep(
        {
            "name": "e2e-sweep",
            "base": base,
            "space": {
                "config.lr": {"choice": [0.05, 1000.0]},
            },
            "method": "grid",
            "parallel": 2,
            "objective": {"metric": "eval_loss", "mode": "min"},
            "early_stopping": {"method": "asha", "min_steps": 10, "reduction_factor": 2},
        }
    )
    done = wait_until(
        lambda: (view := client.get_sweep(sweep.id)).state != "running" and view,
        timeout_s=300,
        interval_s=1,
        what=f"sweep {sweep.id} ending",
    )
    assert done.state == "succeeded", done
    assert sorted(t.params["config.lr"] for t in done.trials) == [0.05, 1000.0], done.trials
    for trial in done.trials:
        if trial.params["config.lr"] == 1000.0:
            assert trial.state == "pruned", trial
            assert "pruned at rung" in (trial.message or ""), trial
            assert (trial.step or 0) < 1500, trial
            assert client.get(trial.job).latest_checkpoint_step == trial.step, trial  # resumable
    assert done.best is not None and done.best.params["config.lr"] == 0.05, done
    assert done.best.state == "succeeded" and done.best.objective is not None and done.best.objective < 1.0
    assert client.best_spec(sweep.id).config["lr"] == 0.05
