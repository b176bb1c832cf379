"""API tokens and roles (service.auth) over real HTTP, on SQLite and PostgreSQL: every route that needs a
user answers 401 without a valid token; only a job's owner or an admin cancels or preempts it; only an
admin changes a job's queue or priority, jumps the priority ceiling, or handles tokens; the web view's
login cookie; `apiary token` and `apiary serve`'s refusal; and no token ever reaches a log."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event
from typer.testing import CliRunner

from api.app import create_app
from api.cli import app as cli
from service.auth import Auth
from service.cluster import RayJobStatus
from service.settings import Settings
from tests.integration.conftest import Service
from tests.support.sse import SseReader

# No user needed: what monitoring reads (the health check, Prometheus' aggregate metrics) and the
# jobs' own routes (not a user's: telemetry takes the attempt's report token, tests/integration/
# test_report_token.py; credentials its single-use fetch token, tests/integration/test_credentials.py).
PUBLIC = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("POST", "/internal/jobs/{job_id}/telemetry"),
    ("POST", "/internal/jobs/{job_id}/attempts/{attempt}/credentials"),
}


# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "auth-test",
}


class People:
    """Three tokens of one service: ada and bob (users), root (an admin), with an HTTP client each."""

    def __init__(self, service: Service) -> None:
        self.tokens = {name: service.token(name, admin=name == "root") for name in ("ada", "bob", "root")}
        self.ada, self.bob, self.root = (service.as_user(self.tokens[n]) for n in ("ada", "bob", "root"))
        self.nobody = service.as_user(None)
        self.stranger = service.as_user("apiary_" + "x" * 43)  # well-formed, never issued


@pytest.fixture
def people(service: Service) -> People:
    return People(service)


def submit(http: httpx.Client, spec: dict[str, Any], **changes: Any) -> dict[str, Any]:
    response = http.post("/jobs", json={**spec, **changes})
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def run(service: Service, job_id: int) -> None:
    """Admit the (queued) job and let the fake cluster report it running."""
    service.tick()
    service.backend.statuses[service.backend.submission_of(job_id)] = RayJobStatus.RUNNING
    service.tick()
    assert service.runtime.jobs.get_job(job_id).state == "running"


def protected_routes() -> list[tuple[str, str]]:
    """Every (method, path) of the API's schema but the public ones."""
    paths = create_app(Settings()).openapi()["paths"]  # the routes only: the app is never started
    found = {(method.upper(), path) for path, methods in paths.items() for method in methods}
    return sorted(found - PUBLIC)


def test_every_route_but_monitoring_and_telemetry_needs_a_valid_token(
    service: Service, people: People, spec: dict[str, Any]
) -> None:
    job = submit(people.ada, spec)
    routes = protected_routes()
    assert ("POST", "/jobs/{job_id}/cancel") in routes and ("PATCH", "/jobs/{job_id}") in routes
    assert len(routes) >= 18
    for method, path in routes:
        url = path.format(job_id=job["id"], token_id=1, sha256="0" * 64, sweep_id=1, node_id="0" * 56)
        for client in (people.nobody, people.stranger):
            response = client.request(method, url)
            assert response.status_code == 401, (method, path, response.text)
            assert "apiary token create" in response.json()["message"]
    assert people.ada.get(f"/jobs/{job['id']}").status_code == 200  # anyone authenticated reads
    assert people.bob.get("/jobs").json()["count"] == 1
    assert people.bob.get("/queues").status_code == 200
    assert service.http.get("/healthz").status_code == 200
    assert service.http.get("/metrics").status_code == 200
    # Telemetry takes no user token: it asks for its attempt's report token (tests/integration/
    # test_report_token.py), whoever sends it, a user's token included.
    telemetry = {"attempt": 1, "points": []}
    for http in (service.http, people.ada):
        refused = http.post(f"/internal/jobs/{job['id']}/telemetry", json=telemetry)
        assert refused.status_code == 401 and refused.json()["error"] == "ReportRefused", refused.text


