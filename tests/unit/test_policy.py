"""The two-queue policy (`service.scheduling.policy.decide`), rule by rule, on small hand-made clusters.

Unless a test says otherwise the queues are research 0.3 / full-scale 0.7 of the cluster, both may
borrow, and neither has a minimum runtime.
"""

from __future__ import annotations

from typing import Any

from service.capacity import ClusterSnapshot, Gang, NodeCapacity, fits_empty_cluster
from service.contract.queues import QueuesConfig
from service.contract.spec import JobSpec
from service.jobs import gang_for
from service.scheduling.policy import decide, decide_fifo, decide_greedy

NOW = 1_000_000.0


def queues(**overrides: Any) -> QueuesConfig:
    values: dict[str, Any] = {
        "research": {"share": 0.3, "min_runtime_s": 0},
        "full-scale": {"share": 0.7, "min_runtime_s": 0},
    }
    for queue, fields in overrides.items():
        values[queue.replace("_", "-")] = {**values[queue.replace("_", "-")], **fields}
    return QueuesConfig.model_validate(values)


QUEUES = queues()


def cluster(*cpus: float) -> ClusterSnapshot:
    return ClusterSnapshot(
        nodes=tuple(NodeCapacity(node_id=f"n{i}", resources={"CPU": c}) for i, c in enumerate(cpus))
    )


def gang(job_id: int, workers: int, cpu: float = 1, *, queue: str = "research", **fields: Any) -> Gang:
    extra = fields.pop("extra", 0)
    return Gang(
        job_id=job_id,
        queue=queue,
        priority=fields.pop("priority", 0),
        num_workers=workers,
        per_worker={"CPU": cpu},
        extra={"CPU": extra},
        submitted_at=fields.pop("submitted_at", float(job_id)),
        **fields,
    )


def running(
    job_id: int, workers: int, *, queue: str = "research", ran_s: float = 3600, **fields: Any
) -> Gang:
    """An active job that started `ran_s` ago."""
    return gang(job_id, workers, queue=queue, started_at=NOW - ran_s, **fields)


def run(nodes: ClusterSnapshot, queued: list[Gang], active: list[Gang] = [], **kwargs: Any) -> Any:  # noqa: B006 (read only)
    return decide(
        cluster=nodes, queued=queued, active=active, now=NOW, queues=kwargs.pop("queues", QUEUES), **kwargs
    )


# -- capacity --------------------------------------------------------------------------------------


def test_per_node_packing_not_just_the_sum() -> None:
    # 2 nodes x 3 CPU = 6 CPU in total, but a 2-CPU worker fits only once per node.
    assert not fits_empty_cluster(cluster(3, 3), gang(1, 3, cpu=2))
    assert fits_empty_cluster(cluster(3, 3), gang(1, 2, cpu=2))


def test_data_cpus_are_part_of_the_gang() -> None:
    assert fits_empty_cluster(cluster(3), gang(1, 2, extra=1))
    assert not fits_empty_cluster(cluster(3), gang(1, 3, extra=1))


def test_a_strict_spread_gang_takes_one_node_per_worker() -> None:
    spec = JobSpec.model_validate(
        {
            "name": "spread",
            "trainer": "mlp",
            "num_workers": 2,
            "placement": "strict_spread",
            "dataset": {"uri": "file:///unused"},
            "max_steps": 1,
            "batch_size": 1,
            "config": {"task": "classification", "num_classes": 2},
        }
    )
    spread = gang_for(1, spec, data_cpus=1)
    packed = gang_for(1, spec.model_copy(update={"placement": "pack"}), data_cpus=1)
    assert fits_empty_cluster(cluster(8), packed) and not fits_empty_cluster(cluster(8), spread)
    assert fits_empty_cluster(cluster(2, 1), spread)  # a worker on each node; data beside the first
    assert spread.shape != packed.shape
    # Admission agrees: with one of two nodes taken, the packed gang starts, the spread one waits.
    taken = [running(9, 1, cpu=4)]
    assert run(cluster(4, 4), [packed], taken).admit == (1,)
    assert run(cluster(4, 4), [spread], taken).admit == ()
    assert run(cluster(4, 4), [spread]).admit == (1,)


def test_resources_the_cluster_lacks_never_fit() -> None:
    gpu = Gang(job_id=1, queue="research", priority=0, num_workers=1, per_worker={"CPU": 1, "GPU": 1})
    assert not fits_empty_cluster(cluster(8), gpu)


