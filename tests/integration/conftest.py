"""The service over real HTTP on SQLite and PostgreSQL, with a fake cluster (Ray is not under test here;
tests/e2e runs the real thing). The scheduler does not loop: each test calls `tick()` when it wants one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from api.app import create_app
from api.server import BackgroundServer
from service.cluster import free_port
from service.runtime import Runtime
from service.settings import Settings
from tests.support.fakes import FakeBackend


class Service:
    def __init__(self, *, http: httpx.Client, runtime: Runtime, backend: FakeBackend) -> None:
        self.http = http
        self.runtime = runtime
        self.backend = backend

    def tick(self, now: float | None = None) -> None:
        self.runtime.scheduler.tick(now)

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post("/jobs", json=spec)
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def job(self, job_id: int) -> dict[str, Any]:
        body: dict[str, Any] = self.http.get(f"/jobs/{job_id}").json()
        return body

    def count(self) -> int:
        return int(self.http.get("/jobs").json()["count"])


@pytest.fixture
def start_service(database_url: str, tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """Starts the service (at most once per test), with `queues` (service.queues) if given."""
    servers: list[BackgroundServer] = []

    def start(
        *,
        queues: dict[str, Any] | None = None,
        nodes: list[dict[str, float]] | None = None,
        run_scheduler: bool = False,
        **settings_fields: Any,
    ) -> Service:
        """`settings_fields` override the Settings (e.g. database_url); `run_scheduler` runs its loop."""
        port = free_port()
        queues_file = None
        if queues is not None:
            queues_file = tmp_path / "queues.yaml"
            queues_file.write_text(yaml.safe_dump(queues))
        fields = {"data_dir": tmp_path / "data", "database_url": database_url, **settings_fields}
        settings = Settings(port=port, queues_file=queues_file, **fields)
        backend = FakeBackend(nodes=nodes) if nodes is not None else FakeBackend()
        runtime = Runtime(settings, backend=backend, run_scheduler=run_scheduler)
        server = BackgroundServer(create_app(runtime=runtime), host="127.0.0.1", port=port)
        server.start()
        servers.append(server)
        http = httpx.Client(base_url=server.url, headers={"X-Apiary-User": "ada"}, timeout=10)
        return Service(http=http, runtime=runtime, backend=backend)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def service(start_service: Callable[..., Service]) -> Service:
    return start_service()
