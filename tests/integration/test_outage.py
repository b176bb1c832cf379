"""The database goes away and comes back (PostgreSQL behind a TCP proxy that the test cuts): requests
get 503 with Retry-After and no driver text, liveness stays up while readiness says why not, nothing
committed is lost, and the scheduler's loop carries on when the database returns. At start, the
service waits for a database that is not up yet."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from api.app import create_app
from api.server import BackgroundServer
from service.cluster import RayJobStatus, free_port
from service.contract.errors import DatabaseUnavailable
from service.runtime import Runtime
from service.settings import Settings
from service.store.db import Database
from tests.integration.conftest import Service
from tests.support.fakes import FakeBackend
from tests.support.proxy import TcpProxy
from tests.support.wait import wait_until


@pytest.fixture
def proxied(postgres_url: str) -> Iterator[tuple[str, TcpProxy]]:
    """A fresh PostgreSQL database, and its URL through a proxy that the test can cut."""
    url = make_url(postgres_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    yield url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False), proxy
    proxy.close()


# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "outage",
}


def test_requests_get_503_while_the_database_is_away_and_nothing_is_lost(
    proxied: tuple[str, TcpProxy], spec: dict[str, Any], tmp_path: Path
) -> None:
    database_url, proxy = proxied
    port = free_port()
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        port=port,
        scheduler_interval_s=0.2,
        data_roots=str(tmp_path),
    )
    backend = FakeBackend(nodes=[{"CPU": 2.0}])  # room for one 1-worker job (+1 data CPU) at a time
    runtime = Runtime(settings, backend=backend, run_scheduler=True)
    server = BackgroundServer(create_app(runtime=runtime), host="127.0.0.1", port=port)
    server.start()
    http = httpx.Client(base_url=server.url, timeout=30)
    try:
        before = http.post("/jobs", json=spec)
        assert before.status_code == 201, before.text
        first = before.json()["id"]
        wait_until(lambda: backend.submitted, timeout_s=20, what="the scheduler admitting the first job")

        proxy.close()
        for method, path, body in [
            ("GET", f"/jobs/{first}", None),
            ("GET", "/jobs", None),
            ("POST", "/jobs", spec),
            ("POST", f"/jobs/{first}/cancel", None),
            ("POST", f"/internal/jobs/{first}/telemetry", {"attempt": 1}),
        ]:
            # Telemetry with its report token: without one it is refused before the database is asked.
            headers = backend.report_headers(first) if "/internal/" in path else None
            response = http.request(method, path, json=body, headers=headers)
            assert response.status_code == 503, (method, path, response.text)
            assert int(response.headers["Retry-After"]) > 0
            assert response.json()["error"] == "DatabaseUnavailable"
            # No driver text: no host, port, library or SQL reaches a client.
            for leak in (str(proxy.port), "psycopg", "SELECT", "connection to server"):
                assert leak not in response.text
        not_ready = http.get("/readyz")
        assert not_ready.status_code == 503
        assert not_ready.json() == {"status": "unavailable", "database": "unavailable", "ray": "ok"}
        assert http.get("/healthz").status_code == 200  # alive: an orchestrator must not kill it
        second_spec = {**spec, "name": "after-outage"}
        time.sleep(5 * settings.scheduler_interval_s)  # the scheduler's passes fail meanwhile

        proxy.open()
        after = wait_until(
            lambda: (r := http.post("/jobs", json=second_spec)).status_code == 201 and r,
            timeout_s=30,
            interval_s=0.5,
            what="POST /jobs succeeding after the database came back",
        )
        assert http.get("/readyz").status_code == 200
        second = after.json()["id"]
        jobs = http.get("/jobs").json()
        assert jobs["count"] == 2 and {job["id"] for job in jobs["data"]} == {first, second}
        events = http.get(f"/jobs/{first}/events").json()["data"]
        assert [event["to_state"] for event in events] == ["queued", "admitted"]

        # The scheduler's loop survived the outage: it finishes the first job and admits the second.
        backend.statuses[backend.submission_of(first)] = RayJobStatus.SUCCEEDED
        wait_until(
            lambda: http.get(f"/jobs/{second}").json()["state"] == "admitted",
            timeout_s=30,
            what="the scheduler admitting the job submitted after the outage",
        )
        assert http.get(f"/jobs/{first}").json()["state"] == "succeeded"
    finally:
        http.close()
        server.stop()


def test_the_service_waits_for_a_database_that_is_not_up_yet(proxied: tuple[str, TcpProxy]) -> None:
    database_url, proxy = proxied
    proxy.close()
    database = Database(database_url)
    try:
        with pytest.raises(DatabaseUnavailable, match=r"did not answer within 0.5 s"):
            database.wait(0.5, first_delay_s=0.1)
        threading.Timer(1.0, proxy.open).start()
        database.wait(30, first_delay_s=0.1)  # returns once the proxy (the "database") is back
        database.upgrade()
    finally:
        database.dispose()


def test_the_postgresql_pool_holds_the_configured_connections(
    start_service: Callable[..., Service], database_url: str
) -> None:
    service = start_service(database_pool_size=12)
    assert service.runtime.db is not None
    pool = service.runtime.db.engine.pool
    # PostgreSQL: a connection per request thread, so that a burst does not queue for one; SQLite as is.
    assert pool.size() == (12 if database_url.startswith("postgresql") else 5)  # type: ignore[attr-defined]