def test_active_gangs_hold_their_resources_and_nothing_is_over_committed() -> None:
    decisions = run(cluster(4, 4), [gang(i, 2, queue="full-scale") for i in range(2, 7)], [running(1, 2)])
    assert decisions.admit == (2, 3, 4)
    assert decisions.waiting[5].position == 1 and decisions.waiting[6].position == 2


# -- 1. order within a queue -------------------------------------------------------------------------


def test_priority_then_fair_share_then_submission_time() -> None:
    line = [
        gang(1, 1, owner="ada", submitted_at=1),
        gang(2, 1, owner="bob", submitted_at=2),
        gang(3, 1, owner="ada", submitted_at=3, priority=5),
    ]
    # One free CPU at a time: the order shows as positions.
    decisions = run(cluster(1), line, [running(9, 1, queue="full-scale", expected_end_at=NOW + 60)])
    order = sorted(decisions.waiting, key=lambda job: decisions.waiting[job].position)
    assert order == [3, 1, 2]  # priority first, then submission
    decisions = run(
        cluster(1), line, [running(9, 1, queue="full-scale", expected_end_at=NOW + 60)], usage={"ada": 1e6}
    )
    order = sorted(decisions.waiting, key=lambda job: decisions.waiting[job].position)
    assert order == [3, 2, 1]  # bob, who used less recently, goes before ada at the same priority


# -- 2. guaranteed shares and borrowing ----------------------------------------------------------------


def test_each_queue_starts_within_its_share() -> None:
    decisions = run(cluster(10), [gang(1, 3), gang(2, 7, queue="full-scale")])
    assert sorted(decisions.admit) == [1, 2]


def test_a_queue_borrows_what_the_other_leaves_idle_unless_told_not_to() -> None:
    assert run(cluster(10), [gang(1, 6)]).admit == (1,)  # research share is 3 CPU
    no_borrow = queues(research={"may_borrow": False})
    decisions = run(cluster(10), [gang(1, 6)], queues=no_borrow)
    assert decisions.admit == ()
    assert "queue research uses nothing of its share 3 CPU" in decisions.waiting[1].reason
    assert "may not borrow" in decisions.waiting[1].reason


# -- 3. reclaim by preemption ---------------------------------------------------------------------


def test_a_queue_takes_its_share_back_by_preempting_the_borrower_that_loses_least() -> None:
    # Research borrows: 8 of 10 CPU in four jobs; full-scale's 4-CPU job is within its share of 7.
    active = [
        running(1, 2, last_checkpoint_at=NOW - 600),  # 10 minutes of work since its checkpoint
        running(2, 2, last_checkpoint_at=NOW - 60),  # 1 minute: the cheapest victim
        running(4, 2, last_checkpoint_at=NOW - 300),
        running(5, 2),  # no checkpoint: an hour since its start
    ]
    decisions = run(cluster(10), [gang(3, 4, queue="full-scale")], active)
    assert [p.job_id for p in decisions.preempt] == [2]
    assert decisions.preempt[0].for_job == 3 and "takes back its share" in decisions.preempt[0].reason
    assert decisions.admit == ()
    assert "preempting job(s) 2" in decisions.waiting[3].reason
    # With 6 CPU to find, the next cheapest goes too.
    decisions = run(cluster(10), [gang(3, 6, queue="full-scale")], active)
    assert [p.job_id for p in decisions.preempt] == [2, 4]


def test_stopping_jobs_count_as_free_so_a_head_preempts_once() -> None:
    active = [running(1, 4), running(2, 4, stopping=True)]
    decisions = run(cluster(10), [gang(3, 6, queue="full-scale")], active)
    assert decisions.preempt == ()
    assert "waiting for job(s) 2 to checkpoint and stop" in decisions.waiting[3].reason


def test_no_preemption_of_a_young_job_a_higher_priority_or_one_larger_than_its_share() -> None:
    head = [gang(3, 6, queue="full-scale", priority=1)]
    young = run(
        cluster(10),
        head,
        [running(1, 3, ran_s=10), running(2, 3, ran_s=10)],
        queues=queues(research={"min_runtime_s": 300}),
    )
    assert young.preempt == () and "have not run their minimum runtime" in young.waiting[3].reason
    higher = run(cluster(10), head, [running(1, 3, priority=5), running(2, 3, priority=5)])
    assert higher.preempt == ()
    # One research job of 8 CPU is larger than research's share (3): it runs only on borrowed capacity.
    large = run(cluster(10), head, [running(1, 8)])
    assert large.preempt == () and "larger than their queue's share" in large.waiting[3].reason


