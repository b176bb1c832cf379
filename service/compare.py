"""Runs side by side: each job's final and best metrics, and the spec fields in which the jobs differ.

What a research queue is for is trying variants of one run; this is what tells them apart:
- `summarize(points)`: over rank 0's points of the run that counted (a step a restart trained again
  counts once, as the charts draw it), each metric's value at the last step, and its best value:
  the lowest for a metric whose name ends in `loss` (`loss`, `eval_loss`, a recipe's `val_loss`),
  the highest for any other (throughput, accuracy). Rank 0 is every job's rank: the ranks of one
  data-parallel job see the same loss curve, not the same one per rank.
- `spec_diff(specs)`: the specs flattened to dotted keys (`config.lr`, `checkpoint.every_steps`), and
  those whose values are not the same in every job, with each job's value (None where a spec lacks
  the key).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.contract.protocol import SYSTEM_PREFIX

# How many of a job's steps a comparison reads at most (evenly spaced, the last one included): a
# million-step run is compared on a sample; below this every step counts.
MAX_COMPARED_STEPS = 100_000
# The jobs one comparison takes.
MAX_COMPARED_JOBS = 20


def lower_is_better(metric: str) -> bool:
    return metric.endswith("loss")


@dataclass(frozen=True)
class MetricSummary:
    final: dict[str, float] = field(default_factory=dict)  # metric -> its value at its last step
    final_step: dict[str, int] = field(default_factory=dict)
    best: dict[str, float] = field(default_factory=dict)  # metric -> its best value (lower_is_better)
    best_step: dict[str, int] = field(default_factory=dict)


def summarize(points: Iterable[tuple[int, Mapping[str, Any]]]) -> MetricSummary:
    """Final and best value of each metric over `(step, values)` points (any order; non-finite values,
    non-numbers and a rank's system figures, `sys_*`, which have no best, are left out)."""
    summary = MetricSummary()
    for step, values in points:
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            if name.startswith(SYSTEM_PREFIX):
                continue
            if step >= summary.final_step.get(name, -1):
                summary.final[name], summary.final_step[name] = float(value), step
            best = summary.best.get(name)
            better = best is None or (value < best if lower_is_better(name) else value > best)
            if better:
                summary.best[name], summary.best_step[name] = float(value), step
    return summary


def flatten(document: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as `{dotted.key: leaf}` (lists are leaves; an empty mapping has no key)."""
    flat: dict[str, Any] = {}
    for key, value in document.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):  # an empty one adds no key
            flat.update(flatten(value, prefix=name + "."))
        else:
            flat[name] = value
    return flat


def spec_diff(specs: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The dotted keys whose values differ between `specs`, each with every spec's value, sorted."""
    flat = [flatten(spec) for spec in specs]
    keys = sorted({key for spec in flat for key in spec})
    diff: dict[str, list[Any]] = {}
    for key in keys:
        values = [spec.get(key) for spec in flat]
        if any(value != values[0] for value in values[1:]):
            diff[key] = values
    return diff
