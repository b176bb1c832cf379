"""The estimates the policy and the simulator share (`service.scheduling.estimates`)."""

from __future__ import annotations

import math
import statistics

import pytest

from service.scheduling.estimates import (
    PACE_AFTER_S,
    History,
    pace_error,
    pace_remaining_s,
    simulated_remaining_s,
    size_class,
)


def test_history_prefers_the_closest_kind_of_job_with_enough_of_them() -> None:
    history = History()
    assert history.estimate(owner="ada", name="bert", size=8) is None  # nothing finished yet
    for duration in (100, 200, 300):
        history.record(owner="bob", name="gpt", size=4, duration_s=duration)
    # Ada has no history: the size class 2-8 (bob's jobs) answers.
    assert history.estimate(owner="ada", name="bert", size=8) == 200
    for duration in (1000, 1100, 1200):
        history.record(owner="ada", name="resnet", size=2, duration_s=duration)
    # Ada's own jobs of that size class now answer, before the class as a whole.
    assert history.estimate(owner="ada", name="bert", size=8) == 1100
    for duration in (50, 60, 70):
        history.record(owner="ada", name="bert", size=8, duration_s=duration)
    assert history.estimate(owner="ada", name="bert", size=8) == 60  # the same name, closest of all
    assert history.estimate(owner="ada", name="bert", size=64) is None  # another size class
    # A declared max_runtime_s is a bound: the estimate never exceeds it, and stands in for none.
    assert history.estimate(owner="ada", name="bert", size=8, declared_s=55) == 55
    assert history.estimate(owner="ada", name="x", size=64, declared_s=900) == 900


def test_history_forgets_beyond_what_it_keeps() -> None:
    history = History(keep=3)
    for duration in (10, 10, 10, 500, 600, 700):
        history.record(owner="ada", name=None, size=1, duration_s=duration)
    assert history.estimate(owner="ada", name=None, size=1) == 600


def test_size_classes() -> None:
    classes = [size_class(g) for g in (1, 2, 8, 9, 32, 33, 640)]
    assert classes == ["1", "2-8", "2-8", "9-32", "9-32", "33+", "33+"]


def test_pace_needs_a_few_minutes_and_a_step_count() -> None:
    assert pace_remaining_s(ran_s=PACE_AFTER_S - 1, steps_done=10, max_steps=100) is None
    assert pace_remaining_s(ran_s=600, steps_done=100, max_steps=None) is None
    assert pace_remaining_s(ran_s=600, steps_done=0, max_steps=100) is None
    assert pace_remaining_s(ran_s=600, steps_done=100, max_steps=400) == pytest.approx(1800)
    assert pace_remaining_s(ran_s=600, steps_done=500, max_steps=400) == 0


def test_the_simulated_pace_errs_by_a_fixed_log_normal_factor_per_job() -> None:
    errors = [pace_error(job_id) for job_id in range(4000)]
    assert pace_error(7) == pace_error(7) and pace_error(7) != pace_error(8)
    logs = [math.log(e) for e in errors]
    assert abs(statistics.fmean(logs)) < 0.02 and statistics.stdev(logs) == pytest.approx(0.3, rel=0.05)
    truth = {"true_remaining_s": 1000.0, "error": 1.5}
    young = simulated_remaining_s(**truth, ran_s=60, expected_s=900, done_s=100)
    assert young == 800  # before PACE_AFTER_S: what was expected, less the work done
    assert simulated_remaining_s(**truth, ran_s=60, expected_s=None, done_s=0) is None
    assert simulated_remaining_s(**truth, ran_s=PACE_AFTER_S, expected_s=900, done_s=0) == 1500
