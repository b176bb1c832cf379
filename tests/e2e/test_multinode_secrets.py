"""No S3 secret of a real run on an external two-node Ray cluster in anything Ray shows or writes.

The nodes (`tests.support.ray_cluster`) start without AWS variables and share no filesystem with the
service (everything the job reads is in S3, moto on loopback). `apiary serve` holds a fresh secret
key of this test's own. A job of two workers, one on each node, reads its dataset from S3 and
checkpoints there. While it runs, and after it ended: Ray's job table (Jobs API `GET /api/jobs/`),
the job's runtime_env, the command lines and environments of every process on this machine (the
service's own and this test's excepted) and every file under the cluster's folders (Ray's session
logs among them) hold neither the secret key nor an AWS variable in the runtime_env; the fetch token
the job's environment does carry is dead once redeemed (service.credentials).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.client import ApiaryClient
from api.demo import classification_table, write_shards
from service.contract.protocol import LAUNCH_ENV_VAR
from tests.conftest import S3
from tests.e2e.conftest import start_serve, stop_serve
from tests.support.processes import processes_holding
from tests.support.ray_cluster import RayCluster, ray_cluster
from tests.support.wait import wait_until

pytestmark = [pytest.mark.timeout(600), pytest.mark.ray]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RayCluster]:
    # Started before the `s3` fixture sets the AWS variables: the nodes have none of their own.
    with ray_cluster(tmp_path / "ray", head_cpus=3) as cluster:
        cluster.add_node("node2", num_cpus=2)
        yield cluster


def test_no_s3_secret_reaches_ray_on_an_external_cluster(
    cluster: RayCluster, s3: S3, postgres_url: str, tmp_path: Path
) -> None:
    secret = f"aws-secret-{secrets.token_hex(16)}"  # moto takes any credentials
    dataset = f"{s3.datasets_uri}/clf"
    write_shards(
        classification_table(num_rows=512, num_features=8, num_classes=3),
        dataset,
        num_shards=2,
        s3_endpoint_url=s3.endpoint_url,
    )
    served = start_serve(
        data_dir=tmp_path / "data",
        database_url=postgres_url,
        log=tmp_path / "serve.log",
        env={
            "AWS_SECRET_ACCESS_KEY": secret,
            "APIARY_RAY_ADDRESS": cluster.dashboard_url,
            "APIARY_RAY_AUTH_TOKEN": cluster.token,
            "APIARY_STORAGE_URI": f"{s3.checkpoints_uri}/secrets",
            "APIARY_JOB_PYTHON": str(cluster.python),
        },
    )
    ray_auth = {"Authorization": f"Bearer {cluster.token}"}
    try:
        with ApiaryClient(served.url) as client:
            job = client.submit(
                {
                    "name": "secrets-across-nodes",
                    "trainer": "mlp",
                    "num_workers": 2,
                    "resources_per_worker": {"CPU": 1},
                    "placement": "strict_spread",
                    "dataset": {"uri": dataset},
                    "max_steps": 60,
                    "batch_size": 16,
                    "checkpoint": {"every_steps": 30},
                    "config": {"task": "classification", "num_classes": 3, "lr": 0.01},
                }
            )

            def training() -> Any:
                current = client.get(job.id)
                assert current.state in ("queued", "admitted", "running"), current
                return current if (current.latest_step or 0) >= 5 else None

            running = wait_until(training, timeout_s=300, interval_s=0.3, what="the job training")
            # While it runs: its driver, Train workers and Ray Data tasks are alive on both nodes.
            during = processes_holding(secret, besides={os.getpid(), served.process.pid})
            ray_job: dict[str, Any] = httpx.get(
                f"{cluster.dashboard_url}/api/jobs/{running.ray_submission_id}", headers=ray_auth, timeout=10
            ).json()
            job = client.wait(job.id, timeout_s=300)
            assert job.state == "succeeded", job
            assert job.latest_checkpoint is not None and job.latest_checkpoint.startswith(s3.checkpoints_uri)
        after = processes_holding(secret, besides={os.getpid(), served.process.pid})
        table = httpx.get(f"{cluster.dashboard_url}/api/jobs/", headers=ray_auth, timeout=10).text
        # The one secret-like value in the runtime_env: the attempt's fetch token, dead once redeemed.
        env_vars = ray_job["runtime_env"]["env_vars"]
        pointer = json.loads(env_vars[LAUNCH_ENV_VAR])
        replayed = (
            httpx.post(
                pointer["credentials_url"],
                headers={"Authorization": f"Bearer {pointer['credentials_token']}"},
                timeout=10,
            )
            if pointer.get("credentials_token")
            else None
        )
    finally:
        stop_serve(served)

    assert secret not in json.dumps(ray_job), ray_job["runtime_env"]
    assert not [key for key in env_vars if key.startswith("AWS_")], sorted(env_vars)
    assert secret not in table
    assert during == [] and after == [], during + after
    logs = [
        str(path)
        for top in (cluster.root, cluster.temp_dir)
        for path in top.rglob("*")
        if path.is_file() and not path.is_symlink() and secret.encode() in path.read_bytes()
    ]
    assert logs == []
    assert secret not in served.log.read_text()
    assert replayed is not None and replayed.status_code in (401, 403), replayed
