"""The share-first policy (`service.scheduling.share_first`), rule by rule, on small GPU clusters."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from service.capacity import ClusterSnapshot, Gang, NodeCapacity
from service.contract.queues import QueuesConfig
from service.scheduling.share_first import best_fit, decide_share_first

NOW = 1_000_000.0
QUEUES = QueuesConfig.model_validate(
    {"research": {"share": 0.5, "min_runtime_s": 0}, "full-scale": {"share": 0.5, "min_runtime_s": 600}}
)


def cluster(nodes: int, gpus: float = 8) -> ClusterSnapshot:
    return ClusterSnapshot(
        nodes=tuple(NodeCapacity(node_id=f"n{i}", resources={"GPU": gpus}) for i in range(nodes))
    )


def gang(job_id: int, gpus: float, *, queue: str = "research", workers: int = 1, **fields: Any) -> Gang:
    return Gang(
        job_id=job_id,
        queue=queue,
        priority=0,
        num_workers=workers,
        per_worker={"GPU": gpus},
        submitted_at=fields.pop("submitted_at", NOW - 100 + job_id),
        **fields,
    )


def running(job_id: int, gpus: float, node: int, *, ran_s: float = 3600, **fields: Any) -> Gang:
    workers = fields.pop("workers", 1)
    return gang(
        job_id,
        gpus,
        workers=workers,
        started_at=NOW - ran_s,
        placement=tuple(range(node, node + workers)),
        **fields,
    )


def test_research_within_its_share_goes_before_earlier_full_scale_jobs() -> None:
    # One node free of two; a full-scale job (8 GPUs) was submitted before a research job (8 GPUs).
    decisions = decide_share_first(
        cluster=cluster(2),
        queued=[gang(1, 8, queue="full-scale"), gang(2, 8)],
        active=[running(9, 8, 0, queue="full-scale")],
        now=NOW,
        queues=QUEUES,
    )
    assert decisions.admit == (2,) and decisions.placements[2] == (1,)


def test_everything_else_is_greedy_research_beyond_its_share_first() -> None:
    # Research holds its share (8 of 16); 8 GPUs free: a research job beyond its share (4 GPUs) goes
    # before an earlier full-scale job (8 GPUs), and a later small full-scale job fits beside it.
    decisions = decide_share_first(
        cluster=cluster(2),
        queued=[gang(1, 8, queue="full-scale"), gang(2, 4), gang(3, 4, queue="full-scale")],
        active=[running(9, 8, 0)],
        now=NOW,
        queues=QUEUES,
    )
    assert decisions.admit == (2, 3) and not decisions.preempt


def test_research_reclaims_at_the_next_checkpoint_the_fewest_gpus_and_spares_young_jobs() -> None:
    # Full-scale borrows: 12 GPUs of 16 (share 8); research holds 4 and asks for 4 more.
    active = [
        running(10, 4, 0, queue="full-scale"),  # node 0, old: enough for a 4-GPU research job
        running(11, 4, 0, queue="full-scale", ran_s=60),  # node 0, young: protected
        running(12, 4, 1, queue="full-scale"),  # node 1, old
        running(13, 4, 1),  # research, node 1
    ]
    decisions = decide_share_first(
        cluster=cluster(2), queued=[gang(1, 4)], active=active, now=NOW, queues=QUEUES
    )
    assert decisions.admit == ()
    assert [(p.job_id, p.for_job, p.at_checkpoint) for p in decisions.preempt] == [(10, 1, True)]
    # Once job 10 is stopping, the head waits for it: no second victim.
    stopping = [replace(active[0], stopping=True, stops_at=NOW + 900), *active[1:]]
    again = decide_share_first(
        cluster=cluster(2), queued=[gang(1, 4)], active=stopping, now=NOW, queues=QUEUES
    )
    assert again.preempt == () and again.admit == ()


def test_no_reclaim_while_full_scale_holds_only_its_share() -> None:
    active = [running(10, 8, 0, queue="full-scale"), running(11, 8, 1)]
    decisions = decide_share_first(
        cluster=cluster(2), queued=[gang(1, 4)], active=active, now=NOW, queues=QUEUES
    )
    assert decisions.preempt == () and decisions.admit == ()


def test_best_fit_keeps_whole_nodes_free() -> None:
    free = [{"GPU": 8.0}, {"GPU": 2.0}, {"GPU": 8.0}]
    assert [index for index, _ in best_fit(free, [{"GPU": 2.0}])] == [1]
    assert best_fit(free, [{"GPU": 8.0}] * 3) == [] and free == [{"GPU": 8.0}, {"GPU": 0.0}, {"GPU": 8.0}]


def test_an_oversize_job_that_waited_4_hours_gets_a_reservation() -> None:
    # 2 nodes; a full-scale job of 16 GPUs (larger than full-scale's share of 8) waited 5 h. Node 0
    # runs a job expected to end in 1 h; node 1 is free. A research job of 8 GPUs expected to run 2 h
    # would eat into the reservation and waits; one expected to end within the hour starts.
    big = gang(1, 8, queue="full-scale", workers=2, submitted_at=NOW - 5 * 3600)
    active = [running(10, 8, 0, queue="full-scale", expected_end_at=NOW + 3600)]
    long = gang(2, 8, estimated_runtime_s=7200, submitted_at=NOW - 50)
    short = gang(3, 8, estimated_runtime_s=1800, submitted_at=NOW - 40)
    blocked = decide_share_first(
        cluster=cluster(2), queued=[big, long], active=active, now=NOW, queues=QUEUES
    )
    assert blocked.admit == ()
    fits = decide_share_first(cluster=cluster(2), queued=[big, short], active=active, now=NOW, queues=QUEUES)
    assert fits.admit == (3,)
    # Before 4 h of waiting, nothing is reserved: the long research job starts.
    young = gang(1, 8, queue="full-scale", workers=2, submitted_at=NOW - 3600)
    free = decide_share_first(cluster=cluster(2), queued=[young, long], active=active, now=NOW, queues=QUEUES)
    assert free.admit == (2,)