def test_no_victim_is_chosen_unless_the_victims_make_the_head_fit() -> None:
    # Two nodes of 8. Research (share 4.8 CPU) borrows with two 4-CPU jobs on node a; full-scale holds 4
    # on node b and wants one more worker of 7 CPU, within its share of 11.2.
    active = [running(1, 1, cpu=4), running(2, 1, cpu=4), running(4, 1, cpu=4, queue="full-scale")]
    decisions = run(cluster(8, 8), [gang(3, 1, cpu=7, queue="full-scale")], active)
    # Preempting job 1 would leave 4 + 4 CPU on two nodes (no node of 7) and research within its share,
    # so job 2 may not go too: nobody is preempted for nothing.
    assert decisions.preempt == ()
    assert "preempting cannot make room now" in decisions.waiting[3].reason


def test_preemption_takes_only_what_the_other_queue_borrows() -> None:
    # Research holds 3 jobs of 2 CPU; full-scale wants 7 of 10 (its whole share).
    active = [running(1, 2, ran_s=100), running(2, 2, ran_s=200), running(3, 2, ran_s=300)]
    decisions = run(cluster(10), [gang(4, 7, queue="full-scale")], active)
    assert [p.job_id for p in decisions.preempt] == [1, 2]  # 4 free + 2 + 2 >= 7
    # With shares of 4 and 6 CPU, one victim gives the head its 6.
    decisions = run(
        cluster(10),
        [gang(4, 6, queue="full-scale")],
        active,
        queues=queues(research={"share": 0.4}, full_scale={"share": 0.6}),
    )
    assert [p.job_id for p in decisions.preempt] == [1]


def test_a_head_waits_for_a_borrower_that_ends_soon_instead_of_preempting_it() -> None:
    patient = queues(full_scale={"reclaim_after_s": 600})
    head = [gang(3, 6, queue="full-scale")]
    soon = [running(1, 2), running(2, 2), running(4, 2, expected_end_at=NOW + 300)]
    decisions = run(cluster(10), head, soon, queues=patient)
    assert decisions.preempt == () and decisions.waiting[3].eta == NOW + 300
    later = [running(1, 2), running(2, 2), running(4, 2, expected_end_at=NOW + 1200)]
    assert [p.job_id for p in run(cluster(10), head, later, queues=patient).preempt] == [1]


# -- 4. reservations and 5. backfill ---------------------------------------------------------------


def test_the_head_reserves_the_earliest_time_it_fits_and_backfill_must_end_before_it() -> None:
    # Full-scale holds 6 of 8 CPU until NOW + 600; its next job needs all 8.
    active = [running(1, 6, queue="full-scale", expected_end_at=NOW + 600)]
    long = gang(3, 2, queue="full-scale", max_runtime_s=3600)
    short = gang(4, 2, queue="full-scale", max_runtime_s=300)
    decisions = run(cluster(8), [gang(2, 8, queue="full-scale"), long, short], active)
    assert decisions.reserve[0].job_id == 2 and decisions.reserve[0].at == NOW + 600
    assert decisions.admit == (4,)  # ends before the reservation; job 3 would run past it
    assert decisions.waiting[2].eta == NOW + 600 and "reserved from" in decisions.waiting[2].reason
    assert "would run past job 2's reservation" in decisions.waiting[3].reason
    assert decisions.waiting[3].position == 2


def test_backfill_may_use_what_the_reservation_leaves_over() -> None:
    # Node a (8 CPU) is busy until NOW + 600, node b has 4 of 8 free until NOW + 900. The head needs one
    # worker of 6 CPU: node a at NOW + 600. Node b's free 4 CPU are not part of that: an endless job
    # may start there now.
    active = [
        running(1, 1, cpu=8, queue="full-scale", expected_end_at=NOW + 600),
        running(9, 1, cpu=4, queue="full-scale", expected_end_at=NOW + 900),
    ]
    decisions = run(
        cluster(8, 8), [gang(2, 1, cpu=6, queue="full-scale"), gang(3, 1, cpu=4, queue="full-scale")], active
    )
    assert decisions.reserve[0].at == NOW + 600 and decisions.admit == (3,)


