"""APIARY_RAY_AUTH_TOKEN against a real Ray with token auth (RAY_AUTH_MODE=token), as in the compose
stack and the KubeRay example: the service reaches the Jobs and State APIs with the cluster's token and
is refused with any other. Each probe is its own process, because Ray reads its auth settings once per
process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.cluster import LocalRay

pytestmark = [pytest.mark.timeout(300)]

PROBE = """
import sys
from service.contract.errors import ClusterUnavailable
from service.runtime import Runtime
from service.settings import Settings

settings = Settings(ray_address=sys.argv[1])  # APIARY_RAY_AUTH_TOKEN from the environment
try:
    backend = Runtime(settings)._connect_ray()
    print("alive nodes:", len(backend.wait_for_nodes().nodes), "jobs:", backend.submissions("apiary-"))
except ClusterUnavailable as err:
    print("unavailable:", err.message)
    sys.exit(3)
"""


def _probe(dashboard_url: str, token: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_", "APIARY_"))}
    env |= {"APIARY_RAY_AUTH_TOKEN": token, "APIARY_DATA_DIR": str(tmp_path / "probe"), "HOME": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", PROBE, dashboard_url], env=env, capture_output=True, text=True, timeout=120
    )


def test_the_service_reaches_a_token_auth_cluster_with_its_token_only(tmp_path: Path) -> None:
    cluster = LocalRay.start_or_reuse(data_dir=tmp_path / "ray-data", num_cpus=1)
    try:
        token = cluster.auth_token_path.read_text().strip()
        # The compose stack's health check of the head needs no token; the Jobs API does.
        assert httpx.get(f"{cluster.dashboard_url}/api/gcs_healthz", timeout=10).status_code == 200
        assert httpx.get(f"{cluster.dashboard_url}/api/jobs/", timeout=10).status_code == 401

        good = _probe(cluster.dashboard_url, token, tmp_path)
        assert good.returncode == 0, good.stdout + good.stderr
        assert "alive nodes: 1 jobs: []" in good.stdout

        wrong = _probe(cluster.dashboard_url, "0" * len(token), tmp_path)
        assert wrong.returncode == 3, wrong.stdout + wrong.stderr
        assert "Invalid authentication token" in wrong.stdout  # Ray's 403, in ClusterUnavailable's message
    finally:
        cluster.stop()
