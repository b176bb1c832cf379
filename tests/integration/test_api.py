"""The REST API over real HTTP, on SQLite and PostgreSQL, with a fake cluster (Ray is not under test here;
tests/e2e runs the real thing). The scheduler does not loop: each test calls `tick()` when it wants one."""

from __future__ import annotations

from typing import Any

import pytest

from service.cluster import RayJobStatus
from service.contract.protocol import error_line
from tests.integration.conftest import Service

# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "mlp-test",
    "num_workers": 2,
    "checkpoint": {"every_steps": 10},
}


def test_a_job_goes_from_queued_to_succeeded_with_its_whole_history(
    service: Service, spec: dict[str, Any]
) -> None:
    job = service.submit(spec)
    assert (job["state"], job["owner"], job["attempt"]) == ("queued", "ada", 0)
    assert job["spec"]["config"]["hidden_sizes"] == [64, 64]

    service.tick()
    job = service.job(job["id"])
    assert job["state"] == "admitted"
    submission_id, launch = service.backend.submitted[0]
    assert job["ray_submission_id"] == submission_id
    assert launch.job_id == job["id"] and launch.attempt == 1 and launch.run_name == f"job-{job['id']}"
    assert launch.telemetry_url == f"{service.http.base_url}/internal/jobs/{job['id']}/telemetry"
    assert launch.spec.model_dump(mode="json") == job["spec"]

    service.backend.statuses[submission_id] = RayJobStatus.RUNNING
    service.tick()
    assert service.job(job["id"])["state"] == "running"

    service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
    service.tick()
    job = service.job(job["id"])
    assert job["state"] == "succeeded" and job["finished_at"] is not None
    events = service.http.get(f"/jobs/{job['id']}/events").json()["data"]
    assert [e["to_state"] for e in events] == ["queued", "admitted", "running", "succeeded"]
    assert all(e["reason"] for e in events)


def test_the_gang_waits_until_it_fits_and_says_why(service: Service, spec: dict[str, Any]) -> None:
    first = service.submit({**spec, "num_workers": 5})  # 5 + 1 data CPU of 8
    second = service.submit({**spec, "num_workers": 3})
    service.tick()
    assert service.job(first["id"])["state"] == "admitted"
    waiting = service.job(second["id"])
    assert waiting["state"] == "queued"
    assert "needs 3 worker(s) x 1 CPU + 1 CPU; free now 2 CPU; reserved from" in waiting["waiting_reason"]
    assert waiting["queue_position"] == 1 and waiting["eta_at"] is not None

    service.backend.statuses[service.backend.submission_of(first["id"])] = RayJobStatus.SUCCEEDED
    service.tick()  # reconcile frees the gang, then admit takes the next one
    assert service.job(second["id"])["state"] == "admitted"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"bogus": 1}, "bogus", "Extra inputs"),
        ({"num_workers": 0}, "num_workers", "greater than or equal to 1"),
        ({"trainer": "no_such_module_xyz:train"}, "trainer", "is not allowed here"),
        ({"dataset": {"uri": "file:///no/such/dataset"}}, "dataset.uri", "does not exist"),
        ({"eval": {"dataset": {"uri": "file:///no/such/dataset"}}}, "eval.dataset.uri", "does not exist"),
        ({"checkpoint": {"keep_best": {"metric": "eval_loss", "mode": "min"}}}, "eval", "an eval metric"),
        ({"num_workers": 64, "queue": "full-scale"}, "num_workers", "the cluster has 1 node(s) with 8 CPU"),
        ({"num_workers": 9}, "num_workers", "queue research takes jobs of at most 8 workers"),
        (
            {"max_runtime_s": 86_400},
            "max_runtime_s",
            "queue research takes jobs of at most max_runtime_s 14400",
        ),
        ({"priority": 1000}, "priority", "less than or equal to 100"),
        ({"priority": 2**40}, "priority", "less than or equal to 100"),
        ({"resources_per_worker": {"GPU": 1}}, "num_workers", "use fewer workers"),
        ({"config": {"task": "classification"}}, "config", "num_classes"),
        ({"on_anomaly": "ignore"}, "on_anomaly", "'stop', 'rollback' or 'warn'"),
        ({"on_plateau": "stop"}, "on_plateau", "'stop' needs plateau"),
        ({"profile": {"start_step": 2, "steps": 500}}, "profile.steps", "less than or equal to 50"),
        ({"profile": {"start_step": 1000}}, "profile", "end past max_steps"),
    ],
)
def test_bad_specs_are_refused_with_422_naming_the_field_and_nothing_is_written(
    service: Service, spec: dict[str, Any], change: dict[str, Any], field: str, words: str
) -> None:
    response = service.http.post("/jobs", json={**spec, **change})
    assert response.status_code == 422
    body = response.json()
    assert words in body["message"]
    assert any(".".join(map(str, d["loc"][1:])) == field for d in body["detail"]), body
    assert service.count() == 0


