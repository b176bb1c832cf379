"""Loss plateaus (service.plateau) over real HTTP and a real database, with a fake cluster: the
telemetry that shows one records an `anomaly` event, and `on_plateau: stop` ends the job `succeeded`
with the reason, keeping its final checkpoint."""

from __future__ import annotations

import time
from typing import Any

from service.cluster import RayJobStatus
from tests.integration.conftest import Service

SPEC_FIELDS = {"name": "job", "max_steps": 100}


def points(steps: range, value: Any, *, rank: int = 0) -> list[dict[str, Any]]:
    """Points of `rank` at `steps` with the values `value(step)` gives."""
    return [{"step": step, "rank": rank, "time": time.time(), "values": value(step)} for step in steps]


def running(service: Service, spec: dict[str, Any]) -> dict[str, Any]:
    job = service.submit(spec)
    service.tick()
    service.backend.statuses[service.backend.submission_of(job["id"])] = RayJobStatus.RUNNING
    service.tick()
    job = service.job(job["id"])
    assert job["state"] == "running"
    return job


def reasons(service: Service, job_id: int) -> list[str]:
    return [event["reason"] for event in service.http.get(f"/jobs/{job_id}/events").json()["data"]]


def test_a_plateau_is_an_anomaly_event_and_on_plateau_stop_ends_the_job_succeeded_with_its_checkpoint(
    service: Service, spec: dict[str, Any]
) -> None:
    # warn, on the eval loss (every 10 steps): falls to step 20, then flat.
    watched = running(
        service,
        {
            **spec,
            "name": "watched",
            "eval": {"dataset": spec["dataset"], "every_steps": 10},
            "plateau": {"metric": "eval_loss", "window_steps": 30, "smoothing_steps": 0},
        },
    )
    evals = points(range(10, 70, 10), lambda step: {"loss": 1.0, "eval_loss": 2.0 - min(step, 20) / 20})
    reply = service.report(watched["id"], {"attempt": 1, "points": evals}).json()
    assert reply["stop"] is False
    assert [reason for reason in reasons(service, watched["id"]) if "[anomaly]" in reason] == [
        "eval_loss plateaued at step 50: no improvement of 0.01 (relative) in 30 steps (window_steps 30); "
        "smoothed (raw) 1, best 1 at step 20 (on_plateau: warn) [anomaly]"
    ]
    assert service.job(watched["id"])["state"] == "running"

    # stop, on the training loss: rank 0 falls for 20 steps, then stays within 1% (rank 1 goes on
    # falling: only rank 0 counts). The post that shows it is told to stop.
    stopped = running(
        service, {**spec, "name": "stopped", "plateau": {"window_steps": 25}, "on_plateau": "stop"}
    )
    falling = {"attempt": 1, "points": points(range(1, 21), lambda step: {"loss": 3.0 - step / 10})}
    assert service.report(stopped["id"], falling).json()["stop"] is False
    flat = points(range(21, 60), lambda step: {"loss": 1.0 + 0.001 * (step % 2)})
    below = points(range(21, 60), lambda step: {"loss": 1.0 - step / 100}, rank=1)
    reply = service.report(stopped["id"], {"attempt": 1, "points": flat + below}).json()
    assert reply["stop"] is True
    job = service.job(stopped["id"])
    assert (job["state"], job["stop_requested"]) == ("preempting", "plateau")
    anomaly = next(reason for reason in reasons(service, stopped["id"]) if "[anomaly]" in reason)
    assert anomaly.startswith("loss plateaued at step ") and "(on_plateau: stop)" in anomaly

    # Its ranks checkpoint at the next step and exit; Ray says the job ended.
    final = service.checkpoint_uri(stopped["id"], "checkpoint_00000060")
    service.report(stopped["id"], {"attempt": 1, "checkpoint": {"step": 60, "uri": final}})
    service.backend.statuses[job["ray_submission_id"]] = RayJobStatus.SUCCEEDED
    service.tick()
    job = service.job(stopped["id"])
    assert (job["state"], job["stop_requested"], job["latest_checkpoint"]) == ("succeeded", None, final)
    assert job["message"].startswith("stopped early: loss plateaued at step ")
    assert job["message"].endswith("(on_plateau: stop) (checkpoint at step 60)")
    assert reasons(service, stopped["id"])[-1] == job["message"]
    kept = service.http.get(f"/jobs/{stopped['id']}/checkpoints").json()["data"]
    assert [(c["uri"], c["state"]) for c in kept] == [(final, "kept")]
    assert service.job(watched["id"])["state"] == "running"  # warn never stops
