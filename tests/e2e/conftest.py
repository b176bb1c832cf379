"""A real `apiary serve` (the console script, as a user runs it) with its own local Ray."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.client import ApiaryClient
from api.demo import classification_table, write_shards
from service.cluster import free_port
from tests.support.wait import wait_until


@dataclass
class Served:
    url: str
    data_dir: Path
    process: subprocess.Popen[bytes]
    log: Path
    database_url: str

    def ray_state(self) -> dict[str, str]:
        state: dict[str, str] = json.loads((self.data_dir / "ray_cluster.json").read_text())
        return state

    def ray_jobs_api(self, method: str, path: str, **kwargs: Any) -> Any:
        """Call the local Ray's Jobs API directly (with its token), not through Apiary."""
        state = self.ray_state()
        token = Path(state["auth_token_path"]).read_text().strip()
        response = httpx.request(
            method,
            f"{state['dashboard_url']}/api/jobs/{path}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
            **kwargs,
        )
        response.raise_for_status()
        return response.json()

    def ray_job_status(self, submission_id: str) -> str:
        return str(self.ray_jobs_api("GET", submission_id)["status"])


def apiary_bin() -> str:
    return str(Path(sys.executable).parent / "apiary")


def start_serve(
    *,
    data_dir: Path,
    database_url: str,
    log: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 120,
    port: int | None = None,
) -> Served:
    port = port or free_port()
    env = {
        **os.environ,
        "APIARY_DATA_DIR": str(data_dir),
        "APIARY_DATABASE_URL": database_url,
        # The tests' datasets lie in pytest's temporary folders (or in S3).
        "APIARY_DATA_ROOTS": f"{tempfile.gettempdir()},s3://",
        # No tokens: every request is this local user (the events say "submitted by e2e").
        "APIARY_LOCAL_USER": "e2e",
        **(env or {}),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            [apiary_bin(), "serve", "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    served = Served(
        url=f"http://127.0.0.1:{port}", data_dir=data_dir, process=process, log=log, database_url=database_url
    )

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"apiary serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{served.url}/readyz", timeout=2).json().get("status") == "ok"
        except (httpx.HTTPError, ValueError):  # not up yet, or not answering JSON yet
            return False

    try:
        wait_until(healthy, timeout_s=timeout_s, interval_s=0.5, what="apiary serve becoming healthy")
    except AssertionError:
        process.kill()
        raise RuntimeError(f"apiary serve did not become healthy:\n{log.read_text()[-3000:]}") from None
    return served


def stop_serve(served: Served, timeout_s: float = 90) -> None:
    """SIGTERM, as a supervisor stops it; asserts that the shutdown ran to its end."""
    served.process.send_signal(signal.SIGTERM)
    code = served.process.wait(timeout_s)
    # uvicorn re-raises the signal it handled after a graceful shutdown, so -SIGTERM is clean too.
    assert code in (0, -signal.SIGTERM), f"apiary serve exited with {code}"
    assert "Application shutdown complete" in served.log.read_text()


@contextlib.contextmanager
def serving(root: Path, *, env: dict[str, str] | None = None, timeout_s: float = 120) -> Iterator[Served]:
    """A service + local Ray on a fresh PostgreSQL database (the production database)."""
    from tests.conftest import _fresh_postgres_database

    database = _fresh_postgres_database()
    database_url = next(database)
    served = start_serve(
        data_dir=root / "data",
        database_url=database_url,
        log=root / "serve.log",
        env=env,
        timeout_s=timeout_s,
    )
    try:
        yield served
    finally:
        if served.process.poll() is None:
            stop_serve(served)
        next(database, None)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One service + local Ray for the module."""
    with serving(tmp_path_factory.mktemp("e2e")) as served:
        yield served


@pytest.fixture
def client(served: Served) -> Iterator[ApiaryClient]:
    with ApiaryClient(served.url) as client:
        yield client


def mlp_spec(dataset: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "e2e-mlp",
        "trainer": "mlp",
        "num_workers": 2,
        "resources_per_worker": {"CPU": 1},
        "dataset": {"uri": dataset},
        "max_steps": 30,
        "batch_size": 16,
        "checkpoint": {"every_steps": 10},
        "config": {"task": "classification", "num_classes": 3, "lr": 0.01},
    }
    spec.update(overrides)
    return spec


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    uri = (tmp_path_factory.mktemp("data") / "clf").as_uri()
    write_shards(classification_table(num_rows=1024, num_features=8, num_classes=3), uri, num_shards=4)
    return uri
