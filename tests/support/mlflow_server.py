"""A real MLflow tracking server on 127.0.0.1 (SQLite backend), from the `.venv-mlflow` that .ci/run
makes (tests/support/mlflow-server.txt); APIARY_TEST_MLFLOW names another `mlflow` executable."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from service.cluster import free_port
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
MLFLOW = Path(os.environ.get("APIARY_TEST_MLFLOW", ROOT / ".venv-mlflow" / "bin" / "mlflow"))


@contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """Start `mlflow server` with its database and artifacts in `folder`; yields its URL."""
    if not MLFLOW.exists():
        pytest.skip(
            f"no MLflow server at {MLFLOW}: .ci/run makes .venv-mlflow (tests/support/mlflow-server.txt)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = folder / "mlflow.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                str(MLFLOW),
                "server",
                "--backend-store-uri",
                f"sqlite:///{folder / 'mlflow.db'}",
                "--artifacts-destination",
                str(folder / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def answers() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(answers, timeout_s=120, interval_s=0.5, what=f"mlflow server answering on {url}")
        yield url
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
