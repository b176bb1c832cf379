"""`spot: allowed | never | preferred` over real HTTP (issue 31, point 2): the queue's default written into
the stored spec, a bad value refused with 422 naming the field, and a `never` job that only spot nodes
could hold refused as one that can never run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
