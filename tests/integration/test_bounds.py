"""Every bound on what a request may carry (issue 13, point 6), on SQLite and PostgreSQL: a value out of
range is a 4xx naming its field, never a 500; a value in range, however large, is stored and read back
(ids, steps and counters are 64-bit in the database)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from sqlalchemy import text

from api.limits import MAX_BODY_BYTES
from service.contract.spec import MAX_CONFIG_BYTES, MAX_INT
from tests.integration.conftest import Service
from tests.integration.test_recovery import post
from tests.integration.test_scheduler import run_to_running

# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "mlp-test",
}


def refused(response: httpx.Response, field: str) -> None:
    assert response.status_code == 422, response.text
    assert any(field in ".".join(map(str, item["loc"])) for item in response.json()["detail"]), response.text


def test_oversized_bodies_are_413_before_anything_reads_them(service: Service, spec: dict[str, Any]) -> None:
    padded = {**spec, "config": {**spec["config"], "pad": "x" * MAX_BODY_BYTES}}
    response = service.http.post("/jobs", json=padded)
    assert response.status_code == 413 and response.json()["error"] == "PayloadTooLarge"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
        yield json.dumps(spec)[:-1].encode() + b', "pad": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'

    response = service.http.post("/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert service.count() == 0
    # A trainer's telemetry may be larger (up to 8 MiB): this one, with its report token, is read, and
    # refused for its content; without the token it is refused before it is read (api.gate).
    job = service.submit(spec)
    service.tick()
    big = b'{"attempt": 1, "pad": "' + b"x" * (2 * MAX_BODY_BYTES) + b'"}'
    headers = {"Content-Type": "application/json", **service.backend.report_headers(job["id"])}
    response = service.http.post(f"/internal/jobs/{job['id']}/telemetry", content=big, headers=headers)
    assert response.status_code == 422
    response = service.http.post(
        f"/internal/jobs/{job['id']}/telemetry", content=big, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 401


def test_a_spec_out_of_bounds_is_refused_naming_the_field(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(priority_min=-10, priority_max=10)
    refused(service.http.post("/jobs", json={**spec, "priority": 11}), "priority")
    assert "between -10 and 10" in service.http.post("/jobs", json={**spec, "priority": 11}).text
    refused(service.http.post("/jobs", json={**spec, "priority": 2**31}), "priority")
    refused(service.http.post("/jobs", json={**spec, "max_steps": 2**53}), "max_steps")
    refused(service.http.post("/jobs", json={**spec, "max_steps": True}), "max_steps")
    refused(service.http.post("/jobs", json={**spec, "max_steps": "20"}), "max_steps")
    refused(service.http.post("/jobs", json={**spec, "checkpoint": {"every_steps": False}}), "every_steps")
    refused(service.http.post("/jobs", json={**spec, "name": "trailing-newline\n"}), "name")
    refused(service.http.post("/jobs", json={**spec, "trainer": "x" * 300 + ":f"}), "trainer")
    refused(service.http.post("/jobs", json={**spec, "resources_per_worker": {"CPU": True}}), "CPU")
    big_config = {"task": "classification", "num_classes": 3, "pad": "x" * MAX_CONFIG_BYTES}
    refused(service.http.post("/jobs", json={**spec, "config": big_config}), "config")
    # Python's json writes NaN and Infinity, which a JSON parser may take: they are not numbers to store.
    nan_body = json.dumps({**spec, "max_runtime_s": float("nan")})
    assert "NaN" in nan_body
    response = service.http.post("/jobs", content=nan_body, headers={"Content-Type": "application/json"})
    refused(response, "max_runtime_s")
    nan_config = json.dumps(
        {**spec, "trainer": "tests.support.custom_trainer:train", "config": {"x": float("inf")}}
    )
    response = service.http.post("/jobs", content=nan_config, headers={"Content-Type": "application/json"})
    refused(response, "config")
    assert service.count() == 0
    # A whole number written as a float is that number (JSON has one number type).
    assert service.submit({**spec, "max_steps": 20.0, "priority": 10})["spec"]["max_steps"] == 20


def test_integers_in_paths_and_queries_are_bounded(service: Service, spec: dict[str, Any]) -> None:
    job = service.submit(spec)
    for path in (f"/jobs/{2**63}", f"/jobs/{2**53}/events", f"/jobs/{2**31}/metrics", "/jobs/0"):
        response = service.http.get(path)
        assert response.status_code in (404, 422), (path, response.text)
        if response.status_code == 422:
            refused(response, "job_id")
    assert service.http.get(f"/jobs/{2**31}").status_code == 404  # in range: just not there
    assert service.http.post(f"/jobs/{2**63}/cancel").status_code == 422
    refused(service.http.get("/jobs", params={"offset": 2**63}), "offset")
    assert service.http.get("/jobs", params={"offset": 2**40}).json() == {"data": [], "count": 1}
    for name in ("rank", "min_step", "max_step"):
        refused(service.http.get(f"/jobs/{job['id']}/metrics", params={name: 2**53}), name)
        assert service.http.get(f"/jobs/{job['id']}/metrics", params={name: 2**31}).status_code == 200


def test_reports_are_bounded_and_64_bit_steps_are_stored(service: Service, spec: dict[str, Any]) -> None:
    job = service.submit(spec)
    run_to_running(service, [job["id"]])
    url = f"/internal/jobs/{job['id']}/telemetry"
    trainer = service.as_user(None)  # with the attempt's report token: the body is read, then checked
    trainer.headers.update(service.backend.report_headers(job["id"]))
    point = {"step": 2**40, "rank": 0, "time": time.time(), "values": {"loss": 0.5}}
    refused(trainer.post(url, json={"attempt": 1, "checkpoint": {"step": False, "uri": "/c"}}), "step")
    refused(trainer.post(url, json={"attempt": 2**53, "points": [point]}), "attempt")
    refused(trainer.post(url, json={"attempt": 1, "points": [{**point, "rank": 2**53}]}), "rank")
    refused(trainer.post(url, json={"attempt": 1, "points": [point] * 1001}), "points")
    nan = json.dumps({"attempt": 1, "points": [{**point, "values": {"loss": float("nan")}}]})
    refused(trainer.post(url, content=nan, headers={"Content-Type": "application/json"}), "loss")
    assert post(service, job["id"], {"attempt": 1, "points": [point]})["stored"] == 1
    stored = service.http.get(f"/jobs/{job['id']}/metrics", params={"min_step": 2**40}).json()["data"]
    assert [(p["step"], p["values"]) for p in stored] == [(2**40, {"loss": 0.5})]
    assert service.job(job["id"])["latest_step"] == 2**40


def test_job_ids_pass_2_to_the_31(service: Service, spec: dict[str, Any], database_url: str) -> None:
    db = service.runtime.db
    assert db is not None
    with db.session() as session:
        if database_url.startswith("postgresql"):  # an int4 sequence stops at 2**31 - 1
            session.execute(text("SELECT setval('jobs_id_seq', :at)"), {"at": 2**31 + 5})
        else:
            session.execute(
                text(
                    "INSERT INTO jobs (id, name, queue, priority, owner, state, spec, attempt, created_at, "
                    "updated_at) VALUES (:id, 'seed', 'research', 0, 'ada', 'cancelled', '{}', 0, "
                    "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                ),
                {"id": 2**31 + 5},
            )
    job = service.submit(spec)
    assert job["id"] == 2**31 + 6 and job["id"] <= MAX_INT
    assert service.job(job["id"])["name"] == "mlp-test"
    events = service.http.get(f"/jobs/{job['id']}/events").json()["data"]
    assert [event["to_state"] for event in events] == ["queued"]
