from __future__ import annotations

from service.policy import ClusterSnapshot, Gang, NodeCapacity, decide, fits_empty_cluster


def cluster(*cpus: float) -> ClusterSnapshot:
    return ClusterSnapshot(
        nodes=tuple(NodeCapacity(node_id=f"n{i}", resources={"CPU": c}) for i, c in enumerate(cpus))
    )


def gang(job_id: int, workers: int, cpu: float = 1, *, extra: float = 0, priority: int = 0) -> Gang:
    return Gang(
        job_id=job_id,
        queue="research",
        priority=priority,
        num_workers=workers,
        per_worker={"CPU": cpu},
        extra={"CPU": extra},
    )


def test_admits_in_order_while_gangs_fit() -> None:
    decisions = decide(cluster=cluster(8), queued=[gang(1, 3), gang(2, 3), gang(3, 3)], active=[], now=0)
    assert decisions.admit == (1, 2)
    assert "needs 3 CPU; free now 2 CPU" in decisions.waiting[3]


def test_whole_gang_or_nothing_and_the_line_behind_waits() -> None:
    decisions = decide(cluster=cluster(4), queued=[gang(1, 5), gang(2, 1)], active=[], now=0)
    assert decisions.admit == ()  # job 2 would fit, but may not overtake the head of the line
    assert "waiting behind job 1" in decisions.waiting[2]


def test_active_gangs_hold_their_resources() -> None:
    decisions = decide(cluster=cluster(8), queued=[gang(2, 4)], active=[gang(1, 4, extra=1)], now=0)
    assert decisions.admit == ()
    assert "free now 3 CPU" in decisions.waiting[2]


def test_per_node_packing_not_just_the_sum() -> None:
    # 2 nodes x 3 CPU = 6 CPU in total, but a 2-CPU worker fits only once per node.
    assert not fits_empty_cluster(cluster(3, 3), gang(1, 3, cpu=2))
    assert fits_empty_cluster(cluster(3, 3), gang(1, 2, cpu=2))


def test_data_cpus_are_part_of_the_gang() -> None:
    assert fits_empty_cluster(cluster(3), gang(1, 2, extra=1))
    assert not fits_empty_cluster(cluster(3), gang(1, 3, extra=1))


def test_resources_the_cluster_lacks_never_fit() -> None:
    gpu = Gang(job_id=1, queue="research", priority=0, num_workers=1, per_worker={"CPU": 1, "GPU": 1})
    assert not fits_empty_cluster(cluster(8), gpu)
