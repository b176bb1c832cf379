"""The rules of node drains (service.drains): can a job checkpoint before its node goes, which drain a
job is under, and which deadline wins."""

from __future__ import annotations

import pytest

from service.drains import (
    NOTICE_S,
    SAFETY_FACTOR,
    STOP_MARGIN_S,
    UNMEASURED_WRITE_S,
    Drain,
    can_checkpoint_before,
    checkpoint_needs_s,
    drained_node,
    merge,
)

NODE_A = "4b50368f" + "0" * 48
NODE_B = "865b7c98" + "1" * 48


def test_a_job_needs_notice_two_steps_and_two_writes_and_the_stop_margin() -> None:
    needs = checkpoint_needs_s(step_s=0.5, write_s=2.0)
    assert needs == pytest.approx(NOTICE_S + SAFETY_FACTOR * 2.5 + STOP_MARGIN_S)
    assert checkpoint_needs_s(step_s=0.5, write_s=None) == pytest.approx(
        NOTICE_S + SAFETY_FACTOR * (0.5 + UNMEASURED_WRITE_S) + STOP_MARGIN_S
    )
    assert checkpoint_needs_s(step_s=None, write_s=2.0) is None


@pytest.mark.parametrize(
    ("left_s", "step_s", "write_s", "makes_it"),
    [
        (60, 0.2, 1.0, True),  # the drain test's case: a 60 s notice, short steps and writes
        (60, 10.0, 20.0, False),  # 1 + 2 x 30 + 5 = 66 s > 60 s
        (66, 10.0, 20.0, True),  # exactly enough
        (30, 0.2, None, False),  # a write never measured is taken as 30 s
        (120, 0.2, None, True),
        (600, None, 1.0, False),  # no step yet: nothing to lose by stopping now
        (3, 0.01, 0.01, False),  # inside the stop margin
        (-5, 0.01, 0.01, False),  # the deadline has passed
    ],
)
def test_whether_a_job_can_checkpoint_before_the_deadline(
    left_s: float, step_s: float | None, write_s: float | None, makes_it: bool
) -> None:
    now = 1_000_000.0
    assert (
        can_checkpoint_before(now=now, deadline_at=now + left_s, step_s=step_s, write_s=write_s) is makes_it
    )


def test_a_drain_without_a_deadline_always_leaves_time_to_checkpoint() -> None:
    assert can_checkpoint_before(now=0.0, deadline_at=None, step_s=None, write_s=None)


def test_the_earliest_deadline_of_ray_and_an_admin_wins() -> None:
    told = [
        Drain(node_id=NODE_A, deadline_at=100.0, source="ops"),
        Drain(node_id=NODE_B, deadline_at=500.0, source="ops"),
    ]
    drains = merge({NODE_A: 200.0, NODE_B: 400.0}, told)
    assert drains[NODE_A] == Drain(node_id=NODE_A, deadline_at=100.0, source="ops")
    assert drains[NODE_B] == Drain(node_id=NODE_B, deadline_at=400.0, source="ray")
    # A deadline beats none.
    assert merge({NODE_A: None}, told[:1])[NODE_A].deadline_at == 100.0
    assert (
        merge({NODE_A: 50.0}, [Drain(node_id=NODE_A, deadline_at=None, source="ops")])[NODE_A].source == "ray"
    )


def test_a_job_is_under_the_drain_of_a_node_one_of_its_ranks_is_on() -> None:
    drains = merge({NODE_A: 300.0, NODE_B: 200.0}, [])
    ranks = {
        "0": {"rank": 0, "node": "192.0.2.2 (aaaaaaaa)"},
        "1": {"rank": 1, "node": f"192.0.2.2 ({NODE_A[:8]})"},
    }
    assert drained_node(ranks, drains) == drains[NODE_A]
    ranks["0"]["node"] = f"192.0.2.2 ({NODE_B[:8]})"
    assert drained_node(ranks, drains) == drains[NODE_B]  # the earlier deadline
    assert drained_node({"0": {"node": "192.0.2.2 (aaaaaaaa)"}}, drains) is None
    assert drained_node(None, drains) is None
    assert drained_node({"0": {"node": "no id here"}}, drains) is None
