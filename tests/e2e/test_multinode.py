"""Apiary on a Ray cluster of two nodes, as processes on this machine: PostgreSQL (a fresh database),
S3 (moto on loopback), a Ray head and a second Ray node (`ray start`, each with a custom resource
named after it), and `apiary serve` pointed at them (APIARY_RAY_ADDRESS, APIARY_STORAGE_URI=s3://...,
APIARY_DATABASE_URL).

One job of two workers placed `strict_spread` (Ray Train's placement group strategy, which the
scheduler's admission follows), so its gang spans both nodes. It reads its shards from S3 and
checkpoints to S3. The nodes run Ray with an interpreter that has no Apiary (the job's driver too,
APIARY_JOB_PYTHON): its code reaches them only through its runtime_env. It is interrupted twice:
- without notice: the second node is killed (its raylet, agents and workers at once) while the job
  runs: the gang no longer fits the head alone, so the job is stopped and requeued ("capacity lost"),
  waits while capacity says it cannot fit, and resumes from its S3 checkpoint when a new node joins;
- with notice (a spot node's, service.drains): a termination handler tells Apiary that the new node
  goes in 60 s (`POST /admin/nodes/{id}/drain`; Apiary asks Ray to drain it too), and it is killed at
  the deadline.
  The job checkpoints at its next step boundary, is requeued, and resumes on a fourth node without
  losing a step; no gang is placed on the draining node.
Its final parameters and its loss at every step equal an undisturbed run of the same spec on the same
cluster. A missing S3 dataset is refused at submission, and the S3 secret appears in no log line of
the service. Prints the recovery figures for benchmarks/RESULTS.md (steps lost with notice and without).

A job that brings its own code (`submit(spec, code=DIR)`): its trainer is a module of that folder,
which neither the service's environment nor the nodes have; both ranks, one on each node, import it
from the job's working_dir and read a file shipped beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from api.client import ApiaryClient, ApiaryClientError
from api.demo import classification_table, write_shards
from service.contract.code import pack
from service.contract.protocol import code_modules
from service.contract.storage import resolve_uri
from tests.conftest import S3
from tests.e2e.conftest import Served, start_serve, stop_serve
from tests.support.ray_cluster import RayCluster, ray_cluster
from tests.support.wait import wait_until
from trainers.checkpoint import build_model_from_checkpoint

pytestmark = [pytest.mark.timeout(900), pytest.mark.ray]

STEPS = 800
EVERY = 100
KILL_AFTER = 150  # past the first checkpoint, well before the end
# After the resume from step 100, between two checkpoints, and long before the end (this job takes
# 20-25 steps/s here).
DRAIN_AFTER = 130
DRAIN_DEADLINE_S = 60


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RayCluster]:
    # The head: one worker's CPU and the job's data CPU, and one to spare (the driver takes none).
    with ray_cluster(tmp_path / "ray", head_cpus=3) as cluster:
        cluster.add_node("node2", num_cpus=2)
        yield cluster


@pytest.fixture
def served(cluster: RayCluster, s3: S3, postgres_url: str, tmp_path: Path) -> Iterator[Served]:
    served = start_serve(
        data_dir=tmp_path / "data",
        database_url=postgres_url,
        log=tmp_path / "serve.log",
        env={
            "APIARY_RAY_ADDRESS": cluster.dashboard_url,
            "APIARY_RAY_AUTH_TOKEN": cluster.token,
            "APIARY_STORAGE_URI": f"{s3.checkpoints_uri}/multinode",
            "APIARY_CAPACITY_LOSS_GRACE_S": "3",
            # Where the service reads Ray's node drains and asks for them (service.ray_drains).
            "APIARY_RAY_GCS_ADDRESS": cluster.gcs_address,
            # The driver runs on the head with the nodes' own interpreter, which has no Apiary.
            "APIARY_JOB_PYTHON": str(cluster.python),
        },
    )
    try:
        yield served
    finally:
        stop_serve(served)


def spec(dataset: str, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "trainer": "mlp",
        "num_workers": 2,
        "resources_per_worker": {"CPU": 1},
        "placement": "strict_spread",
        "dataset": {"uri": dataset},
        "max_steps": STEPS,
        "batch_size": 16,
        "checkpoint": {"every_steps": EVERY},
        "max_failures": 3,
        "config": {"task": "classification", "num_classes": 3, "lr": 0.01},
    }


def test_a_gang_across_two_nodes_survives_a_node_death_and_a_drain_and_ends_as_the_undisturbed_run(
    cluster: RayCluster, served: Served, s3: S3, tmp_path: Path
) -> None:
    dataset = f"{s3.datasets_uri}/multinode-clf"
    table = classification_table(num_rows=1024, num_features=8, num_classes=3)
    write_shards(table, dataset, num_shards=4, s3_endpoint_url=s3.endpoint_url)
    nodes = cluster.alive_nodes()
    with ApiaryClient(served.url) as client:
        job = client.submit(spec(dataset, "across-nodes"))

        def at_kill_step() -> Any:
            current = client.get(job.id)
            assert current.state in ("queued", "admitted", "running"), current
            return current if (current.latest_step or 0) >= KILL_AFTER else None

        running = wait_until(at_kill_step, timeout_s=400, interval_s=0.2, what="the job at its kill step")
        # Placed across both nodes: one rank on each (a rank's node: "ip (node id prefix)").
        placed = {rank["node"].split("(")[1].rstrip(")") for rank in (running.ranks or {}).values()}
        assert placed == {nodes["head"][:8], nodes["node2"][:8]}, running.ranks
        # Apiary's code went with the job (runtime_env py_modules), not from the nodes.
        ray_job = httpx.get(
            f"{cluster.dashboard_url}/api/jobs/{running.ray_submission_id}",
            headers={"Authorization": f"Bearer {cluster.token}"},
            timeout=10,
        ).json()
        assert len(ray_job["runtime_env"]["py_modules"]) == len(code_modules()), ray_job["runtime_env"]
        assert ray_job["entrypoint"].startswith(str(cluster.python)), ray_job["entrypoint"]
        # As the nodes run it: without PYTHONPATH (a checkout's tests may set it to the checkout).
        no_apiary = subprocess.run(
            [str(cluster.python), "-c", "import trainers"],
            cwd=tmp_path,
            capture_output=True,
            check=False,
            env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
        )
        assert no_apiary.returncode != 0, "the nodes' interpreter must not have Apiary installed"

        killed_at = time.time()
        cluster.nodes[1].kill()
        wait_until(
            lambda: "node2" not in cluster.alive_nodes(), timeout_s=60, what="Ray declaring node2 dead"
        )

        def requeued() -> Any:
            current = client.get(job.id)
            assert current.state not in ("failed", "succeeded", "cancelled"), current
            return current if current.state == "queued" else None

        waiting = wait_until(requeued, timeout_s=120, interval_s=0.5, what="the job requeued")
        requeued_s = time.time() - killed_at
        said = [event.reason for event in client.events(job.id)]
        # Running: stopped, then requeued ("capacity lost; requeued ..."); or, when the driver died
        # with the node and its recovery could not start: "capacity lost: ...; requeued ...".
        assert any(r.startswith("capacity lost") and "requeued in its place" in r for r in said), said
        # Capacity follows the nodes: with one node left, the gang waits, and says why.
        wait_until(lambda: client.get(job.id).waiting_reason, timeout_s=30, what="a waiting reason")
        assert client.get(job.id).state == "queued", waiting

        cluster.add_node("node3", num_cpus=2)  # a node joins: the job resumes
        joined_at = time.time()
        third = cluster.alive_nodes()["node3"]

        # With notice: node3 drains with a 60 s deadline while the job runs there.
        def at_drain_step() -> Any:
            current = client.get(job.id)
            assert current.state in ("queued", "admitted", "running"), current
            # The resumed attempt's ranks (the job's latest_step is the old attempt's until they report).
            steps = [rank["step"] for rank in (current.ranks or {}).values()]
            past = current.attempt > running.attempt and steps and min(steps) >= DRAIN_AFTER
            return current if past else None

        before_drain = wait_until(at_drain_step, timeout_s=400, interval_s=0.2, what="the drain step")
        placed = {rank["node"].split("(")[1].rstrip(")") for rank in (before_drain.ranks or {}).values()}
        assert third[:8] in placed, before_drain.ranks
        step_at_drain = max(rank["step"] for rank in (before_drain.ranks or {}).values())
        drained_at = time.time()
        # A termination handler tells Apiary, which records the drain and asks Ray to drain the node.
        answer = httpx.post(
            f"{served.url}/admin/nodes/{third}/drain", json={"deadline_s": DRAIN_DEADLINE_S}, timeout=30
        )
        assert answer.status_code == 202 and answer.json()["ray_drain"] == "accepted", answer.text
        cluster.add_node("node4", num_cpus=2)  # its replacement joins while it drains

        def told() -> Any:
            # The drain's event (the job may be running again already, on node4, by the time node4 is up).
            events = client.events(job.id)
            return next((e for e in events if e.reason.startswith(f"node {third[:8]} drains")), None)

        noticed_s = (
            wait_until(told, timeout_s=30, interval_s=0.2, what="the job told").at.timestamp() - drained_at
        )
        killed_drained = False

        def done() -> Any:
            nonlocal killed_drained
            if not killed_drained and time.time() >= drained_at + DRAIN_DEADLINE_S:
                cluster.nodes[2].kill()  # the deadline: the cloud takes the node (Ray may have let it go)
                killed_drained = True
            current = client.get(job.id)
            return current if current.state in ("succeeded", "failed", "cancelled") else None

        job = wait_until(done, timeout_s=400, interval_s=0.5, what="the job's end")
        assert job.state == "succeeded", job
        assert job.latest_checkpoint_step == STEPS
        assert job.latest_checkpoint is not None and job.latest_checkpoint.startswith(s3.checkpoints_uri)
        if not killed_drained:
            time.sleep(max(0.0, drained_at + DRAIN_DEADLINE_S - time.time()))
            cluster.nodes[2].kill()

        said = [event.reason for event in client.events(job.id)]
        drain_told = next(r for r in said if r.startswith(f"node {third[:8]} drains (deadline "))
        assert "checkpoint at the next step boundary" in drain_told, said
        requeued_after_drain = next(r for r in said if r.startswith("its node drains; requeued in its place"))
        assert requeued_after_drain.endswith("checkpointed and stopped, 0 step(s) lost"), said

        points = client.metrics(job.id, rank=0, segments="all")
        before = [p.step for p in points if p.time < killed_at]
        broken = (running.attempt, max(p.segment for p in points if p.time < killed_at))
        after = sorted((p for p in points if (p.attempt, p.segment) > broken), key=lambda p: p.time)
        resumed_at, first_step = after[0].time, after[0].step
        lost_without_notice = max(before) - (first_step - 1)
        # With notice: the drained attempt's last step is where the next one resumes.
        drained_attempt = max(p.attempt for p in points if p.time < drained_at)
        last_drained = max(p.step for p in points if p.attempt == drained_attempt)
        later = sorted((p for p in points if p.attempt > drained_attempt), key=lambda p: p.time)
        lost_with_notice = last_drained - (later[0].step - 1)
        # Not a step lost: it checkpointed at a step boundary after the drain, not at its periodic 100.
        resumed_from = later[0].step - 1
        assert lost_with_notice == 0 and resumed_from >= step_at_drain, later[0]
        final = client.get(job.id)
        nodes_then = {rank["node"].split("(")[1].rstrip(")") for rank in (final.ranks or {}).values()}
        assert third[:8] not in nodes_then, final.ranks  # no gang was placed on the draining node
        print(
            f"\nmultinode recovery: node death to first step after resume {resumed_at - killed_at:.1f} s "
            f"(requeued {requeued_s:.1f} s after the death; first step {resumed_at - joined_at:.1f} s after "
            f"a new node joined), steps lost {lost_without_notice} (last step before the kill "
            f"{max(before)}, resumed at step {first_step})"
            f"\nmultinode drain: told to checkpoint {noticed_s:.1f} s after the drain, first step after the "
            f"resume {later[0].time - drained_at:.1f} s after it; steps lost with a {DRAIN_DEADLINE_S} s "
            f"notice {lost_with_notice} (step {step_at_drain} when drained, checkpointed at "
            f"{resumed_from}), without notice {lost_without_notice}"
        )

        reference = client.wait(client.submit(spec(dataset, "undisturbed")).id, timeout_s=400)
        assert reference.state == "succeeded", reference
        # The loss at every step, as the run that counted took it, is the undisturbed run's.
        losses = [p.values["loss"] for p in client.metrics(job.id, rank=0, limit=STEPS)]
        assert losses == [p.values["loss"] for p in client.metrics(reference.id, rank=0, limit=STEPS)]
        assert len(losses) == STEPS

        # A missing S3 dataset is refused at submission (listed by the service), like a local one.
        with pytest.raises(ApiaryClientError) as refused:
            client.submit(spec(f"{s3.datasets_uri}/missing", "missing"))
        assert refused.value.status_code == 422 and "does not exist" in refused.value.message
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in served.log.read_text()

    assert reference.latest_checkpoint is not None
    final = build_model_from_checkpoint(job.latest_checkpoint, s3_endpoint_url=s3.endpoint_url).state_dict()
    expected = build_model_from_checkpoint(
        reference.latest_checkpoint, s3_endpoint_url=s3.endpoint_url
    ).state_dict()
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], tensor) for name, tensor in expected.items())


LABCODE = """
import json
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs
import ray
import ray.train


