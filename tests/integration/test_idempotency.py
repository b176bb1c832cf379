"""Idempotent submission (`POST /jobs` with `Idempotency-Key`) over real HTTP, on SQLite and PostgreSQL:
a repeat gets the first job (200), another spec under the same key gets 409, keys are per user and
expire after a day, and requests racing with one key create one job."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from service.jobs import JobService
from service.store.models import IdempotencyKey, Job, utcnow
from tests.integration.conftest import Service

# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "once",
}


def post(
    service: Service, spec: dict[str, Any], key: str | None, *, http: httpx.Client | None = None
) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return (http or service.http).post("/jobs", json=spec, headers=headers)


def rows(service: Service) -> tuple[int, int]:
    """(jobs, idempotency keys) in the database."""
    assert service.runtime.db is not None
    with service.runtime.db.session() as session:
        jobs = session.scalar(select(func.count()).select_from(Job)) or 0
        keys = session.scalar(select(func.count()).select_from(IdempotencyKey)) or 0
    return jobs, keys


def age_keys(service: Service, *, hours: float) -> None:
    assert service.runtime.db is not None
    with service.runtime.db.session() as session:
        session.execute(update(IdempotencyKey).values(created_at=utcnow() - timedelta(hours=hours)))


def test_a_repeated_key_gets_the_first_job_and_creates_nothing(
    service: Service, spec: dict[str, Any]
) -> None:
    first = post(service, spec, "k-1")
    assert first.status_code == 201, first.text
    assert "Idempotent-Replayed" not in first.headers
    # The same spec written otherwise (keys reordered, a default spelled out) is the same request.
    again = post(service, {"priority": 0, **dict(reversed(spec.items()))}, "k-1")
    assert again.status_code == 200, again.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert rows(service) == (1, 1)
    # Without a key, every request is a new job.
    assert post(service, spec, None).status_code == 201
    assert post(service, spec, "k-2").json()["id"] not in (first.json()["id"],)
    assert rows(service) == (3, 2)


def test_the_same_key_with_another_spec_is_refused_with_409(service: Service, spec: dict[str, Any]) -> None:
    job_id = post(service, spec, "k").json()["id"]
    refused = post(service, {**spec, "max_steps": 30}, "k")
    assert refused.status_code == 409, refused.text
    body = refused.json()
    assert body["error"] == "IdempotencyKeyReused"
    assert f"(job {job_id})" in body["message"] and "use a new key" in body["message"]
    assert rows(service) == (1, 1)


def test_keys_belong_to_their_user(service: Service, spec: dict[str, Any]) -> None:
    as_ada, as_bob = (service.as_user(service.token(name)) for name in ("ada", "bob"))
    ada = post(service, spec, "shared", http=as_ada).json()
    bob = post(service, spec, "shared", http=as_bob).json()
    assert ada["id"] != bob["id"] and (ada["owner"], bob["owner"]) == ("ada", "bob")
    assert post(service, spec, "shared", http=as_bob).json()["id"] == bob["id"]
    assert rows(service) == (2, 2)


def test_a_key_older_than_a_day_no_longer_matches_and_is_pruned(
    service: Service, spec: dict[str, Any]
) -> None:
    old = post(service, spec, "day").json()
    age_keys(service, hours=24.5)
    # Expired: the same key creates a new job (even with another spec), replacing the old row.
    new = post(service, {**spec, "max_steps": 30}, "day")
    assert new.status_code == 201, new.text
    assert new.json()["id"] != old["id"]
    assert post(service, {**spec, "max_steps": 30}, "day").json()["id"] == new.json()["id"]
    assert rows(service) == (2, 1)

    post(service, spec, "fresh")
    age_keys(service, hours=23)  # both live still
    service.tick()
    assert rows(service) == (3, 2)
    age_keys(service, hours=25)
    service.runtime.scheduler._keys_pruned_at = None  # the leader prunes every few minutes
    service.tick()
    assert rows(service) == (3, 0)


@pytest.mark.parametrize("key", ["", "x" * 256])
def test_a_bad_key_is_a_422_naming_the_header(service: Service, spec: dict[str, Any], key: str) -> None:
    response = post(service, spec, key)
    assert response.status_code == 422, response.text
    assert "idempotency-key" in response.json()["message"]
    assert rows(service) == (0, 0)


def test_concurrent_submissions_with_one_key_create_one_job(
    service: Service, spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request passes the first lookup (the key is not stored yet) before any inserts, so all but
    one of them hit the key's primary key and answer with the winner's job."""
    racers = 6
    barrier = threading.Barrier(racers, timeout=30)
    jobs = service.runtime.jobs
    check_fits = JobService._check_fits

    def check_then_wait(spec: Any) -> None:
        check_fits(jobs, spec)
        barrier.wait()

    monkeypatch.setattr(jobs, "_check_fits", check_then_wait)
    caplog.set_level(logging.INFO, logger="service.jobs")
    with ThreadPoolExecutor(racers) as pool:
        responses = list(pool.map(lambda _: post(service, spec, "race"), range(racers)))
    # The losers went through the database's refusal of their key, not the first lookup.
    assert [r.message for r in caplog.records].count(
        "a concurrent submission with the same idempotency key won; answering with its job"
    ) == (racers - 1)
    statuses = sorted(response.status_code for response in responses)
    assert statuses == [200] * (racers - 1) + [201], [r.text for r in responses]
    assert len({response.json()["id"] for response in responses}) == 1
    assert rows(service) == (1, 1)


def test_concurrent_submissions_with_one_key_and_different_specs_create_one_job(
    service: Service, spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    racers = 4
    barrier = threading.Barrier(racers, timeout=30)
    jobs = service.runtime.jobs
    check_fits = JobService._check_fits

    def check_then_wait(spec: Any) -> None:
        check_fits(jobs, spec)
        barrier.wait()

    monkeypatch.setattr(jobs, "_check_fits", check_then_wait)
    specs = [{**spec, "max_steps": 20 + i % 2} for i in range(racers)]
    with ThreadPoolExecutor(racers) as pool:
        responses = list(pool.map(lambda s: post(service, s, "mixed"), specs))
    winner = next(r for r in responses if r.status_code == 201)
    steps = winner.json()["spec"]["max_steps"]
    for sent, response in zip(specs, responses, strict=True):
        if response is winner:
            continue
        if sent["max_steps"] == steps:
            assert response.status_code == 200 and response.json()["id"] == winner.json()["id"]
        else:
            assert response.status_code == 409, response.text
    assert rows(service) == (1, 1)