def test_a_body_that_is_not_json_is_a_422_not_a_500(service: Service) -> None:
    response = service.http.post("/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert service.count() == 0


def test_cancel_a_queued_and_a_running_job(service: Service, spec: dict[str, Any]) -> None:
    queued = service.submit({**spec, "num_workers": 7})  # never fits beside the other
    running = service.submit(spec)
    assert service.http.post(f"/jobs/{queued['id']}/cancel").json()["state"] == "cancelled"
    service.tick()
    submission_id = service.backend.submission_of(running["id"])
    service.backend.statuses[submission_id] = RayJobStatus.RUNNING
    service.tick()
    response = service.http.post(f"/jobs/{running['id']}/cancel")
    assert response.json()["state"] == "cancelled"
    assert service.backend.stopped == [submission_id]
    service.tick()  # Ray now says STOPPED: the job stays cancelled
    assert service.job(running["id"])["state"] == "cancelled"
    again = service.http.post(f"/jobs/{running['id']}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["message"]


def test_a_failed_ray_job_carries_the_trainers_reason(service: Service, spec: dict[str, Any]) -> None:
    job = service.submit(spec)
    service.tick()
    submission_id = service.backend.submission_of(job["id"])
    service.backend.statuses[submission_id] = RayJobStatus.FAILED
    service.backend.logs[submission_id] = (
        "Traceback ...\nValueError: x\n" + error_line("dataset has no column 'label'") + "\n"
    )
    service.tick()
    job = service.job(job["id"])
    assert job["state"] == "failed"
    assert job["message"] == "dataset has no column 'label'"


def test_a_submission_ray_never_received_is_requeued(service: Service, spec: dict[str, Any]) -> None:
    job = service.submit(spec)
    service.tick()
    submission_id = service.backend.submission_of(job["id"])
    del service.backend.statuses[submission_id]  # as if the service died before Ray got it
    service.tick()  # reconcile requeues, admit submits attempt 2
    job = service.job(job["id"])
    assert (job["state"], job["attempt"]) == ("admitted", 2)
    assert job["ray_submission_id"] != submission_id


def test_trainer_telemetry_stores_metrics_and_the_latest_checkpoint(
    service: Service, spec: dict[str, Any]
) -> None:
    job = service.submit(spec)
    service.tick()  # admitted: its attempt 1 has a report token
    points = [
        {"step": step, "rank": rank, "time": 1.0 + step, "values": {"loss": 2.0 - step / 10}}
        for step in range(5)
        for rank in (0, 1)
    ]
    checkpoint = service.checkpoint_uri(job["id"], "checkpoint_00000004")
    body = {"attempt": 1, "points": points, "checkpoint": {"step": 4, "uri": checkpoint}}
    assert service.report(job["id"], body).status_code == 202
    assert service.report(job["id"], body).status_code == 202  # a re-post after a lost answer
    metrics = service.http.get(f"/jobs/{job['id']}/metrics").json()
    assert metrics["count"] == 10
    filtered = service.http.get(
        f"/jobs/{job['id']}/metrics", params={"rank": 1, "min_step": 2, "max_step": 3}
    )
    assert [(p["step"], p["rank"]) for p in filtered.json()["data"]] == [(2, 1), (3, 1)]
    job = service.job(job["id"])
    assert (job["latest_checkpoint"], job["latest_checkpoint_step"]) == (checkpoint, 4)


def test_listing_filters_by_state_and_queue(service: Service, spec: dict[str, Any]) -> None:
    a = service.submit(spec)
    service.submit({**spec, "queue": "full-scale"})
    service.http.post(f"/jobs/{a['id']}/cancel")
    listed = service.http.get("/jobs", params={"state": ["queued"], "queue": "full-scale"}).json()
    assert listed["count"] == 1 and listed["data"][0]["queue"] == "full-scale"
    assert service.http.get("/jobs", params={"state": "cancelled"}).json()["count"] == 1
    assert service.http.get("/jobs", params={"state": "sleeping"}).status_code == 422


def test_unknown_job_is_404_and_health_is_ok(service: Service) -> None:
    response = service.http.get("/jobs/12345")
    assert response.status_code == 404 and response.json()["message"] == "job 12345 does not exist"
    assert service.http.get("/readyz").json() == {"status": "ok", "database": "ok", "ray": "ok"}
    service.backend.available = False
    not_ready = service.http.get("/readyz")
    assert not_ready.status_code == 503 and not_ready.headers["Retry-After"]
    assert not_ready.json()["status"] == "degraded" and not_ready.json()["ray"].startswith("unavailable")
    # Liveness checks nothing but the process: an orchestrator must not restart it for Ray's sake.
    alive = service.http.get("/healthz")
    assert alive.status_code == 200 and alive.json() == {"status": "ok"}


def test_openapi_is_served(service: Service) -> None:
    paths = service.http.get("/openapi.json").json()["paths"]
    assert {
        "/jobs",
        "/jobs/{job_id}",
        "/jobs/{job_id}/cancel",
        "/jobs/{job_id}/events",
        "/jobs/{job_id}/metrics",
    } <= set(paths)
    assert service.http.get("/docs").status_code == 200


def test_an_elastic_job_is_admitted_on_its_min_and_holds_what_it_may_grow_into(
    service: Service, spec: dict[str, Any]
) -> None:
    spec = {**spec, "queue": "full-scale"}
    refused = service.http.post("/jobs", json={**spec, "num_workers": {"min": 9, "max": 12}})
    assert refused.status_code == 422 and "the cluster has 1 node(s) with 8 CPU" in refused.text
    elastic = service.submit({**spec, "num_workers": {"min": 2, "max": 12}})  # 2 + 1 data CPU of 8 fit
    assert service.job(elastic["id"])["spec"]["num_workers"] == {"min": 2, "max": 12}
    service.tick()
    assert service.job(elastic["id"])["state"] == "admitted"
    events = service.http.get(f"/jobs/{elastic['id']}/events").json()["data"]
    assert "gang of 2 worker(s) fits" in events[-1]["reason"]

    # Ray Train may grow the elastic job into every free CPU, so nothing is promised to the next job.
    small = service.submit({**spec, "num_workers": 1})
    service.tick()
    waiting = service.job(small["id"])
    assert waiting["state"] == "queued"
    assert "free now nothing" in waiting["waiting_reason"]
