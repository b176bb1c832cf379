"""Two `apiary serve` replicas behind a (fail-over) load balancer, on one PostgreSQL and one Ray
cluster: one schedules at a time, the other takes over within seconds when the leader is SIGKILLed,
no job is admitted twice, and the cluster is never over-committed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from api.client import ApiaryClient
from api.demo import classification_table, write_shards
from service.cluster import free_port
from tests.e2e.conftest import Served, start_serve, stop_serve
from tests.support.proxy import TcpProxy
from tests.support.wait import wait_until

pytestmark = [pytest.mark.timeout(420)]

# Each job is 1 worker of 3 CPUs + 1 data CPU on the local Ray's 8 CPUs: at most 2 at once, so that of
# the 3 jobs one waits for the new leader.
CAPACITY = 2
JOBS = 3


@pytest.fixture
def replicas(tmp_path: Path, postgres_url: str) -> Iterator[tuple[Served, Served, str]]:
    # Behind a load balancer, as in production: the trainers post their telemetry to its address
    # (APIARY_PUBLIC_URL), which reaches whichever replica is up.
    ports = (free_port(), free_port())
    balancer = TcpProxy("127.0.0.1", ports[0], fallbacks=[("127.0.0.1", ports[1])])
    public = {"APIARY_PUBLIC_URL": f"http://{balancer.address}"}
    first = start_serve(
        data_dir=tmp_path / "a", database_url=postgres_url, log=tmp_path / "a.log", port=ports[0], env=public
    )
    ray = first.ray_state()
    second = start_serve(
        data_dir=tmp_path / "b",
        database_url=postgres_url,
        log=tmp_path / "b.log",
        port=ports[1],
        env={
            **public,
            "APIARY_RAY_ADDRESS": ray["dashboard_url"],
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": ray["auth_token_path"],
        },
    )
    try:
        yield first, second, postgres_url
    finally:
        balancer.close()
        for served in (second, first):  # the first one owns the local Ray: it stops last
            if served.process.poll() is None:
                stop_serve(served)
        if first.process.returncode == -signal.SIGKILL:
            os.killpg(int(ray["pid"]), signal.SIGKILL)  # its Ray outlived it, by design


def lease_holder(database_url: str) -> str | None:
    engine = create_engine(database_url)
    with engine.connect() as connection:
        holder = connection.execute(text("SELECT holder, expires_at FROM scheduler_leases")).first()
    engine.dispose()
    return None if holder is None else str(holder[0])


def test_one_replica_schedules_and_the_other_takes_over_when_it_is_killed(
    replicas: tuple[Served, Served, str], tmp_path: Path
) -> None:
    first, second, database_url = replicas
    dataset = (tmp_path / "classes").as_uri()
    write_shards(classification_table(num_rows=256, num_features=8, num_classes=3), dataset, num_shards=2)
    spec: dict[str, Any] = {
        "name": "replica",
        "trainer": "mlp",
        "num_workers": 1,
        "resources_per_worker": {"CPU": 3},
        "dataset": {"uri": dataset},
        "max_steps": 10,
        "batch_size": 8,
        "config": {"num_classes": 3},
    }
    holder = wait_until(lambda: lease_holder(database_url), timeout_s=30, what="a scheduler lease")
    pids = {first.process.pid: first, second.process.pid: second}
    leader = next(served for pid, served in pids.items() if f":{pid}:" in holder)
    follower = second if leader is first else first

    with ApiaryClient(follower.url) as client:  # any replica takes submissions
        jobs = [client.submit({**spec, "name": f"replica-{i}"}).id for i in range(JOBS)]
        wait_until(
            lambda: sum(client.get(job).state != "queued" for job in jobs) >= 2,
            timeout_s=120,
            what="the first admissions",
        )
        killed_at = time.monotonic()
        leader.process.kill()  # SIGKILL: no clean shutdown, its lease just stops being renewed
        leader.process.wait(30)
        new_holder = wait_until(
            lambda: (h := lease_holder(database_url)) is not None and f":{follower.process.pid}:" in h and h,
            timeout_s=30,
            what="the follower taking the lease",
        )
        takeover_s = time.monotonic() - killed_at
        assert new_holder and takeover_s < 15, takeover_s
        finished = [client.wait(job, timeout_s=300) for job in jobs]
        assert all(job.state == "succeeded" for job in finished), [j.message for j in finished]
        events = {job: client.events(job) for job in jobs}

    # Never admitted twice: a job is admitted again only after it went back to the queue, which
    # happens when the leader died between admitting it and handing it to Ray (the new leader finds
    # no Ray job and requeues it). Only one attempt of each job ever runs.
    spans = []
    for job, job_events in events.items():
        states = [(event.from_state, event.to_state) for event in job_events]
        assert states.count(("admitted", "running")) == 1, (job, states)
        for i, event in enumerate(job_events):
            # An admission: a move into `admitted` (an event recorded while admitted, such as its
            # driver redeeming its credentials, goes from admitted to admitted).
            if event.to_state != "admitted" or event.from_state == "admitted":
                continue
            assert i == 0 or job_events[i - 1].to_state == "queued", (job, states)
            end = next(e for e in job_events[i + 1 :] if e.to_state in ("queued", "succeeded"))
            spans.append((event.at, end.at))
    # Never over-committed: at every admission, at most CAPACITY jobs were admitted or running.
    for start, _ in spans:
        assert sum(1 for other_start, other_end in spans if other_start <= start < other_end) <= CAPACITY
