"""The plateau rule (service.plateau): smoothing, the relative improvement, the window in steps, once
per plateau, and steps trained again."""

from __future__ import annotations

import math
from typing import Any

import pytest

from service.contract.spec import PlateauSpec
from service.plateau import Plateau, PlateauState, judge


def rule(**fields: Any) -> PlateauSpec:
    return PlateauSpec.model_validate({"window_steps": 5, "smoothing_steps": 0, **fields})


def found_at(spec: PlateauSpec, values: list[float], *, first_step: int = 1, every: int = 1) -> list[int]:
    """The steps at which `values` (one every `every` steps), posted one at a time, show a plateau."""
    state: PlateauState | None = None
    steps = []
    for index, value in enumerate(values):
        state, plateau = judge(spec, state, [(first_step + index * every, value)])
        if plateau is not None:
            steps.append(plateau.step)
    return steps


def test_a_falling_loss_has_no_plateau_and_a_flat_one_has_one_window_after_its_best() -> None:
    assert found_at(rule(), [10 * 0.95**step for step in range(100)]) == []
    # Best at step 4 (7.0); steps 5.. do not improve; the window of 5 steps ends at step 9.
    assert found_at(rule(), [10, 9, 8, 7] + [7.0] * 20) == [9]


def test_a_plateau_is_found_once_and_again_only_after_an_improvement() -> None:
    values = [10, 9] + [9.0] * 10 + [5.0] + [5.0] * 10
    # First best at step 2: found at 7, not again until 5.0 improves at step 13; found again at 18.
    assert found_at(rule(), values) == [7, 18]


def test_an_improvement_must_reach_the_relative_amount() -> None:
    creeping = [10 * 0.999**step for step in range(30)]  # 0.1% a step: 1% takes 11 steps
    # Each 1% gain (steps 12, 23) is an improvement; 5 steps without one after it, a plateau.
    assert found_at(rule(min_rel_improvement=0.01), creeping) == [6, 17, 28]
    assert found_at(rule(min_rel_improvement=0.001), creeping) == []
    # Negative values (a log-likelihood loss): the threshold is relative to the best's magnitude.
    assert found_at(rule(), [-1.0, -1.005, -1.009, -1.0, -1.0, -1.0]) == [6]
    assert found_at(rule(), [-1.0, -1.02, -1.04, -1.06, -1.08, -1.1]) == []


def test_smoothing_keeps_one_lucky_batch_from_setting_the_best() -> None:
    # A loss falling 0.2% a step, with one batch 30% below the trend at step 20.
    values = [10 * (1 - 0.002 * step) * (0.7 if step == 20 else 1.0) for step in range(200)]
    # Raw, that batch is the best for ~150 steps: a false plateau after 50.
    assert found_at(rule(window_steps=50, smoothing_steps=0), values, first_step=0) == [70]
    assert found_at(rule(window_steps=50, smoothing_steps=5), values, first_step=0) == []


def test_the_half_life_and_the_window_are_in_steps_whatever_the_metrics_cadence() -> None:
    spec = rule(smoothing_steps=100)
    state, _ = judge(spec, None, [(0, 4.0), (100, 2.0)])
    assert state is not None and state.smoothed == pytest.approx(3.0)  # one half-life: half the way
    state, _ = judge(spec, None, [(0, 4.0), (50, 2.0)])
    assert state is not None and state.smoothed == pytest.approx(4 - (1 - 2**-0.5) * 2)
    # An eval every 100 steps, window 250 steps: the third eval after the best is the plateau.
    assert found_at(rule(window_steps=250), [3.0, 2.0, 2.0, 2.0, 2.0, 2.0], every=100) == [401]
    # Unset, the half-life is a tenth of the window.
    assert PlateauSpec(window_steps=500).half_life_steps == 50


def test_steps_trained_again_after_a_restart_are_not_judged_again() -> None:
    state, _ = judge(rule(), None, [(step, 10.0 - step) for step in range(1, 21)])
    assert state is not None and state.step == 20
    # A restart from the checkpoint at step 15 posts steps 16.. again, with other values.
    replayed, plateau = judge(rule(), state, [(16, 100.0), (18, 100.0), (20, 100.0)])
    assert (replayed, plateau) == (state, None)


def test_a_post_of_many_steps_is_judged_in_step_order_and_says_where_and_why() -> None:
    points = [(step, 5.0 if step < 3 else 4.0) for step in range(12, 0, -1)]  # any order
    state, plateau = judge(rule(min_rel_improvement=0.05), None, points)
    assert isinstance(plateau, Plateau)
    assert (plateau.step, plateau.best_step, plateau.best) == (8, 3, 4.0)
    assert plateau.describe() == (
        "loss plateaued at step 8: no improvement of 0.05 (relative) in 5 steps (window_steps 5); "
        "smoothed (raw) 4, best 4 at step 3"
    )
    # The state is the job's JSON column: it reads back the same.
    assert state is not None and PlateauState.model_validate(state.model_dump(mode="json")) == state
    assert state.found and math.isclose(state.smoothed, 4.0)