def test_the_other_queue_within_its_share_is_not_bound_by_a_reservation_but_a_borrower_is() -> None:
    active = [running(1, 6, queue="full-scale", expected_end_at=NOW + 600)]
    head = gang(2, 8, queue="full-scale")  # reserves all 10 CPU from NOW + 600
    within = gang(3, 2)  # research, within its share of 3
    decisions = run(cluster(10), [head, within], active)
    assert 3 in decisions.admit
    borrower = gang(4, 4)  # research past its share: may not eat into the reservation
    decisions = run(cluster(10), [head, borrower], active)
    assert decisions.admit == () and "would run past job 2's reservation" in decisions.waiting[4].reason
    short = gang(4, 4, max_runtime_s=60)
    assert run(cluster(10), [head, short], active).admit == (4,)


def test_a_head_larger_than_its_share_binds_the_other_queue_too() -> None:
    # Full-scale's share is 7 of 10; its head wants all 10 when job 1 ends. Research backfills around it.
    active = [running(1, 4, queue="full-scale", expected_end_at=NOW + 600)]
    head = gang(2, 10, queue="full-scale")
    decisions = run(cluster(10), [head, gang(3, 2)], active)
    assert decisions.admit == () and "would run past job 2's reservation" in decisions.waiting[3].reason
    assert run(cluster(10), [head, gang(3, 2, max_runtime_s=300)], active).admit == (3,)


def test_a_head_without_any_known_end_blocks_the_line_behind_it() -> None:
    decisions = run(cluster(4), [gang(1, 5, queue="full-scale"), gang(2, 1, queue="full-scale")])
    assert decisions.admit == ()
    assert decisions.reserve[0].at is None
    assert "no running job is known to end" in decisions.waiting[1].reason
    assert "waiting behind job 1" in decisions.waiting[2].reason


# -- 6. positions, reasons and ETAs ---------------------------------------------------------------


def test_every_waiting_job_has_a_position_a_reason_and_an_eta_when_something_ends() -> None:
    active = [running(1, 8, queue="full-scale", expected_end_at=NOW + 100)]
    line = [gang(i, 4, queue="full-scale", max_runtime_s=50) for i in range(2, 6)]
    decisions = run(cluster(8), line, active)
    assert decisions.admit == ()
    assert [decisions.waiting[i].position for i in range(2, 6)] == [1, 2, 3, 4]
    assert decisions.waiting[2].reason.startswith(
        "needs 4 worker(s) x 1 CPU; free now nothing; reserved from"
    )
    assert decisions.waiting[5].reason == "waiting behind job 2 (head of queue full-scale)"
    # Two 4-CPU jobs at a time on 8 CPU, 50 s each, from NOW + 100.
    assert [decisions.waiting[i].eta for i in range(2, 6)] == [NOW + 100, NOW + 100, NOW + 150, NOW + 150]


def test_etas_when_running_jobs_without_a_known_end_come_first_and_ends_tie() -> None:
    active = [
        running(1, 4, queue="full-scale"),  # no known end
        running(2, 4, queue="full-scale", expected_end_at=NOW + 100),
        running(3, 4, queue="full-scale", expected_end_at=NOW + 200),
    ]
    line = [gang(4, 3, queue="full-scale", max_runtime_s=100), gang(5, 4, queue="full-scale")]
    decisions = run(cluster(12), line, active)  # job 4 would end when job 3 does
    assert [decisions.waiting[i].eta for i in (4, 5)] == [NOW + 100, NOW + 200]


def test_the_same_inputs_give_the_same_decisions() -> None:
    active = [running(1, 4, last_checkpoint_at=NOW - 60), running(2, 4)]
    queued = [gang(i, 2, queue="full-scale" if i % 2 else "research") for i in range(3, 12)]
    assert run(cluster(10), queued, active) == run(cluster(10), queued, active)


# -- elastic gangs -------------------------------------------------------------------------------------


def elastic(job_id: int, low: int, high: int, *, extra: float = 0, **fields: Any) -> Gang:
    return Gang(
        job_id=job_id,
        queue="full-scale",
        priority=0,
        num_workers=low,
        max_workers=high,
        per_worker={"CPU": 1},
        extra={"CPU": extra},
        **fields,
    )


def test_elastic_gang_is_admitted_when_its_min_fits() -> None:
    decisions = run(cluster(4), [elastic(1, 2, 8, extra=1)])
    assert decisions.admit == (1,)
    assert fits_empty_cluster(cluster(3), elastic(1, 2, 8, extra=1))
    assert not fits_empty_cluster(cluster(2), elastic(1, 2, 8, extra=1))


