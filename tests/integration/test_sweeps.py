"""Sweeps over real HTTP on SQLite and PostgreSQL, with a fake cluster (Ray is not under test): trials
are ordinary jobs, grid covers exactly its points, ASHA prunes the losers (a trial ahead of the
others too, at the rung where they can be compared; a pruned trial can be resumed), a restarted
runner (or a second leader) neither loses nor repeats a trial, and the best is reported."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

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
    for t in started:  # trials 2 and 3 diverge; 3 runs ahead, to a rung where it is alone
        report(service, t["job"], {5: 2.0, 10: 1.0 if t["trial"] < 2 else 5.0 + t["trial"]})
    report(service, started[3]["job"], {20: 9.0})
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
    # Trial 2 reached its max_steps before the stop reached it: it succeeded, and says nothing of a prune.
    finished_first = states[2]["id"]
    last = {"step": 40, "uri": service.checkpoint_uri(finished_first, "checkpoint_00000040")}
    assert service.report(finished_first, {"attempt": 1, "points": [], "checkpoint": last}).status_code == 202
    for job_id in (finished_first, loser["id"]):
        service.backend.statuses[submissions[job_id]] = RayJobStatus.SUCCEEDED
    service.tick()
    assert (service.job(finished_first)["state"], service.job(finished_first)["message"]) == (
        "succeeded",
        None,
    )
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


def test_the_cli_starts_shows_and_exports_a_sweep(
    service: Service, spec: dict[str, Any], tmp_path: Any
) -> None:
    import json

    import yaml
    from typer.testing import CliRunner

    from api.cli import app

    env = {
        "APIARY_URL": str(service.http.base_url),
        "APIARY_CONFIG": str(tmp_path / "none.toml"),
        "COLUMNS": "200",
    }
    cli = CliRunner()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep_file(spec, max_trials=0), sort_keys=False))
    refused = cli.invoke(app, ["sweep", str(bad)], env=env)
    assert refused.exit_code == 2 and "max_trials" in refused.output, refused.output

    good = tmp_path / "sweep.yaml"
    good.write_text(yaml.safe_dump(sweep_file(spec), sort_keys=False))
    started = cli.invoke(app, ["sweep", str(good), "--json"], env=env)
    assert started.exit_code == 0, started.output
    sweep_id = json.loads(started.stdout)["id"]
    service.runtime.sweep_runner.tick()
    shown = cli.invoke(app, ["sweep", "show", str(sweep_id)], env=env)
    assert shown.exit_code == 0 and "lr-search" in shown.output and '"config.lr": 0.1' in shown.output
    assert (
        json.loads(cli.invoke(app, ["sweep", "show", str(sweep_id), "--json"], env=env).stdout)["state"]
        == "running"
    )
    assert str(sweep_id) in cli.invoke(app, ["sweeps"], env=env).output

    trial = trials(service, sweep_id)[0]
    submission_id = run(service, trial["job"])
    report(service, trial["job"], {40: 0.3})
    service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
    service.tick()
    best = cli.invoke(app, ["sweep", "best", str(sweep_id), "--full-scale"], env=env)
    assert best.exit_code == 0, best.output
    exported = yaml.safe_load(best.stdout)
    assert (exported["queue"], exported["config"]["lr"]) == ("full-scale", trial["params"]["config.lr"])
    assert cli.invoke(app, ["sweep", "cancel", str(sweep_id)], env=env).exit_code == 0
    assert cli.invoke(app, ["resume", str(trial["job"])], env=env).exit_code == 1  # succeeded, not pruned


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_sweep_page_shows_trials_objective_per_parameter_and_curves_and_cancels(
    service: Service, spec: dict[str, Any]
) -> None:
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does)")
    expect = playwright_api.expect
    sweep = service.http.post("/sweeps", json=sweep_file(spec, parallel=3)).json()
    service.runtime.sweep_runner.tick()
    started = trials(service, sweep["id"])
    for trial in started[:2]:
        submission_id = run(service, trial["job"])
        report(service, trial["job"], {10: 2.0, 20: 1.0 + trial["trial"], 40: 0.5 + trial["trial"]})
        service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
        service.tick()
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        page.goto(f"{service.http.base_url}/sweeps/{sweep['id']}")
        expect(page.locator("#trials tbody tr")).to_have_count(3)
        expect(page.locator(f"#trials tr[data-job='{started[0]['job']}']")).to_have_class("best")
        expect(page.locator("canvas.scatter[data-param='config.lr']")).to_have_attribute("data-points", "2")
        expect(page.locator("#trials-chart")).to_have_attribute("data-series", "2", timeout=15_000)
        page.locator("#cancel-sweep").click()
        expect(page.locator("#sweep-state")).to_have_text("cancelled", timeout=15_000)
        browser.close()
    assert service.http.get(f"/sweeps/{sweep['id']}").json()["state"] == "cancelled"
