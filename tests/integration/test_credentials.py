"""An attempt's fetch token (service.contract.handoff): the driver of the job's current attempt redeems it
once for the job's S3 credentials; a second redemption, another attempt's token or a job that ended
is refused, and a replay is recorded on the job. Only the token's hash is stored, and the token is
the only secret-like value of the job's runtime_env."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from sqlalchemy import select

from service.cluster import RayJobStatus
from service.contract.handoff import token_hash
from service.contract.protocol import LAUNCH_ENV_VAR, LaunchPointer
from service.store.models import Job
from tests.integration.conftest import Service

SPEC_FIELDS = {"name": "credentials-test", "max_failures": 2}


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The service's AWS variables (fresh secrets), as `apiary serve` reads them from its environment."""
    env = {
        "AWS_ACCESS_KEY_ID": "apiary-credentials-test",
        "AWS_SECRET_ACCESS_KEY": f"aws-secret-{secrets.token_hex(12)}",
        "AWS_SESSION_TOKEN": f"aws-session-{secrets.token_hex(12)}",
        "AWS_REGION": "eu-west-3",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def service(start_service: Callable[..., Service], aws: dict[str, str]) -> Service:
    # An external cluster: no local Ray to hold the credentials in its own environment.
    return start_service(ray_address="http://ray-head:8265")


def pointer_of(service: Service, submission_id: str) -> LaunchPointer:
    return LaunchPointer.model_validate_json(service.backend.environments[submission_id][LAUNCH_ENV_VAR])


def redeem(
    service: Service, pointer: LaunchPointer, token: str | None, *, attempt: int | None = None
) -> httpx.Response:
    assert pointer.credentials_url is not None
    path = urlparse(pointer.credentials_url).path
    if attempt is not None:
        path = path.replace(f"/attempts/{pointer.attempt}/", f"/attempts/{attempt}/")
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    return service.http.post(path, headers=headers)


def events(service: Service, job_id: int) -> list[str]:
    return [event["reason"] for event in service.http.get(f"/jobs/{job_id}/events").json()["data"]]


def test_the_driver_redeems_its_token_once_for_credentials_that_are_in_no_environment(
    service: Service, spec: dict[str, Any], aws: dict[str, str]
) -> None:
    job_id, submission_id = service.start(spec)
    env = service.backend.environments[submission_id]
    assert not [key for key in env if key.startswith("AWS_")], sorted(env)
    assert aws["AWS_SECRET_ACCESS_KEY"] not in json.dumps(env) and aws["AWS_SESSION_TOKEN"] not in json.dumps(
        env
    )
    pointer = pointer_of(service, submission_id)
    token = pointer.credentials_token
    assert token is not None and token not in repr(pointer)
    with service.runtime.db.session() as session:
        stored = session.scalars(select(Job.credentials_token_hash).where(Job.id == job_id)).one()
    assert stored == token_hash(token)

    refused = {
        "no token": redeem(service, pointer, None),
        "a wrong token": redeem(service, pointer, "apiary_guessed"),
        "the token for another attempt's number": redeem(service, pointer, token, attempt=2),
        "the token for another job": service.http.post(
            f"/internal/jobs/{job_id + 1000}/attempts/1/credentials",
            headers={"authorization": f"Bearer {token}"},
        ),
    }
    assert {what: r.status_code for what, r in refused.items()} == {
        "no token": 401,
        "a wrong token": 401,
        "the token for another attempt's number": 401,
        "the token for another job": 404,
    }

    first = redeem(service, pointer, token)
    assert first.status_code == 200, first.text
    assert first.json() == {
        "access_key": aws["AWS_ACCESS_KEY_ID"],
        "secret_key": aws["AWS_SECRET_ACCESS_KEY"],
        "session_token": aws["AWS_SESSION_TOKEN"],
        "region": aws["AWS_REGION"],
    }
    again = redeem(service, pointer, token)
    assert again.status_code == 403 and again.json()["error"] == "CredentialsRedeemed", again.text
    said = events(service, job_id)
    assert any("credentials handed to attempt 1" in reason for reason in said), said
    assert any("credentials refused" in reason and "redeemed at" in reason for reason in said), said
    assert not any(aws["AWS_SECRET_ACCESS_KEY"] in reason for reason in said)


def test_a_new_attempt_gets_a_new_token_and_the_old_ones_are_dead(
    service: Service, spec: dict[str, Any], aws: dict[str, str]
) -> None:
    job_id, first = service.start(spec)
    old = pointer_of(service, first)
    # The driver dies before it redeemed its token: attempt 2, with a token of its own.
    service.backend.statuses[first] = RayJobStatus.MISSING
    service.tick()
    job = service.job(job_id)
    assert (job["state"], job["attempt"]) == ("recovering", 2)
    new = pointer_of(service, job["ray_submission_id"])
    assert new.attempt == 2 and new.credentials_token not in (None, old.credentials_token)

    superseded = redeem(service, old, old.credentials_token)
    assert superseded.status_code == 403 and "given up" in superseded.json()["message"], superseded.text
    # Attempt 2's number with attempt 1's token: a wrong token.
    assert redeem(service, old, old.credentials_token, attempt=2).status_code == 401
    assert redeem(service, new, new.credentials_token).json()["secret_key"] == aws["AWS_SECRET_ACCESS_KEY"]


def test_a_token_is_dead_once_its_job_ended(service: Service, spec: dict[str, Any]) -> None:
    job_id, submission_id = service.start(spec)
    pointer = pointer_of(service, submission_id)
    service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
    service.tick()
    assert service.job(job_id)["state"] == "succeeded"
    refused = redeem(service, pointer, pointer.credentials_token)
    assert refused.status_code == 403 and "ended (succeeded)" in refused.json()["message"], refused.text
    assert any("credentials refused" in reason and "ended" in reason for reason in events(service, job_id))
