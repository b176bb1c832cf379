"""A Ray cluster shared with another Ray user: capacity is what Ray reports free, not the total less
Apiary's own jobs. A real Ray head (`ray start`, token auth, its dashboard: what `RayBackend` reads)
and another user's driver holding a placement group of 3 of its 4 CPUs; the service runs on SQLite
with the real backend's snapshot (running jobs is not under test: the fake backend takes the
submission). A job of 2 CPU, which the cluster's total would admit, waits and says who holds the
rest; once the other user's driver exits, Ray frees its placement group and the job is admitted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.capacity import ClusterSnapshot
from service.cluster import RayBackend, auth_env
from tests.integration.conftest import Service
from tests.support.processes import run_test_in_own_process
from tests.support.ray_cluster import RayCluster, ray_cluster
from tests.support.wait import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# Another Ray user: a driver that holds 3 CPU and one `shared_slots` (a name the dashboard's report
# spells `sharedSlots`) in a placement group, and asks for one it can never get, until it is killed.
OTHER_USER = """
import sys, time
import ray
from ray.util.placement_group import placement_group

ray.init(address=sys.argv[1])
held = placement_group([{"CPU": 2}, {"CPU": 1, "shared_slots": 1}], strategy="PACK")
ray.get(held.ready(), timeout=120)
never = placement_group([{"CPU": 100}], strategy="STRICT_SPREAD")
print("holding", flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    with ray_cluster(
        tmp_path_factory.mktemp("ray"), head_cpus=4, head_resources={"shared_slots": 2}
    ) as cluster:
        yield cluster


@pytest.fixture
def other_user(cluster: RayCluster, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    # A clean Ray environment: earlier tests in this process may have left Ray's variables in it
    # (RayBackend sets the auth ones for its own cluster).
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env |= auth_env(cluster.token_path)
    process = subprocess.Popen(
        [sys.executable, "-c", OTHER_USER, cluster.gcs_address],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "other_user.log").open("w"),
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "holding", (tmp_path / "other_user.log").read_text()
        yield process
    finally:
        process.kill()
        process.wait(30)


@pytest.fixture
def backend(cluster: RayCluster, monkeypatch: pytest.MonkeyPatch) -> RayBackend:
    # RayBackend puts the token in this process's environment (for Ray's clients): undone after.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)
    return RayBackend(cluster.dashboard_url, auth_token=cluster.token)


# Ray reads its auth settings once per process: after other tests' Ray clients (no token) in the same
# pytest process, this test's token would not be used. It runs in a pytest process of its own.
OWN_PROCESS_VAR = "APIARY_SHARED_CLUSTER_OWN_PROCESS"
IN_OWN_PROCESS = os.environ.get(OWN_PROCESS_VAR) == "1"


@pytest.mark.skipif(IN_OWN_PROCESS, reason="this is the process the test runs in")
def test_in_a_process_of_its_own() -> None:
    run_test_in_own_process(
        __file__,
        "test_a_gang_waits_while_another_ray_user_holds_the_cpus_and_starts_once_they_are_freed",
        flag=OWN_PROCESS_VAR,
        timeout_s=580,
    )


@pytest.mark.skipif(not IN_OWN_PROCESS, reason="run by test_in_a_process_of_its_own, in its own process")
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_gang_waits_while_another_ray_user_holds_the_cpus_and_starts_once_they_are_freed(
    start_service: Callable[..., Service],
    backend: RayBackend,
    other_user: subprocess.Popen[str],
    classification_dataset: str,
) -> None:
    # Ray's load report is rewritten every few seconds: its use and its pending demand.
    def reported() -> ClusterSnapshot | None:
        snapshot = backend.snapshot()
        used = snapshot.nodes[0].used or {}
        return snapshot if used.get("CPU", 0) >= 3 and snapshot.pending else None

    snapshot = wait_until(reported, timeout_s=60, interval_s=0.5, what="Ray reporting the other user")
    node = snapshot.nodes[0]
    assert node.resources["CPU"] == 4 and node.used == {"CPU": 3, "head": 0, "shared_slots": 1}
    assert "1 placement group(s) STRICT_SPREAD of [1 x 100 CPU]" in snapshot.pending, snapshot.pending

    service = start_service(capacity=backend)
    spec: dict[str, Any] = {
        "name": "shared",
        "trainer": "mlp",
        "num_workers": 1,  # + 1 data CPU: 2 CPU, half the cluster's total
        "dataset": {"uri": classification_dataset},
        "max_steps": 10,
        "batch_size": 8,
        "config": {"task": "classification", "num_classes": 3},
    }
    job = service.submit(spec)
    service.tick()
    waiting = service.job(job["id"])
    assert waiting["state"] == "queued", waiting
    assert (
        "free now 1 CPU, 1 head, 1 shared_slots (other Ray users hold 3 CPU, 1 shared_slots)"
        in (waiting["waiting_reason"])
    ), waiting["waiting_reason"]
    assert service.backend.submitted == []

    other_user.kill()  # its driver gone, Ray removes its placement groups

    def admitted() -> bool:
        service.tick()
        return bool(service.job(job["id"])["state"] == "admitted")

    wait_until(admitted, timeout_s=60, interval_s=0.5, what="the job admitted once the CPUs are free")
    assert [launch.job_id for _, launch in service.backend.submitted] == [job["id"]]