def test_the_job_belongs_to_the_tokens_user_whatever_a_header_says(
    service: Service, people: People, spec: dict[str, Any]
) -> None:
    response = people.bob.post("/jobs", json=spec, headers={"X-Apiary-User": "ada"})
    assert response.json()["owner"] == "bob"
    assert people.bob.get("/me").json() == {"user": "bob", "admin": False}
    assert people.root.get("/me").json() == {"user": "root", "admin": True}


def test_a_request_looks_its_token_up_once(service: Service, people: People, spec: dict[str, Any]) -> None:
    # api.gate authenticates a request with a body before reading it; the route takes that user.
    lookups: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "FROM api_tokens" in statement:
            lookups.append(statement)

    assert service.runtime.db is not None
    engine = service.runtime.db.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        assert submit(people.bob, spec)["owner"] == "bob"
        assert len(lookups) == 1, lookups
        assert people.bob.get("/me").json()["user"] == "bob"  # no body: the route looks it up
        assert len(lookups) == 2, lookups
    finally:
        event.remove(engine, "before_cursor_execute", count)
    # Still every request: a revoked token is refused at once, with a body or without.
    people.root.delete(f"/admin/tokens/{token_id(service, 'bob')}").raise_for_status()
    assert people.bob.post("/jobs", json=spec).status_code == 401
    assert people.bob.get("/me").status_code == 401


def token_id(service: Service, user: str) -> int:
    return next(token.id for token in service.runtime.auth.list_tokens() if token.user_name == user)


def test_only_the_owner_or_an_admin_cancels(service: Service, people: People, spec: dict[str, Any]) -> None:
    first, second = submit(people.ada, spec), submit(people.ada, spec)
    refused = people.bob.post(f"/jobs/{first['id']}/cancel")
    assert refused.status_code == 403, refused.text
    assert refused.json()["message"] == (
        f"job {first['id']} belongs to ada: only its owner or an admin may cancel it"
    )
    assert people.ada.get(f"/jobs/{first['id']}").json()["state"] == "queued"
    assert people.ada.post(f"/jobs/{first['id']}/cancel").json()["state"] == "cancelled"
    assert people.root.post(f"/jobs/{second['id']}/cancel").json()["state"] == "cancelled"
    events = people.ada.get(f"/jobs/{second['id']}/events").json()["data"]
    assert (events[-1]["actor"], events[-1]["reason"]) == ("root", "cancelled by root")


def test_only_the_owner_or_an_admin_preempts(service: Service, people: People, spec: dict[str, Any]) -> None:
    first = submit(people.ada, spec)
    run(service, first["id"])
    refused = people.bob.post(f"/jobs/{first['id']}/preempt")
    assert (
        refused.status_code == 403 and "only its owner or an admin may preempt" in refused.json()["message"]
    )
    assert people.ada.get(f"/jobs/{first['id']}").json()["state"] == "running"
    assert people.ada.post(f"/jobs/{first['id']}/preempt").json()["state"] == "preempting"
    second = submit(people.bob, spec)
    run(service, second["id"])
    assert people.root.post(f"/jobs/{second['id']}/preempt").json()["state"] == "preempting"


def test_only_an_admin_changes_a_jobs_queue_or_priority(
    service: Service, people: People, spec: dict[str, Any]
) -> None:
    job = submit(people.ada, spec)
    refused = people.ada.patch(f"/jobs/{job['id']}", json={"priority": 50})
    assert refused.status_code == 403 and "only an admin" in refused.json()["message"]
    changed = people.root.patch(f"/jobs/{job['id']}", json={"priority": 50, "queue": "full-scale"})
    assert changed.status_code == 200, changed.text
    body = changed.json()
    assert (body["priority"], body["queue"]) == (50, "full-scale")
    assert (body["spec"]["priority"], body["spec"]["queue"]) == (50, "full-scale")
    events = people.ada.get(f"/jobs/{job['id']}/events").json()["data"]
    assert events[-1]["reason"] == "queue research -> full-scale, priority 0 -> 50 by root"
    service.tick()
    assert service.runtime.jobs.get_job(job["id"]).state == "admitted"
    assert people.root.patch(f"/jobs/{job['id']}", json={"queue": "research"}).status_code == 409
    bad = people.root.patch(f"/jobs/{job['id']}", json={"priority": 1000})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][-1] == "priority"


