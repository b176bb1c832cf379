"""The own-loop example (`examples/own_loop/train.py`) with each step made longer by `config.step_delay_s`,
so that a test can preempt it mid-run (`trainer: tests.support.own_loop:train`)."""

from __future__ import annotations

import time
from typing import Any

from examples.own_loop import train as example
from trainers.context import TrainContext


def train(ctx: TrainContext) -> None:
    delay_s = float(ctx.config.get("step_delay_s", 0.0))
    report = ctx.report

    def slow_report(step: int, /, **metrics: Any) -> None:
        time.sleep(delay_s)
        report(step, **metrics)

    ctx.report = slow_report  # type: ignore[method-assign]
    example.train(ctx)