def train(config=None):
    rank = ray.train.get_context().get_world_rank()
    # Read from the job's working folder, which is its code: where to say what this rank saw.
    where = json.loads(Path("labcode/where.json").read_text())
    endpoint = urlparse(where["endpoint"])
    s3 = pyarrow.fs.S3FileSystem(endpoint_override=endpoint.netloc, scheme=endpoint.scheme)
    seen = {"node": ray.get_runtime_context().get_node_id(), "module": __file__}
    with s3.open_output_stream(f"{where['out'].removeprefix('s3://')}/rank-{rank}.json") as out:
        out.write(json.dumps(seen).encode())
    ray.train.report({"loss": 0.0})
"""


def test_a_job_brings_its_own_code_to_nodes_that_have_neither_apiary_nor_it(
    cluster: RayCluster, served: Served, s3: S3, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    (code / "labcode").mkdir(parents=True)
    (code / "labcode" / "__init__.py").write_text("")
    (code / "labcode" / "train.py").write_text(LABCODE)
    out = f"{s3.datasets_uri}/own-code-out"
    (code / "labcode" / "where.json").write_text(json.dumps({"endpoint": s3.endpoint_url, "out": out}))
    (code / "data").mkdir()
    (code / "data" / "large.bin").write_bytes(b"\0" * 4096)
    (code / ".apiaryignore").write_text("data/\n")
    dataset = f"{s3.datasets_uri}/code-clf"
    write_shards(
        classification_table(num_rows=64, num_features=8, num_classes=3),
        dataset,
        num_shards=2,
        s3_endpoint_url=s3.endpoint_url,
    )
    nodes = cluster.alive_nodes()
    job_spec = {
        **spec(dataset, "own-code"),
        "trainer": "labcode.train:train",
        "max_steps": 1,
        "checkpoint": {},
        "max_failures": 0,
        "config": {},
    }
    with ApiaryClient(served.url) as client:
        job = client.submit(job_spec, code=code)
        digest = pack(code).digest
        assert job.spec.code == digest
        job = client.wait(job.id, timeout_s=400)
        assert job.state == "succeeded", (job, client.logs(job.id)[-3000:])
        # Each rank, one on each node, imported the module from the job's code and read a file of it.
        path, filesystem = resolve_uri(out, s3_endpoint_url=s3.endpoint_url)
        seen = {}
        for rank in (0, 1):
            with filesystem.open_input_stream(f"{path}/rank-{rank}.json") as stream:
                seen[rank] = json.loads(stream.read())
        assert {entry["node"] for entry in seen.values()} == {nodes["head"], nodes["node2"]}, seen
        assert all("working_dir_files" in entry["module"] for entry in seen.values()), seen
        ray_job = httpx.get(
            f"{cluster.dashboard_url}/api/jobs/{job.ray_submission_id}",
            headers={"Authorization": f"Bearer {cluster.token}"},
            timeout=10,
        ).json()
        assert ray_job["runtime_env"]["working_dir"].startswith("gcs://_ray_pkg_"), ray_job["runtime_env"]
        assert client.code(job.id) == pack(code).data
        assert any(event.reason.startswith(f"code {digest}") for event in client.events(job.id))
    no_code = subprocess.run(
        [str(cluster.python), "-c", "import labcode"], cwd=tmp_path, capture_output=True, check=False
    )
    assert no_code.returncode != 0, "the nodes' interpreter must not have the job's code"
