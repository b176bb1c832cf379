"""`spot: allowed | never | preferred` over real HTTP (issue 31, point 2): the queue's default written into
the stored spec, a bad value refused with 422 naming the field, and a `never` job that only spot nodes
could hold refused as one that can never run."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from api.cli import app
from tests.integration.conftest import Service


def test_the_stored_spec_says_the_queues_default_and_a_stated_value_stays(
    service: Service, spec: dict[str, Any]
) -> None:
    research = service.http.post("/jobs", json=spec).json()
    full_scale = service.http.post("/jobs", json={**spec, "queue": "full-scale"}).json()
    preferred = service.http.post("/jobs", json={**spec, "queue": "full-scale", "spot": "preferred"}).json()
    jobs = (research, full_scale, preferred)
    spots = [service.http.get(f"/jobs/{job['id']}").json()["spec"]["spot"] for job in jobs]
    assert spots == ["allowed", "never", "preferred"]


def test_a_bad_value_is_a_422_naming_the_field(service: Service, spec: dict[str, Any]) -> None:
    response = service.http.post("/jobs", json={**spec, "spot": "sometimes"})
    assert response.status_code == 422
    assert "'allowed', 'never' or 'preferred'" in response.json()["message"]
    assert any(detail["loc"][1:] == ["spot"] for detail in response.json()["detail"])
    assert service.count() == 0


def test_a_never_job_that_only_spot_nodes_could_hold_is_refused(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(nodes=[{"CPU": 8.0, "spot": 1.0}, {"CPU": 1.0}], shared_filesystem=True)
    big = {**spec, "num_workers": 2, "resources_per_worker": {"CPU": 2.0}}
    response = service.http.post("/jobs", json={**big, "spot": "never"})
    assert response.status_code == 422
    body = response.json()
    assert "on on-demand nodes (spot: never)" in body["message"]
    assert "of which 1 spot node(s) with 8 CPU, 1 spot" in body["message"]
    assert any(detail["loc"][1:] == ["num_workers"] for detail in body["detail"])
    assert service.http.post("/jobs", json={**big, "spot": "allowed"}).status_code == 201


def test_a_spot_node_that_leaves_is_an_interruption_that_the_counts_and_the_cadence_see(
    start_service: Callable[..., Service], spec: dict[str, Any], tmp_path: Path
) -> None:
    service = start_service(nodes=[{"CPU": 4.0}, {"CPU": 4.0, "spot": 1.0}], shared_filesystem=True)
    service.backend.node_ids = ["od", "spot-1"]
    now = time.time()
    service.tick(now)
    spot = service.http.get("/queues").json()["spot"]
    assert (spot["nodes"], spot["capacity"], spot["interruptions"]) == (1, {"CPU": 4.0, "spot": 1.0}, 0)
    assert spot["interruptions_per_node_h"] == 0.02  # the prior (APIARY_SPOT_PRIOR_...)
    assert spot["basis"] == "prior: no interruption observed in 0.0 spot node-hours"
    page = service.http.get("/", headers={"Accept": "text/html"}).text  # the web view's queue page
    assert "Spot nodes:\n1 with CPU 4, spot 1;\n0 interruption(s) in 0.0 spot node-hours" in page

    service.tick(now + 7200)  # two hours on, still there
    service.backend.nodes, service.backend.node_ids = [{"CPU": 4.0}], ["od"]  # taken back
    service.tick(now + 7201)
    spot = service.http.get("/queues").json()["spot"]
    assert (spot["nodes"], spot["capacity"], spot["interruptions"]) == (0, {}, 1)
    assert spot["interruptions_per_node_h"] == pytest.approx(0.5)
    assert spot["basis"] == "observed: 1 interruption(s) in 2.0 spot node-hours"
    scrape = service.http.get("/metrics").text
    assert "apiary_spot_interruptions_total 1.0" in scrape
    assert "apiary_spot_nodes 0.0" in scrape
    assert 'apiary_spot_capacity{resource="CPU"} 0.0' in scrape
    assert (
        "1 interruption(s) in 2.0 spot node-hours"
        in service.http.get("/", headers={"Accept": "text/html"}).text
    )
    cli_env = {"APIARY_URL": str(service.http.base_url), "APIARY_TOKEN": None, "COLUMNS": "200"}
    shown = CliRunner().invoke(app, ["queue"], env={**cli_env, "APIARY_CONFIG": str(tmp_path / "none.toml")})
    assert shown.exit_code == 0, shown.output
    assert (
        "spot: 0 node(s); 1 interruption(s) in 2.0 node-hours (0.5 per node-hour, observed: 1" in shown.output
    )

    # A new spot node joins; a job that prefers spot is placed there, and its cadence counts it.
    service.backend.nodes = [{"CPU": 4.0}, {"CPU": 4.0, "spot": 1.0}]
    service.backend.node_ids = ["od", "spot-2"]
    job = service.submit({**spec, "spot": "preferred", "checkpoint": {"auto": True}})
    service.tick(now + 7202)
    assert 'apiary_spot_capacity{resource="CPU"} 4.0' in service.http.get("/metrics").text
    reasons = [event["reason"] for event in service.http.get(f"/jobs/{job['id']}/events").json()["data"]]
    assert any(reason.startswith("gang of 1 worker(s) fits (on 1 spot node(s));") for reason in reasons)
    (cadence,) = [reason for reason in reasons if reason.startswith("checkpoint auto:")]
    assert (
        "on 1 spot node(s) at 0.5 interruptions per node-hour (observed: 1 interruption(s) in 2.0" in cadence
    )
    request = service.backend.submitted[-1][1]
    assert request.mtbf_basis is not None and "on 1 spot node(s)" in request.mtbf_basis
    # 24 h of job MTBF (no failure yet) and 2 h per interruption of its node: 1 / (1/24 + 1/2) h.
    assert request.mtbf_s == pytest.approx(3600 / (1 / 24 + 0.5), rel=1e-3)


def test_an_idle_scale_down_is_not_an_interruption_and_a_preemption_is(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(nodes=[{"CPU": 4.0, "spot": 1.0}, {"CPU": 4.0, "spot": 1.0}])
    service.backend.node_ids = ["spot-1", "spot-2"]
    now = time.time()
    service.tick(now)
    service.tick(now + 3600)
    service.backend.nodes, service.backend.node_ids = [], []
    # Ray's words (ray.dashboard.utils.compose_state_message) for a node the autoscaler drained as
    # idle, and for one the cloud took back.
    service.backend.departed = (
        ("spot-1", "Terminated due to idle (no Ray activity): idle for 60 s"),
        ("spot-2", "Terminated due to preemption: spot instance reclaimed"),
    )
    service.tick(now + 3601)
    spot = service.http.get("/queues").json()["spot"]
    assert (spot["nodes"], spot["interruptions"]) == (0, 1)
    assert spot["basis"] == "observed: 1 interruption(s) in 2.0 spot node-hours"
