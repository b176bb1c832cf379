"""Sweeps over real HTTP on SQLite and PostgreSQL, with a fake cluster (Ray is not under test): trials
are ordinary jobs, grid covers exactly its points, ASHA prunes the losers (which can be resumed), a
restarted runner (or a second leader) neither loses nor repeats a trial, and the best is reported."""

from __future__ import annotations

import time
from typing import Any

from service.cluster import RayJobStatus
from service.sweeps import SweepRunner
from tests.integration.conftest import Service

SPEC_FIELDS = {"name": "sweep-base", "max_steps": 40}


def sweep_file(spec: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {
        "name": "lr-search",
        "base": spec,
        "space": {"config.lr": {"choice": [0.1, 0.01]}, "batch_size": {"int": [4, 5]}},
        "method": "grid",
        "max_trials": 10,
        "parallel": 2,
        "objective": {"metric": "loss", "mode": "min"},
        **changes,
    }


def trials(service: Service, sweep_id: int) -> list[dict[str, Any]]:
    body: list[dict[str, Any]] = service.http.get(f"/sweeps/{sweep_id}").json()["trials"]
    return body


def run(service: Service, job_id: int) -> str:
    """Admit and start a queued trial on the fake cluster; its Ray submission id."""
    service.tick()
    submission_id = service.job(job_id)["ray_submission_id"]
    service.backend.statuses[submission_id] = RayJobStatus.RUNNING
    service.tick()
    assert service.job(job_id)["state"] == "running"
    return str(submission_id)


def report(service: Service, job_id: int, losses: dict[int, float]) -> None:
    now = time.time()
    points = [{"step": s, "rank": 0, "time": now, "values": {"loss": v}} for s, v in losses.items()]
    assert service.report(job_id, {"attempt": 1, "points": points}).status_code == 202


def test_grid_runs_each_point_once_through_a_restart_and_reports_the_best(
    service: Service, spec: dict[str, Any]
) -> None:
    created = service.http.post("/sweeps", json=sweep_file(spec))
    assert created.status_code == 201, created.text
    sweep = created.json()
    assert (sweep["state"], sweep["total"], sweep["trials"]) == ("running", 4, [])
    runner = service.runtime.sweep_runner
    runner.tick()
    first = trials(service, sweep["id"])
    assert [t["trial"] for t in first] == [0, 1]  # parallel: 2
    runner.tick()
    assert len(trials(service, sweep["id"])) == 2

    # A second runner on the same database (a restarted service, a new leader) starts nothing twice.
    other = SweepRunner(db=runner.db, jobs=runner.jobs, is_leader=lambda: True)
    for trial in first:
        submission_id = run(service, trial["job"])
        report(service, trial["job"], {10: 1.0 + trial["trial"], 40: 0.5 + trial["trial"]})
        service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
        service.tick()
    other.tick()
    runner.tick()
    second = trials(service, sweep["id"])
    assert [t["trial"] for t in second] == [0, 1, 2, 3]
    for trial in second[2:]:
        submission_id = run(service, trial["job"])
        report(service, trial["job"], {40: 0.25 if trial["trial"] == 3 else 2.0})
        service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
        service.tick()
    runner.tick()
    done = service.http.get(f"/sweeps/{sweep['id']}").json()
    points = {(t["params"]["config.lr"], t["params"]["batch_size"]) for t in done["trials"]}
    assert points == {(0.1, 4), (0.1, 5), (0.01, 4), (0.01, 5)}  # exactly the grid
    assert done["state"] == "succeeded"
    assert (done["best"]["trial"], done["best"]["objective"]) == (3, 0.25)
    job = service.job(done["best"]["job"])
    assert job["spec"]["batch_size"] == done["best"]["params"]["batch_size"]
    assert job["spec"]["config"]["lr"] == done["best"]["params"]["config.lr"]
    best = service.http.get(f"/sweeps/{sweep['id']}/best", params={"queue": "full-scale"}).json()
    assert (best["queue"], best["name"], best["config"]["lr"]) == (
        "full-scale",
        "lr-search-best",
        job["spec"]["config"]["lr"],
    )


def test_asha_prunes_the_losers_at_their_rung_and_a_pruned_trial_resumes(
    service: Service, spec: dict[str, Any]
) -> None:
    body = sweep_file(
        spec,
        method="random",
        space={"config.lr": {"loguniform": [1e-3, 1.0]}},
        max_trials=4,
        parallel=4,
        early_stopping={"min_steps": 10, "reduction_factor": 2},
    )
    sweep = service.http.post("/sweeps", json=body).json()
    runner = service.runtime.sweep_runner
    runner.tick()
    started = trials(service, sweep["id"])
    assert len(started) == 4
    submissions = {t["job"]: run(service, t["job"]) for t in started}
    for t in started:  # trials 2 and 3 diverge
        report(service, t["job"], {5: 2.0, 10: 1.0 if t["trial"] < 2 else 5.0 + t["trial"]})
    runner.tick()
    states = {t["trial"]: service.job(t["job"]) for t in started}
    assert [states[i]["state"] for i in range(4)] == ["running", "running", "preempting", "preempting"]
    assert states[3]["stop_requested"] == "pruned"
    # The losers checkpoint at their next step boundary and stop: pruned, with the rung in the reason.
    loser = states[3]
    reply = service.report(
        loser["id"],
        {
            "attempt": 1,
            "points": [],
            "checkpoint": {"step": 11, "uri": service.checkpoint_uri(loser["id"], "checkpoint_00000011")},
        },
    ).json()
    assert reply["stop"] is True
    for job_id in (states[2]["id"], loser["id"]):
        service.backend.statuses[submissions[job_id]] = RayJobStatus.SUCCEEDED
    service.tick()
    pruned = service.job(loser["id"])
    assert pruned["state"] == "pruned"
    assert "pruned at rung 10 steps: loss 8 is not in the best 1/2 of the 4 trials there" in pruned["message"]
    assert service.http.post(f"/jobs/{states[0]['id']}/resume").status_code == 409  # not pruned
    resumed = service.http.post(f"/jobs/{loser['id']}/resume")
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["state"] == "queued"
    events = service.http.get(f"/jobs/{loser['id']}/events").json()["data"]
    assert "from its checkpoint at step 11" in events[-1]["reason"]


def test_bad_sweeps_are_refused_naming_the_field_and_cancel_stops_every_trial(
    service: Service, spec: dict[str, Any]
) -> None:
    bad = service.http.post("/sweeps", json=sweep_file(spec, space={"lr": {"choice": [1]}}))
    assert bad.status_code == 422 and "space" in bad.json()["message"], bad.text
    missing = {**spec, "dataset": {"uri": spec["dataset"]["uri"] + "-missing"}}
    refused = service.http.post("/sweeps", json=sweep_file(missing))
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["loc"][-3:] == ["base", "dataset", "uri"], refused.text
    assert service.http.get("/sweeps/99").status_code == 404

    sweep = service.http.post("/sweeps", json=sweep_file(spec)).json()
    service.runtime.sweep_runner.tick()
    cancelled = service.http.post(f"/sweeps/{sweep['id']}/cancel").json()
    assert cancelled["state"] == "cancelled"
    assert {t["state"] for t in cancelled["trials"]} == {"cancelled"}
    service.runtime.sweep_runner.tick()
    assert len(trials(service, sweep["id"])) == 2  # no new trial after the cancel
    assert service.http.post(f"/sweeps/{sweep['id']}/cancel").status_code == 409
