"""Runs side by side (service.compare): final and best metrics, and the spec keys jobs differ in."""

from __future__ import annotations

import math

from service.compare import flatten, spec_diff, summarize


def test_final_is_the_last_step_and_best_is_lowest_for_losses_highest_for_the_rest() -> None:
    points = [
        (3, {"loss": 0.9, "samples_per_s": 100.0, "eval_loss": 1.1}),
        (1, {"loss": 2.0, "samples_per_s": 140.0}),
        (2, {"loss": 0.7, "samples_per_s": 90.0, "lr": math.nan, "note": "text"}),
    ]
    summary = summarize(points)
    assert summary.final == {"loss": 0.9, "samples_per_s": 100.0, "eval_loss": 1.1}
    assert summary.final_step == {"loss": 3, "samples_per_s": 3, "eval_loss": 3}
    assert (summary.best["loss"], summary.best_step["loss"]) == (0.7, 2)
    assert (summary.best["samples_per_s"], summary.best_step["samples_per_s"]) == (140.0, 1)
    assert "lr" not in summary.final and "note" not in summary.final  # not finite, not a number
    assert summarize([]).final == {}


def test_the_spec_diff_names_dotted_keys_with_every_jobs_value() -> None:
    base = {"name": "a", "config": {"lr": 0.1, "hidden_sizes": [8]}, "checkpoint": {"every_steps": 10}}
    other = {"name": "b", "config": {"lr": 0.01, "hidden_sizes": [8]}, "checkpoint": {}}
    assert flatten(base)["config.lr"] == 0.1
    assert spec_diff([base, other]) == {
        "checkpoint.every_steps": [10, None],
        "config.lr": [0.1, 0.01],
        "name": ["a", "b"],
    }
    assert spec_diff([base, base]) == {}