def test_active_elastic_gang_holds_what_it_may_grow_into() -> None:
    # Job 1 runs at 2..6 workers on 8 CPU: Ray may grow it to 6, so only 2 CPU are promised to others.
    decisions = run(cluster(8), [gang(2, 3, queue="full-scale")], [elastic(1, 2, 6, started_at=NOW)])
    assert decisions.admit == ()
    assert "free now 2 CPU" in decisions.waiting[2].reason
    # Fixed active gangs are placed before any growth: growth never pushes them off their nodes.
    decisions = run(
        cluster(8), [gang(3, 2, queue="full-scale")], [elastic(1, 2, 6), running(2, 4, queue="full-scale")]
    )
    assert decisions.admit == ()
    assert "free now nothing" in decisions.waiting[3].reason


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


# -- the simulator's baselines ------------------------------------------------------------------------


def test_fifo_blocks_behind_its_head_and_greedy_does_not() -> None:
    line = [gang(1, 6), gang(2, 5), gang(3, 2)]
    assert decide_fifo(cluster=cluster(8), queued=line, active=[], now=NOW).admit == (1,)
    assert decide_greedy(cluster=cluster(8), queued=line, active=[], now=NOW).admit == (1, 3)


# -- shared clusters: what other Ray users hold ------------------------------------------------------


def shared(*nodes: tuple[float, float | None]) -> ClusterSnapshot:
    """Nodes of (CPU, CPU that Ray reports in use by anyone; None: not reported)."""
    return ClusterSnapshot(
        nodes=tuple(
            NodeCapacity(
                node_id=f"n{i}", resources={"CPU": cpu}, used=None if used is None else {"CPU": used}
            )
            for i, (cpu, used) in enumerate(nodes)
        )
    )


def test_what_other_ray_users_hold_is_not_free_and_the_reason_says_so() -> None:
    big = gang(1, 6, queue="full-scale")
    assert run(shared((4, 0), (4, 0)), [big]).admit == (1,)
    decisions = run(shared((4, 3), (4, 0)), [big])
    assert decisions.admit == () and decisions.foreign == {"CPU": 3}
    assert "free now 5 CPU (other Ray users hold 3 CPU)" in decisions.waiting[1].reason
    assert run(shared((4, 3), (4, 0)), [gang(2, 5, queue="full-scale")]).admit == (2,)
    # The baselines see the same capacity.
    assert decide_greedy(cluster=shared((4, 3), (4, 0)), queued=[big], active=[], now=NOW).admit == ()


def test_apiarys_own_gangs_in_rays_use_are_not_counted_twice() -> None:
    mine = running(1, 4, queue="full-scale")
    assert run(shared((8, 4)), [gang(2, 4, queue="full-scale")], [mine]).admit == (2,)
    decisions = run(shared((8, 6)), [gang(2, 4, queue="full-scale")], [mine])
    assert decisions.admit == () and decisions.foreign == {"CPU": 2}


def test_a_gang_admitted_but_not_yet_placed_by_ray_still_holds_its_capacity() -> None:
    starting = gang(1, 4, queue="full-scale")  # admitted: Ray reports none of it in use yet
    decisions = run(shared((8, 0)), [gang(2, 5, queue="full-scale")], [starting])
    assert decisions.admit == () and decisions.foreign == {}


def test_an_elastic_gangs_growth_in_rays_use_is_its_own() -> None:
    grown = elastic(1, 2, 4, started_at=NOW - 60)  # min 2, grew to 4 workers
    decisions = run(shared((8, 4)), [gang(2, 4, queue="full-scale")], [grown])
    assert decisions.admit == (2,) and decisions.foreign == {}


def test_other_users_use_lies_on_the_node_where_rays_use_exceeds_apiarys() -> None:
    mine = running(1, 4, queue="full-scale")  # placed on n0
    # Ray: n0 holds Apiary's 4 CPU, n1 holds 3 CPU of someone else's: a 2-CPU worker fits nowhere.
    two = Gang(job_id=2, queue="full-scale", priority=0, num_workers=1, per_worker={"CPU": 2}, submitted_at=2)
    decisions = run(shared((4, 4), (4, 3)), [two], [mine])
    assert decisions.admit == () and decisions.foreign == {"CPU": 3}
    assert run(shared((4, 4), (4, 2)), [two], [mine]).admit == (2,)


def test_without_rays_use_of_every_node_capacity_is_the_total_less_apiarys_gangs() -> None:
    assert run(shared((4, 3), (4, None)), [gang(1, 6, queue="full-scale")]).admit == (1,)