def test_the_scheduler_admits_by_the_priority_an_admin_gave(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(nodes=[{"CPU": 2.0}])  # one 1-worker job at a time (1 CPU + 1 for data)
    people = People(service)
    first, second, third = (submit(people.ada, spec)["id"] for _ in range(3))
    service.tick()  # the scheduler has seen all three
    assert service.runtime.jobs.get_job(first).state == "admitted"
    assert people.root.patch(f"/jobs/{third}", json={"priority": 50}).status_code == 200
    people.ada.post(f"/jobs/{first}/cancel")
    service.tick()
    assert service.runtime.jobs.get_job(third).state == "admitted"
    assert service.runtime.jobs.get_job(second).state == "queued"


def test_a_priority_above_the_ceiling_is_an_admins_to_give(
    start_service: Callable[..., Service], spec: dict[str, Any]
) -> None:
    service = start_service(user_max_priority=5)
    people = People(service)
    refused = people.ada.post("/jobs", json={**spec, "priority": 6})
    assert refused.status_code == 403, refused.text
    assert refused.json()["detail"][0]["loc"] == ["body", "priority"]
    assert "priority 6 is above 5" in refused.json()["message"]
    assert people.ada.get("/jobs").json()["count"] == 0
    assert submit(people.ada, spec, priority=5)["priority"] == 5
    assert submit(people.root, spec, priority=90)["priority"] == 90


def test_admins_create_list_and_revoke_tokens(service: Service, people: People) -> None:
    for method, path in (("POST", "/admin/tokens"), ("GET", "/admin/tokens"), ("DELETE", "/admin/tokens/1")):
        kwargs: dict[str, Any] = {"json": {"user": "eve"}} if method == "POST" else {}
        response = people.ada.request(method, path, **kwargs)
        assert response.status_code == 403 and "only an admin" in response.json()["message"], path
    created = people.root.post("/admin/tokens", json={"user": "carol"})
    assert created.status_code == 201, created.text
    secret = created.json()["token"]
    assert re.fullmatch(r"apiary_[A-Za-z0-9_-]{43}", secret)
    carol = service.as_user(secret)
    assert carol.get("/me").json() == {"user": "carol", "admin": False}
    listed = people.root.get("/admin/tokens").json()
    assert listed["count"] == 4 and [t["user"] for t in listed["data"]] == ["ada", "bob", "root", "carol"]
    assert secret not in json.dumps(listed) and all("token" not in t for t in listed["data"])
    assert people.root.post("/admin/tokens", json={"user": "no spaces"}).status_code == 422
    revoked = people.root.delete(f"/admin/tokens/{created.json()['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert carol.get("/me").status_code == 401
    assert people.root.delete("/admin/tokens/999").status_code == 404


def test_without_tokens_every_request_is_the_local_admin(service: Service, spec: dict[str, Any]) -> None:
    assert service.http.get("/me").json() == {"user": "ada", "admin": True}
    job = service.submit({**spec, "priority": 90})  # the local user is an admin: no ceiling
    assert job["owner"] == "ada"
    assert service.http.post(f"/jobs/{job['id']}/cancel").status_code == 200
    assert service.as_user("apiary_unknown").get("/jobs").status_code == 401  # a bad token is still bad


def test_auth_can_be_required_before_any_token_exists(start_service: Callable[..., Service]) -> None:
    service = start_service(auth_required=True)
    assert service.http.get("/jobs").status_code == 401
    assert service.as_user(service.token("root", admin=True)).get("/jobs").status_code == 200


def test_auth_fails_closed_on_a_public_address(start_service: Callable[..., Service]) -> None:
    # Bound to every interface (the test's own traffic goes to 127.0.0.1 only), with no token yet: the
    # service requires one anyway, and nothing an admin revokes opens it again.
    service = start_service(host="0.0.0.0")
    assert service.http.get("/me").status_code == 401
    root = service.as_user(service.token("root", admin=True))
    second = root.post("/admin/tokens", json={"user": "eve", "admin": True}).json()
    root.post("/admin/tokens", json={"user": "ada"})
    tokens = root.get("/admin/tokens").json()["data"]
    assert [token["id"] for token in tokens] == [1, second["id"], second["id"] + 1]
    for token in reversed(tokens):  # root's own last
        response = root.delete(f"/admin/tokens/{token['id']}")
        if token["id"] == 1:
            assert response.status_code == 409, response.text
            assert "last active admin token" in response.json()["message"]
        else:
            assert response.status_code == 200, response.text
    assert root.get("/me").json() == {"user": "root", "admin": True}
    for method, path in (("GET", "/me"), ("GET", "/jobs"), ("POST", "/admin/tokens")):
        anonymous = service.http.request(method, path, json={"user": "mallory", "admin": True})
        assert anonymous.status_code == 401, (method, path, anonymous.text)


def test_auth_stays_required_once_a_token_ever_existed(start_service: Callable[..., Service]) -> None:
    service = start_service()  # on 127.0.0.1
    assert service.http.get("/me").json() == {"user": "ada", "admin": True}
    user_token = service.runtime.auth.create_token(user="bob")
    service.runtime.auth.revoke_token(user_token.token.id)  # no unrevoked token is left
    assert service.http.get("/me").status_code == 401
    assert service.http.post("/admin/tokens", json={"user": "mallory", "admin": True}).status_code == 401
    # Persisted in the database, not inferred per request: a new service on it says the same.
    assert Auth(db=service.runtime.db, settings=service.runtime.settings).required()


def test_revoking_the_last_admin_token_on_the_database_is_refused(
    start_service: Callable[..., Service], database_url: str, tmp_path: Path
) -> None:
    env = {"APIARY_DATABASE_URL": database_url, "APIARY_DATA_DIR": str(tmp_path / "data")}
    start_service()  # migrates the database
    assert CliRunner().invoke(cli, ["token", "create", "root", "--admin"], env=env).exit_code == 0
    refused = CliRunner().invoke(cli, ["token", "revoke", "1"], env=env)
    assert refused.exit_code == 2 and "last active admin token" in refused.output, refused.output


def status_before_the_body(
    service: Service, method: str, path: str, *, length: int, headers: dict[str, str] | None = None
) -> int | None:
    """Send a request's head announcing a `length`-byte body, and no body: the status the server answers
    without it, or None when it waits for the body (it would read it)."""
    url = httpx.URL(str(service.http.base_url))
    lines = [f"{method} {path} HTTP/1.1", f"Host: {url.host}:{url.port}", "Content-Type: application/json"]
    lines += [
        f"{name}: {value}" for name, value in {**(headers or {}), "Content-Length": str(length)}.items()
    ]
    with socket.create_connection((url.host, url.port), timeout=3) as connection:
        connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            head = connection.recv(4096)
        except TimeoutError:
            return None
    return int(head.split(b" ", 2)[1])


def test_a_request_without_a_valid_token_is_refused_before_its_body_is_read(
    service: Service, people: People, spec: dict[str, Any]
) -> None:
    job = submit(people.ada, spec)
    service.tick()  # admitted: its attempt has a report token
    telemetry = f"/internal/jobs/{job['id']}/telemetry"
    big = 8 * 1024 * 1024 - 1
    bearer = {"Authorization": f"Bearer {people.tokens['ada']}"}
    refused = {
        ("POST", telemetry, "no token"): {},
        ("POST", telemetry, "a user's token"): bearer,
        ("POST", telemetry, "a wrong token"): {"Authorization": "Bearer apiary_wrong"},
        ("POST", "/jobs", "no token"): {},
        ("POST", "/jobs", "a wrong token"): {"Authorization": "Bearer apiary_wrong"},
        ("POST", "/jobs", "a wrong cookie"): {"Cookie": "apiary_session=wrong"},
        ("PATCH", f"/jobs/{job['id']}", "no token"): {},
        ("POST", "/admin/tokens", "no token"): {},
    }
    for (method, path, why), headers in refused.items():
        length = big if path.startswith("/internal/") else 1000_000
        status = status_before_the_body(service, method, path, length=length, headers=headers)
        assert status == 401, (method, path, why, status)
    # A valid token: the body is awaited (and then read, parsed and checked as always).
    assert status_before_the_body(service, "POST", "/jobs", length=1000, headers=bearer) is None
    own = service.backend.report_headers(job["id"])
    assert status_before_the_body(service, "POST", telemetry, length=1000, headers=own) is None


def messages_until_closed(reader: SseReader, *, within_s: float) -> list[str]:
    """The events a stream sends until the server closes it (which must happen within `within_s`)."""
    deadline = time.monotonic() + within_s
    events = []
    while (message := reader.next(timeout_s=max(0.1, deadline - time.monotonic()))) is not None:
        events.append(message.event)
    return events


def test_revoking_a_token_ends_its_open_streams(
    service: Service, people: People, spec: dict[str, Any]
) -> None:
    job = submit(people.ada, spec)
    created = people.root.post("/admin/tokens", json={"user": "carol"}).json()
    bearer = {"Authorization": f"Bearer {created['token']}"}
    base = str(service.http.base_url)
    streams = [
        SseReader(base, path, headers=bearer) for path in ("/queues/stream", f"/jobs/{job['id']}/stream")
    ]
    try:
        assert [m.event for m in streams[0].until("queues")] == ["queues"]
        assert [m.event for m in streams[1].until("event")] == ["state", "event"]  # the job was queued
        assert people.root.delete(f"/admin/tokens/{created['id']}").status_code == 200
        submit(people.ada, spec)  # something new for the queues stream to send
        for stream in streams:
            # Closed within the re-check period (5 s), and nothing more sent after the revocation.
            assert messages_until_closed(stream, within_s=7) == []
        assert SseReader(base, "/queues/stream", headers=bearer).status_code == 401
    finally:
        for stream in streams:
            stream.close()


HTML = {"Accept": "text/html"}


def log_in(browser: httpx.Client, token: str, *, next_path: str = "/") -> httpx.Response:
    """Log `browser` in as a browser does: the form (its CSRF token), then its post from this site."""
    form = browser.get("/login", headers=HTML)
    found = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert form.status_code == 200 and found, form.text
    origin = {"Origin": str(browser.base_url).rstrip("/")}
    return browser.post(
        "/login", data={"token": token, "next": next_path, "csrf": found.group(1)}, headers=origin
    )


def page_csrf(browser: httpx.Client, path: str) -> str:
    page = browser.get(path, headers=HTML)
    found = re.search(r'<meta name="csrf-token" content="([^"]+)"', page.text)
    assert page.status_code == 200 and found, page.text
    return found.group(1)


def test_the_web_view_logs_in_to_a_server_side_session(
    service: Service, people: People, spec: dict[str, Any]
) -> None:
    job = submit(people.ada, spec)
    browser = service.as_user(None)
    away = browser.get(f"/jobs/{job['id']}", headers=HTML)
    assert away.status_code == 303 and away.headers["location"] == f"/login?next=/jobs/{job['id']}"
    wrong = log_in(browser, "apiary_wrong")
    assert wrong.status_code == 401 and "unknown or revoked" in wrong.text
    assert "apiary_session" not in wrong.headers.get("set-cookie", "")

    logged_in = log_in(browser, people.tokens["bob"], next_path=f"/jobs/{job['id']}")
    assert logged_in.status_code == 303 and logged_in.headers["location"] == f"/jobs/{job['id']}"
    cookie = logged_in.headers["set-cookie"].lower()
    assert "apiary_session=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
    session_id = browser.cookies["apiary_session"]
    assert (
        people.tokens["bob"] not in logged_in.headers["set-cookie"]
        and session_id not in people.tokens.values()
    )
    page = browser.get(f"/jobs/{job['id']}", headers=HTML)
    assert page.status_code == 200 and "bob" in page.text
    assert re.search(r'<button id="cancel"[^>]*disabled', page.text)  # not bob's job
    same_site = {"Origin": str(browser.base_url).rstrip("/"), "X-CSRF-Token": page_csrf(browser, "/")}
    assert browser.post(f"/jobs/{job['id']}/cancel", headers=same_site).status_code == 403  # not bob's

    browser.cookies.clear()
    owner = log_in(browser, people.tokens["ada"], next_path="//evil.example/")
    assert owner.headers["location"] == "/"  # only a path on this site
    page = browser.get(f"/jobs/{job['id']}", headers=HTML)
    assert not re.search(r'<button id="cancel"[^>]*disabled', page.text)
    same_site = {"Origin": str(browser.base_url).rstrip("/"), "X-CSRF-Token": page_csrf(browser, "/")}
    assert browser.post(f"/jobs/{job['id']}/cancel", headers=same_site).json()["state"] == "cancelled"
    session_id = browser.cookies["apiary_session"]
    logout = browser.post(
        "/logout", data={"csrf_token": same_site["X-CSRF-Token"]}, headers={"Origin": same_site["Origin"]}
    )
    assert logout.status_code == 303
    assert browser.get("/", headers=HTML).status_code == 303
    # The session ended on the server: its id, replayed, is refused.
    replay = service.as_user(None)
    replay.cookies.set("apiary_session", session_id)
    assert replay.get("/me").status_code == 401


def test_revoking_a_token_ends_its_web_sessions(service: Service, people: People) -> None:
    created = people.root.post("/admin/tokens", json={"user": "carol"}).json()
    browser = service.as_user(None)
    assert log_in(browser, created["token"]).status_code == 303
    assert browser.get("/me").json() == {"user": "carol", "admin": False}
    people.root.delete(f"/admin/tokens/{created['id']}")
    assert browser.get("/me").status_code == 401
    assert browser.get("/", headers=HTML).status_code == 303  # back to the login form


def test_cookie_requests_that_change_something_need_this_site_and_the_csrf_token(
    service: Service, people: People, spec: dict[str, Any]
) -> None:
    job = submit(people.ada, spec)
    browser = service.as_user(None)
    assert log_in(browser, people.tokens["ada"]).status_code == 303
    here = str(browser.base_url).rstrip("/")
    csrf = page_csrf(browser, "/")
    cancel = f"/jobs/{job['id']}/cancel"
    for why, headers in {
        "another site's Origin": {"Origin": "http://evil.example", "X-CSRF-Token": csrf},
        "another port of this host": {"Origin": here.rsplit(":", 1)[0] + ":1", "X-CSRF-Token": csrf},
        "a cross-site fetch": {"Sec-Fetch-Site": "same-site", "X-CSRF-Token": csrf},
        "no Origin at all": {"X-CSRF-Token": csrf},
        "no CSRF token": {"Origin": here},
        "a wrong CSRF token": {"Origin": here, "X-CSRF-Token": "0" * 64},
    }.items():
        response = browser.post(cancel, headers=headers)
        assert response.status_code == 403, (why, response.text)
    assert people.ada.get(f"/jobs/{job['id']}").json()["state"] == "queued"
    # Login CSRF: a form posted from elsewhere, or without the form's own token, logs nobody in.
    stranger = service.as_user(None)
    forged = stranger.post(
        "/login", data={"token": people.tokens["bob"], "next": "/"}, headers={"Origin": here}
    )
    assert forged.status_code == 403 and "apiary_session" not in forged.headers.get("set-cookie", "")
    form = stranger.get("/login", headers=HTML)
    token = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert token is not None
    forged = stranger.post(
        "/login",
        data={"token": people.tokens["bob"], "next": "/", "csrf": token.group(1)},
        headers={"Origin": "http://evil.example"},
    )
    assert forged.status_code == 403 and "apiary_session" not in forged.headers.get("set-cookie", "")
    # A bearer token needs neither (a browser cannot send one across sites).
    assert people.ada.post(cancel, headers={"Origin": "http://evil.example"}).status_code == 200


def test_every_page_forbids_framing_and_sniffing(
    service: Service, people: People, spec: dict[str, Any]
) -> None:
    job = submit(people.ada, spec)
    browser = service.as_user(None)
    log_in(browser, people.tokens["ada"])
    for path in ("/login", "/", f"/jobs/{job['id']}", f"/jobs/{job['id']}?part=live", "/docs"):
        response = (service.as_user(None) if path == "/login" else browser).get(path, headers=HTML)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html"), path
        csp = response.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, path
        assert response.headers["x-content-type-options"] == "nosniff", path
        assert response.headers["referrer-policy"] == "same-origin", path
        assert response.headers["x-frame-options"] == "DENY", path
    assert "style=" not in browser.get(f"/jobs/{job['id']}", headers=HTML).text  # no inline style to allow


def test_apiary_token_create_list_and_revoke_on_the_database(
    start_service: Callable[..., Service], database_url: str, tmp_path: Path
) -> None:
    env = {"APIARY_DATABASE_URL": database_url, "APIARY_DATA_DIR": str(tmp_path / "data")}
    created = CliRunner().invoke(cli, ["token", "create", "root", "--admin"], env=env)
    assert created.exit_code == 0, created.output
    secret = created.stdout.strip()
    assert re.fullmatch(r"apiary_[A-Za-z0-9_-]{43}", secret)
    assert "shown only now" in created.stderr and secret not in created.stderr

    service = start_service()  # the same database: the first admin exists before the API started
    root = service.as_user(secret)
    assert root.get("/me").json() == {"user": "root", "admin": True}
    assert service.http.get("/jobs").status_code == 401

    listed = CliRunner().invoke(cli, ["token", "list", "--json"], env=env)
    assert listed.exit_code == 0 and secret not in listed.output
    assert [(t["id"], t["user"], t["admin"]) for t in json.loads(listed.stdout)["data"]] == [
        (1, "root", True)
    ]
    bad = CliRunner().invoke(cli, ["token", "create", "not a name"], env=env)
    assert bad.exit_code == 2 and "user name" in bad.output
    assert CliRunner().invoke(cli, ["token", "revoke", "7"], env=env).exit_code == 2
    assert CliRunner().invoke(cli, ["token", "create", "eve", "--admin"], env=env).exit_code == 0
    revoked = CliRunner().invoke(cli, ["token", "revoke", "1"], env=env)  # not the last admin's now
    assert revoked.exit_code == 0, revoked.output
    assert root.get("/me").status_code == 401


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_serve_refuses_a_public_address_until_auth_is_configured(database_url: str, tmp_path: Path) -> None:
    env = {"APIARY_DATABASE_URL": database_url, "APIARY_DATA_DIR": str(tmp_path / "data")}
    refused = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"], env=env)
    assert refused.exit_code == 2
    assert "refusing to listen on 0.0.0.0" in refused.output and "apiary token create" in refused.output


def test_tokens_never_reach_the_logs(
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    start_service: Callable[..., Service],  # after capfd: the server stops before the capture does
    spec: dict[str, Any],
) -> None:
    caplog.set_level(logging.DEBUG)
    service = start_service(log_level="debug")  # uvicorn's access log too: every request's line
    people = People(service)
    job = submit(people.ada, spec)
    people.bob.post(f"/jobs/{job['id']}/cancel")  # refused: logged or not, without the token
    people.stranger.get("/jobs")
    created = people.root.post("/admin/tokens", json={"user": "dan"}).json()
    log_in(service.as_user(None), created["token"])
    people.root.delete(f"/admin/tokens/{created['id']}")
    service.as_user(created["token"]).get("/jobs")  # revoked
    secrets = [*people.tokens.values(), created["token"], "apiary_" + "x" * 43]

    captured = capfd.readouterr()
    # Every record at DEBUG, the service's and its libraries', but httpcore's: the test's own HTTP
    # client traces the response headers it receives, the login's Set-Cookie among them.
    records = [
        record.getMessage() + repr(vars(record))
        for record in caplog.records
        if not record.name.startswith("httpcore")
    ]
    assert any("token_created" in record for record in records)  # the logs were captured
    assert any("401 Unauthorized" in record for record in records)
    assert '"GET /jobs HTTP/1.1" 401' in captured.out  # uvicorn's access log
    for text in (captured.out, captured.err, *records):
        for secret in secrets:
            assert secret not in text
            assert secret[len("apiary_") :] not in text
