"""The service over real HTTP on SQLite and PostgreSQL, with a fake cluster (Ray is not under test here;
tests/e2e runs the real thing). The scheduler does not loop: each test calls `tick()` when it wants one.

Without tokens every request is the local user, `ada` here (service.auth); `Service.token()` issues
one (from then on every request needs one) and `Service.as_user()` is an HTTP client that sends it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from api.app import create_app
from api.server import BackgroundServer
from service.cluster import ClusterBackend, RayJobStatus, free_port
from service.contract.handoff import job_prefix
from service.runtime import Runtime
from service.settings import Settings
from tests.support.fakes import FakeBackend
from tests.support.jobs import classification_job


class Service:
    def __init__(self, *, http: httpx.Client, runtime: Runtime, backend: FakeBackend) -> None:
        self.http = http
        self.runtime = runtime
        self.backend = backend
        self._clients: list[httpx.Client] = []

    def tick(self, now: float | None = None) -> None:
        self.runtime.scheduler.tick(now)

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post("/jobs", json=spec)
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def start(self, spec: dict[str, Any]) -> tuple[int, str]:
        """Submit `spec` and run it (admitted, then RUNNING on the fake cluster): its id and submission."""
        job_id = int(self.submit(spec)["id"])
        self.tick()
        submission_id = self.backend.submission_of(job_id)
        self.backend.statuses[submission_id] = RayJobStatus.RUNNING
        self.tick()
        return job_id, submission_id

    def job(self, job_id: int) -> dict[str, Any]:
        body: dict[str, Any] = self.http.get(f"/jobs/{job_id}").json()
        return body

    def report(self, job_id: int, body: dict[str, Any]) -> httpx.Response:
        """Post telemetry as the job's current attempt does, with its report token (the job must have
        been admitted: `tick()`)."""
        return self.http.post(
            f"/internal/jobs/{job_id}/telemetry", json=body, headers=self.backend.report_headers(job_id)
        )

    def checkpoint_uri(self, job_id: int, name: str) -> str:
        """Where the job's trainers would save checkpoint folder `name` (under its storage prefix)."""
        return job_prefix(self.runtime.settings.resolved_storage_uri, job_id) + name

    def count(self) -> int:
        return int(self.http.get("/jobs").json()["count"])

    def token(self, user: str, *, admin: bool = False) -> str:
        """A new API token's secret (made as `apiary token create` does, on the database)."""
        return self.runtime.auth.create_token(user=user, admin=admin).secret

    def as_user(self, token: str | None) -> httpx.Client:
        """An HTTP client of this service that sends `token` (none: no Authorization header)."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        client = httpx.Client(base_url=self.http.base_url, headers=headers, timeout=10)
        self._clients.append(client)
        return client


@pytest.fixture
def start_service(database_url: str, tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """Starts the service (at most once per test), with `queues` (service.contract.queues) if given, and any
    other Settings; `log_level` is uvicorn's ("info" logs every request)."""
    servers: list[BackgroundServer] = []

    def start(
        *,
        queues: dict[str, Any] | None = None,
        nodes: list[dict[str, float]] | None = None,
        capacity: ClusterBackend | None = None,
        log_level: str = "warning",
        run_scheduler: bool = False,
        **settings: Any,
    ) -> Service:
        """`settings` override the Settings (e.g. database_url, shared_filesystem); `run_scheduler` runs
        its loop; `capacity`: a real cluster whose snapshot the fake backend gives instead of `nodes`."""
        port = free_port()
        queues_file = None
        if queues is not None:
            queues_file = tmp_path / "queues.yaml"
            queues_file.write_text(yaml.safe_dump(queues))
        config = Settings(
            port=port,
            queues_file=queues_file,
            # The tests' datasets lie in their tmp_path; their custom trainer is tests.support's.
            **{
                "data_dir": tmp_path / "data",
                "database_url": database_url,
                "local_user": "ada",
                "data_roots": str(tmp_path),
                "trainer_modules": "tests.support",
                **settings,
            },
        )
        backend = FakeBackend(capacity=capacity)
        if nodes is not None:
            backend.nodes = nodes
        runtime = Runtime(config, backend=backend, run_scheduler=run_scheduler)
        # Bound where `host` says (0.0.0.0 in the fail-closed test), reached on 127.0.0.1 only.
        server = BackgroundServer(
            create_app(runtime=runtime),
            host=config.host,
            port=port,
            log_level=log_level,
            header_timeout_s=config.header_timeout_s,
            forwarded_allow_ips=config.forwarded_allow_ips,
        )
        server.start()
        servers.append(server)
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
        return Service(http=http, runtime=runtime, backend=backend)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def service(start_service: Callable[..., Service]) -> Service:
    return start_service()


@pytest.fixture
def spec(request: pytest.FixtureRequest, classification_dataset: str) -> dict[str, Any]:
    """The job a test submits: `tests.support.jobs.classification_job` on a fresh dataset, with the
    test module's `SPEC_FIELDS` (a dict of the fields it changes; its `name` at least)."""
    fields = dict(getattr(request.module, "SPEC_FIELDS", {"name": "job"}))
    return classification_job(classification_dataset, **fields)
