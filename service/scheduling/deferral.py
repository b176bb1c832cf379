"""Deferral: when a job that may wait (`deferrable` in its spec) should start. Pure; the policy calls it.

Glossary:
- deadline: when the job must be done (`DeferrableSpec.deadline`).
- duration: how long the job holds its gang, an upper bound where one is known: its `max_runtime_s`
  (it is stopped then), else history's estimate (service.scheduling.estimates).
- expected wait: how long a job of its queue that joins the line now is expected to wait there for
  capacity: the longest of the queue's last `WAIT_SAMPLES` admissions' waits (`RecentWaits`;
  a wait counts from the time the job joined the line: its submission or requeue, or the start of the
  window it was held for). What the service has seen, never what a job will do; 0 before any admission.
- last start: `deadline - duration - margin_s - expected wait`, where the margin is the scheduler's
  tick interval: a job held at one tick is looked at again at most a tick later, so it still joins the
  line by `deadline - duration - expected wait`. A job held to its last start on a busy cluster then
  still has the wait the queue's recent jobs had before it must start; without that term it joined the
  line just in time to start, and under load waited past its deadline.
- cost of a start time t: the signal's value integrated over [t, t + duration]; time the signal does
  not cover (beyond its horizon, or a gap) costs its highest value, so a job never waits for hours
  nobody has priced.
- window: the start time of lowest cost in [now, last start], and its end; of equal costs the
  earliest (a job never waits for nothing).

The cost of a start time is piecewise linear in t between the times where t or t + duration crosses a
boundary of the signal, so its minimum over [now, last start] is at one of those times or at an end
of the range: those are the only candidates.

Invariants: the window's start is in [now, last start] (never past it); a job whose last start has
come is not deferred. Deferral cannot promise that a job released at its last start then finds
capacity within the expected wait: the queue's business, as for every job (docs/spot-and-cheaper-hours.md
says what the simulator measured).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from service.contract.signal import Signal

# Two costs this close (relative) are equal: the earlier start wins, whatever the float rounding.
TOLERANCE = 1e-9
# The expected wait of a queue: the longest of its last this many admissions' waits.
WAIT_SAMPLES = 20


@dataclass(frozen=True, kw_only=True)
class Window:
    start_at: float
    end_at: float
    last_start_at: float
    cost: float  # value x seconds over the window (unknown time at the signal's highest value)


def cost_of(signal: Signal, *, start: float, duration_s: float) -> float:
    """The value integrated over [start, start + duration_s], unknown time at the highest value."""
    total, known = signal.integral(start, start + duration_s)
    return total + (duration_s - known) * signal.highest


def cheapest_window(
    signal: Signal, *, now: float, duration_s: float, deadline: float, margin_s: float = 0.0
) -> Window | None:
    """The window of lowest cost that still ends by `deadline`; None when the last start has come (the
    job starts like any other job)."""
    last_start = deadline - duration_s - margin_s
    if last_start <= now:
        return None
    candidates = {now, last_start}
    boundaries = signal.boundaries
    # Only a boundary inside [now, last start + duration] can be a start or an end of a window.
    low, high = bisect.bisect_right(boundaries, now), bisect.bisect_left(boundaries, last_start + duration_s)
    for boundary in boundaries[low:high]:
        for start in (boundary, boundary - duration_s):
            if now < start < last_start:
                candidates.add(start)
    best_at, best_cost = now, cost_of(signal, start=now, duration_s=duration_s)
    for start in sorted(candidates):
        cost = cost_of(signal, start=start, duration_s=duration_s)
        if cost < best_cost - TOLERANCE * max(1.0, abs(best_cost)):
            best_at, best_cost = start, cost
    return Window(start_at=best_at, end_at=best_at + duration_s, last_start_at=last_start, cost=best_cost)


class RecentWaits:
    """Each queue's last `WAIT_SAMPLES` admission waits, and the expected wait they give (glossary)."""

    def __init__(self, samples: int = WAIT_SAMPLES) -> None:
        self._samples = samples
        self._waits: dict[str, deque[float]] = {}

    def add(self, queue: str, wait_s: float) -> None:
        if math.isfinite(wait_s):
            self._waits.setdefault(queue, deque(maxlen=self._samples)).append(max(0.0, wait_s))

    def expected(self) -> dict[str, float]:
        """Per queue, the longest of its recent waits; a queue with none is absent."""
        return {queue: max(waits) for queue, waits in self._waits.items() if waits}


@dataclass(frozen=True, kw_only=True)
class Deferral:
    """What the policy needs to defer jobs: the signal (None when it cannot be read: deferrable jobs
    then start like any other, and `unavailable` says why in their waiting reasons), the margin, and
    each queue's expected wait (glossary)."""

    signal: Signal | None
    margin_s: float = 0.0
    unavailable: str = ""
    expected_wait_s: Mapping[str, float] = field(default_factory=dict)


def clock_text(at: float, *, now: float) -> str:
    """'14:00', or '12-04 14:00' on another day than `now` (UTC)."""
    when, today = time.gmtime(at), time.gmtime(now)
    same_day = (when.tm_year, when.tm_yday) == (today.tm_year, today.tm_yday)
    return time.strftime("%H:%M" if same_day else "%m-%d %H:%M", when)


def window_text(window: Window, *, now: float) -> str:
    """The waiting reason of a deferred job."""
    return (
        f"waits for the cheaper window {clock_text(window.start_at, now=now)}-"
        f"{clock_text(window.end_at, now=window.start_at)} UTC; must start by "
        f"{clock_text(window.last_start_at, now=now)} UTC"
    )
