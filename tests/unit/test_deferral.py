"""Deferral (`service.scheduling.deferral`, rule 0 of the policy): a deferrable job waits for the
cheapest window of the price signal that still lets it finish by its deadline, and never misses the
deadline for it."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.capacity import ClusterSnapshot, Gang, NodeCapacity
from service.contract.signal import Signal, build_signal
from service.scheduling.deferral import WAIT_SAMPLES, Deferral, RecentWaits, cheapest_window, cost_of
from service.scheduling.policy import decide

H = 3600.0
DAY = 1_798_761_600.0  # 2027-01-01T00:00:00Z
NOW = DAY + 13 * H  # 13:00


def hourly(values: list[float], *, start: float = DAY) -> Signal:
    return build_signal(
        [(start + i * H, start + (i + 1) * H, v) for i, v in enumerate(values)], source="test"
    )


def cluster(cpus: float = 8) -> ClusterSnapshot:
    return ClusterSnapshot(nodes=(NodeCapacity(node_id="n0", resources={"CPU": cpus}),))


def job(
    job_id: int = 1, *, deadline: float | None, max_runtime_s: float | None = 2 * H, **fields: Any
) -> Gang:
    return Gang(
        job_id=job_id,
        queue=fields.pop("queue", "research"),
        priority=0,
        num_workers=1,
        per_worker={"CPU": 1},
        submitted_at=float(job_id),
        max_runtime_s=max_runtime_s,
        deadline=deadline,
        **fields,
    )


def run(queued: list[Gang], *, now: float = NOW, deferral: Deferral | None) -> Any:
    return decide(cluster=cluster(), queued=queued, active=[], now=now, deferral=deferral)


# A day whose cheap hours are 02:00-06:00 of the next day (values per hour from 00:00 today).
PRICES = [5.0] * 24 + [5.0, 5.0, 1.0, 1.0, 1.0, 1.0] + [5.0] * 18


def test_a_deferrable_job_waits_for_the_cheapest_window_and_says_so() -> None:
    signal = hourly(PRICES)
    deadline = DAY + 24 * H + 16 * H  # tomorrow 16:00
    decisions = run([job(deadline=deadline, max_runtime_s=4 * H)], deferral=Deferral(signal=signal))
    assert decisions.admit == ()
    wait = decisions.waiting[1]
    assert wait.reason == "waits for the cheaper window 01-02 02:00-06:00 UTC; must start by 01-02 12:00 UTC"
    assert wait.eta == DAY + 26 * H


def test_it_starts_when_its_window_begins() -> None:
    signal = hourly(PRICES)
    gang = job(deadline=DAY + 40 * H, max_runtime_s=4 * H)
    assert run([gang], now=DAY + 26 * H - 1, deferral=Deferral(signal=signal)).admit == ()
    admitted = run([gang], now=DAY + 26 * H, deferral=Deferral(signal=signal))
    assert admitted.admit == (1,)
    assert admitted.deferral_notes == {1: "deferrable: its cheaper window has come"}


def test_at_its_last_start_it_is_admitted_like_any_other_job() -> None:
    # The cheap hours come too late to finish by the deadline: the job waits for the cheapest window
    # that still ends by then, and no later than its last start.
    signal = hourly([5.0] * 24 + [1.0] * 24)
    deadline = DAY + 22 * H
    gang = job(deadline=deadline, max_runtime_s=2 * H)
    assert run([gang], deferral=Deferral(signal=signal)).admit == (1,)  # all equal: no reason to wait
    signal = hourly([5.0] * 20 + [4.0] * 28)
    held = run([gang], deferral=Deferral(signal=signal, margin_s=60))
    assert held.admit == () and "must start by 19:59 UTC" in held.waiting[1].reason
    admitted = run([gang], now=deadline - 2 * H - 60, deferral=Deferral(signal=signal, margin_s=60))
    assert admitted.admit == (1,)
    assert admitted.deferral_notes == {1: "deferrable: its last start has come"}


def test_a_queue_whose_jobs_wait_makes_a_deferred_job_join_the_line_that_much_earlier() -> None:
    # Under load a job released at its last start waits in the line like the queue's recent jobs did:
    # it must join the line by then, not start by then.
    signal = hourly([5.0] * 17 + [4.0] * 31)  # cheaper from 17:00
    gang = job(deadline=DAY + 22 * H, max_runtime_s=2 * H)
    alone = run([gang], deferral=Deferral(signal=signal, margin_s=60))
    assert alone.waiting[1].reason == "waits for the cheaper window 17:00-19:00 UTC; must start by 19:59 UTC"
    waits = {"research": 3 * H, "full-scale": 10 * H}
    held = run([gang], deferral=Deferral(signal=signal, margin_s=60, expected_wait_s=waits))
    assert held.waiting[1].reason == "waits for the cheaper window 16:59-18:59 UTC; must start by 16:59 UTC"
    late = run([gang], now=DAY + 17 * H, deferral=Deferral(signal=signal, margin_s=60, expected_wait_s=waits))
    assert late.admit == (1,) and late.deferral_notes == {1: "deferrable: its last start has come"}
    # Less slack than the queue's wait: not deferred at all.
    assert run([gang], deferral=Deferral(signal=signal, expected_wait_s={"research": 8 * H})).admit == (1,)


def test_the_expected_wait_is_the_longest_of_the_queues_recent_admissions() -> None:
    waits = RecentWaits()
    assert waits.expected() == {}
    waits.add("research", 600.0)
    waits.add("research", -5.0)  # clocks of two replicas: never below nothing
    waits.add("research", math.nan)  # never counted
    assert waits.expected() == {"research": 600.0}
    for _ in range(WAIT_SAMPLES):
        waits.add("research", 60.0)
    waits.add("full-scale", 7200.0)
    assert waits.expected() == {"research": 60.0, "full-scale": 7200.0}  # the 600 s is no longer recent


def test_unpriced_hours_are_never_waited_for() -> None:
    signal = hourly([3.0] * 16)  # the forecast ends at 16:00
    decisions = run([job(deadline=DAY + 48 * H)], deferral=Deferral(signal=signal))
    assert decisions.admit == (1,)


def test_without_a_signal_or_a_duration_nothing_is_deferred_and_the_reason_says_so() -> None:
    full = ClusterSnapshot(nodes=(NodeCapacity(node_id="n0", resources={"CPU": 0.5}),))
    gang = job(deadline=DAY + 48 * H)
    unknown = Deferral(signal=None, unavailable="price signal prices.csv cannot be read: gone")
    decisions = decide(cluster=full, queued=[gang], active=[], now=NOW, deferral=unknown)
    assert decisions.waiting[1].reason.endswith("not deferred: price signal prices.csv cannot be read: gone")
    assert run([gang], deferral=unknown).admit == (1,)
    no_duration = job(deadline=DAY + 48 * H, max_runtime_s=None)
    assert run([no_duration], deferral=Deferral(signal=hourly(PRICES))).admit == (1,)


def test_a_job_without_a_deadline_is_never_deferred_and_one_held_does_not_block_the_line() -> None:
    signal = hourly(PRICES)
    decisions = run([job(1, deadline=DAY + 40 * H), job(2, deadline=None)], deferral=Deferral(signal=signal))
    assert decisions.admit == (2,)
    assert decisions.waiting[1].position == 1


def test_the_estimate_is_the_duration_when_no_max_runtime_is_declared() -> None:
    signal = hourly(PRICES)
    gang = job(deadline=DAY + 30 * H, max_runtime_s=None, estimated_runtime_s=3 * H)
    window = run([gang], deferral=Deferral(signal=signal)).waiting[1]
    assert window.eta == DAY + 26 * H and "02:00-05:00" in window.reason


# -- the property: random signals, deadlines and durations ------------------------------------------

values = st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(
    values=values,
    gaps=st.lists(st.booleans(), min_size=30, max_size=30),
    duration_min=st.integers(min_value=1, max_value=600),
    slack_min=st.integers(min_value=-60, max_value=1200),
    start_min=st.integers(min_value=-120, max_value=600),
    tick_s=st.sampled_from([1.0, 17.0, 60.0, 300.0]),
)
def test_deferral_never_misses_a_deadline_and_chooses_the_cheapest_feasible_window(
    values: list[int], gaps: list[bool], duration_min: int, slack_min: int, start_min: int, tick_s: float
) -> None:
    # Intervals of 10 to 50 minutes, some left out (unknown), from `start_min` minutes after now.
    rows, at = [], NOW + start_min * 60
    for index, value in enumerate(values):
        length = (10 + 40 * (value % 2)) * 60 if index % 3 else 60 * 60
        if not gaps[index]:
            rows.append((at, at + length, float(value)))
        at += length
    signal = build_signal(rows, source="random")
    duration_s = duration_min * 60.0
    deadline = NOW + duration_s + slack_min * 60.0

    # The window is the cheapest start in [now, last start], earliest of equal cost: checked against
    # every whole minute (the signal's boundaries are whole minutes, so the true minimum is on one).
    window = cheapest_window(signal, now=NOW, duration_s=duration_s, deadline=deadline)
    if slack_min <= 0:
        assert window is None
    else:
        assert window is not None and NOW <= window.start_at <= window.last_start_at == deadline - duration_s
        starts = [NOW + minute * 60.0 for minute in range(slack_min + 1)]
        costs = [cost_of(signal, start=start, duration_s=duration_s) for start in starts]
        assert window.cost == pytest.approx(min(costs), rel=1e-9, abs=1e-6)
        cheaper_before = [s for s, c in zip(starts, costs, strict=True) if c < window.cost - 1e-6]
        assert cheaper_before == []

    # Through the policy, ticking every `tick_s` with that as the margin: admitted in time. The ticks
    # before a held job's ETA (its window's start) hold it too, so the walk jumps to the first after it.
    gang = job(deadline=deadline, max_runtime_s=duration_s)
    deferral = Deferral(signal=signal, margin_s=tick_s)
    now = NOW
    while not (decisions := run([gang], now=now, deferral=deferral)).admit:
        eta = decisions.waiting[1].eta
        assert eta is not None and now < eta <= deadline - duration_s - tick_s
        now = NOW + math.ceil((eta - NOW) / tick_s) * tick_s
    assert now + duration_s <= max(deadline, NOW + duration_s) + 1e-6
