from __future__ import annotations

from service.jobs import gang_for
from service.policy import ClusterSnapshot, Gang, NodeCapacity, decide, fits_empty_cluster
from service.spec import JobSpec


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


def elastic(job_id: int, low: int, high: int, *, extra: float = 0) -> Gang:
    return Gang(
        job_id=job_id,
        queue="research",
        priority=0,
        num_workers=low,
        max_workers=high,
        per_worker={"CPU": 1},
        extra={"CPU": extra},
    )


def test_elastic_gang_is_admitted_when_its_min_fits() -> None:
    decisions = decide(cluster=cluster(4), queued=[elastic(1, 2, 8, extra=1)], active=[], now=0)
    assert decisions.admit == (1,)
    assert fits_empty_cluster(cluster(3), elastic(1, 2, 8, extra=1))
    assert not fits_empty_cluster(cluster(2), elastic(1, 2, 8, extra=1))


def test_active_elastic_gang_holds_what_it_may_grow_into() -> None:
    # Job 1 runs at 2..6 workers on 8 CPU: Ray may grow it to 6, so only 2 CPU are promised to others.
    decisions = decide(cluster=cluster(8), queued=[gang(2, 3), gang(3, 2)], active=[elastic(1, 2, 6)], now=0)
    assert decisions.admit == ()
    assert "needs 3 CPU; free now 2 CPU" in decisions.waiting[2]
    # Fixed active gangs are placed before any growth: growth never pushes them off their nodes.
    decisions = decide(cluster=cluster(8), queued=[gang(3, 2)], active=[elastic(1, 2, 6), gang(2, 4)], now=0)
    assert decisions.admit == ()
    assert "free now nothing" in decisions.waiting[3]


def test_gang_for_an_elastic_spec_needs_its_min_and_may_grow_to_its_max() -> None:
    base = {
        "name": "elastic",
        "trainer": "gpt",
        "dataset": {"uri": "file:///data"},
        "max_steps": 1,
        "batch_size": 1,
        "config": {"vocab_size": 8},
    }
    elastic_gang = gang_for(
        7, JobSpec.model_validate({**base, "num_workers": {"min": 2, "max": 5}}), data_cpus=1
    )
    assert (elastic_gang.num_workers, elastic_gang.max_workers) == (2, 5)
    assert elastic_gang.total() == {"CPU": 3.0} and len(elastic_gang.growth()) == 3
    fixed_gang = gang_for(8, JobSpec.model_validate({**base, "num_workers": 2}), data_cpus=1)
    assert (fixed_gang.num_workers, fixed_gang.max_workers, fixed_gang.growth()) == (2, None, [])
