"""Sweep files (service.contract.sweep): the search space, the trials' points, ASHA's rungs and cuts."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from service.contract.sweep import (
    EarlyStopping,
    SweepSpec,
    asha_keeps,
    grid_point,
    random_point,
    rungs,
    trial_spec,
    value_at,
)


def base() -> dict[str, Any]:
    return {
        "name": "mlp",
        "trainer": "mlp",
        "num_workers": 1,
        "dataset": {"uri": "file:///data/train"},
        "max_steps": 100,
        "batch_size": 8,
        "config": {"task": "classification", "num_classes": 3, "lr": 0.01},
    }


def sweep(**changes: Any) -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "name": "lr-search",
            "base": base(),
            "space": {
                "config.lr": {"loguniform": [1e-4, 1.0]},
                "config.hidden_sizes": {"choice": [[8], [32]]},
            },
            "objective": {"metric": "loss", "mode": "min"},
            **changes,
        }
    )


def test_random_points_depend_on_seed_and_trial_only() -> None:
    first = random_point(sweep(seed=5), 3)
    assert first == random_point(sweep(seed=5), 3)
    assert first != random_point(sweep(seed=6), 3)
    assert 1e-4 <= float(first["config.lr"]) <= 1.0
    spec = trial_spec(sweep(), first, index=3)
    assert spec.name == "lr-search-t3" and spec.config["lr"] == first["config.lr"]


def test_grid_covers_exactly_its_points() -> None:
    grid = sweep(method="grid", space={"config.lr": {"choice": [0.1, 0.01]}, "batch_size": {"int": [4, 6]}})
    assert grid.total_trials() == 6
    points = [grid_point(grid, i) for i in range(6)]
    assert len({tuple(sorted(p.items())) for p in points}) == 6
    assert {p["batch_size"] for p in points} == {4, 5, 6}
    assert trial_spec(grid, points[0], index=0).batch_size == 4
    assert (
        sweep(method="grid", max_trials=4, space={"config.lr": {"choice": [1, 2, 3, 4, 5]}}).total_trials()
        == 4
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"space": {"lr": {"choice": [1]}}}, "lr"),
        ({"space": {"config.lr": {"uniform": [1.0, 0.5]}}}, "config.lr"),
        ({"space": {"config.lr": {"loguniform": [0, 1]}}}, "config.lr"),
        ({"space": {"config.lr": {"normal": [0, 1]}}}, "config.lr"),
        ({"method": "grid"}, "grid takes choice and int"),
        ({"early_stopping": {"min_steps": 100}}, "early_stopping.min_steps"),
        ({"objective": {"metric": "eval_loss", "mode": "min"}}, "needs eval"),
        ({"space": {"max_steps": {"int": [0, 5]}}}, "max_steps"),
        ({"max_trials": 0}, "max_trials"),
    ],
)
def test_bad_sweep_files_name_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        sweep(**changes)
    assert field in str(caught.value)


def test_asha_rungs_values_and_cuts() -> None:
    assert rungs(EarlyStopping(min_steps=10, reduction_factor=3), max_steps=100) == [10, 30, 90]
    points = [(5, 3.0), (10, 2.0), (20, 1.5)]
    assert value_at(points, 4) is None and value_at(points, 10) == 2.0 and value_at(points, 15) == 2.0
    assert asha_keeps(9.0, [9.0, 1.0], factor=3, mode="min")  # too few at the rung to judge
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [asha_keeps(v, values, factor=3, mode="min") for v in values] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    assert [asha_keeps(v, values, factor=3, mode="max") for v in values] == [
        False,
        False,
        False,
        False,
        True,
        True,
    ]


def test_tpe_asks_points_inside_the_space_and_the_same_inputs_give_the_same_point() -> None:
    from service.sweeps import tpe_point

    spec = sweep(method="tpe", seed=3)
    finished = [(random_point(spec, i), float(i)) for i in range(6)]
    point = tpe_point(spec, 6, finished)
    assert point == tpe_point(spec, 6, finished)
    assert 1e-4 <= float(point["config.lr"]) <= 1.0 and point["config.hidden_sizes"] in ([8], [32])
    assert trial_spec(spec, point, index=6).config["hidden_sizes"] == point["config.hidden_sizes"]
