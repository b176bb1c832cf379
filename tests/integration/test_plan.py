"""POST /plan, the SDK's plan() and `apiary plan --job` over real HTTP (SQLite and PostgreSQL, a fake
cluster), and what checkpoint: {auto: true} is launched with."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from typer.testing import CliRunner

from api.cli import app
from api.client import ApiaryClient
from service.store.models import Job, utcnow
from tests.integration.conftest import Service

# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "plan-test",
    "num_workers": 2,
    "max_steps": 1000,
    "checkpoint": {"every_steps": 100},
}


def _set(service: Service, job_id: int, **values: Any) -> None:
    assert service.runtime.db is not None
    with service.runtime.db.session() as session:
        job = session.get(Job, job_id)
        assert job is not None
        for name, value in values.items():
            setattr(job, name, value)


def test_plan_from_facts(service: Service) -> None:
    facts = {"params": 7e9, "workers": 8, "step_time_s": 1.0, "link_bytes_per_s": 5e10, "ckpt_write_s": 42.0}
    response = service.http.post("/plan", json={"facts": {**facts, "mtbf_s": 86_400}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["plan"]["comm_time_s"] == pytest.approx(0.98)  # 7e9 x 4 x 1.75 / 5e10
    assert body["plan"]["daly_interval_s"] == pytest.approx(2666.066, rel=1e-6)
    assert body["plan"]["comm_bound"] is False and body["plan"]["ckpt_bytes"] == pytest.approx(8.4e10)
    rows = {row["name"]: row for row in body["rows"]}
    assert rows["samples_per_s"]["value"] is None and rows["samples_per_s"]["needs"] == ["batch_per_worker"]
    assert body["sources"]["mtbf_s"] == "request" and body["sources"]["nodes"] == "cluster"
    assert body["facts"]["nodes"] == 1


def test_plan_of_a_job_uses_its_spec_its_step_time_and_the_observed_failures(
    service: Service, spec: dict[str, Any]
) -> None:
    job = service.submit(spec)
    no_failures = service.http.post("/plan", json={"job_id": job["id"]}).json()
    assert no_failures["sources"]["mtbf_s"].startswith("cluster (default 24 h: no failure observed")
    _set(service, job["id"], seconds_per_step=0.25, failures=2, started_at=utcnow() - timedelta(hours=10))
    body = ApiaryClient(str(service.http.base_url)).plan(job_id=job["id"], facts={"restart_s": 30})
    assert body["plan"]["global_batch"] == 16  # the spec's 2 workers x 8
    assert body["plan"]["samples_per_s"] == pytest.approx(64.0)  # 16 / 0.25 s measured
    assert body["plan"]["ckpt_interval_s"] == pytest.approx(25.0)  # 100 steps x 0.25 s
    assert body["plan"]["run_s"] == pytest.approx(250.0)  # 1,000 steps x 0.25 s
    # 2 failures in 10 job-hours: an MTBF of 5 h = 18,000 s
    assert body["facts"]["mtbf_s"] == pytest.approx(18_000, rel=1e-3)
    assert body["sources"]["mtbf_s"] == "cluster (observed: 2 failure(s) in 10.0 job-hours)"
    assert body["sources"]["step_time_s"] == f"job {job['id']} measured"
    assert body["sources"]["workers"] == f"job {job['id']} spec"

    # The CLI asks the server with --job, and prints the same flat object.
    result = CliRunner().invoke(
        app, ["plan", "--job", str(job["id"]), "--url", str(service.http.base_url), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["samples_per_s"] == pytest.approx(64.0)


def test_bad_requests(service: Service) -> None:
    response = service.http.post("/plan", json={"facts": {"workers": 0}})
    assert response.status_code == 422 and "facts.workers" in response.json()["message"]
    response = service.http.post("/plan", json={"job_id": 999})
    assert response.status_code == 404 and "999" in response.json()["message"]
    result = CliRunner().invoke(app, ["plan", "--job", "999", "--url", str(service.http.base_url)])
    assert result.exit_code == 2 and "job 999 does not exist" in result.output


def test_checkpoint_auto_launches_with_the_observed_mtbf(service: Service, spec: dict[str, Any]) -> None:
    job = service.submit({**spec, "checkpoint": {"auto": True}})
    service.tick()
    (_, launch), *_ = service.backend.submitted
    assert launch.spec.checkpoint.auto
    assert (
        launch.mtbf_s == 86_400
        and launch.mtbf_basis is not None
        and "no failure observed" in launch.mtbf_basis
    )
    reasons = [event["reason"] for event in service.http.get(f"/jobs/{job['id']}/events").json()["data"]]
    assert any(reason.startswith("checkpoint auto: MTBF 24.0 h") for reason in reasons)
    # Without auto, no MTBF travels.
    service.submit(spec)
    service.tick()
    assert service.backend.submitted[-1][1].mtbf_s is None
