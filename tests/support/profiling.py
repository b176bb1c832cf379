"""A profile taken in this process (`trainers.profiling.StepProfiler`, one rank, no process group)."""

from __future__ import annotations

from typing import Any

import torch

from service.contract.protocol import LaunchRequest
from service.contract.spec import ProfileSpec
from trainers.profiling import StepProfiler


class RecordedEvents:
    """Takes `Telemetry.event` calls: what rank 0 would post."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def event(self, kind: str, *, step: int, message: str, **data: Any) -> None:
        self.events.append((kind, {"step": step, "message": message, **data}))


def profile_small_model(
    request: LaunchRequest, window: ProfileSpec, *, steps: int
) -> list[tuple[str, dict[str, Any]]]:
    """Train a tiny linear model for `steps` steps under `window`, as the training context drives it;
    the events rank 0 posted."""
    telemetry = RecordedEvents()
    profiler = StepProfiler(
        window,
        request=request,
        rank=0,
        device=torch.device("cpu"),
        telemetry=telemetry,  # type: ignore[arg-type]
    )
    model = torch.nn.Linear(16, 4)
    profiler.at_restore(0)
    for step in range(1, steps + 1):
        model(torch.randn(8, 16)).sum().backward()
        profiler.at_step(step)
        assert profiler.active == (window.start_step - 1 <= step < window.end_step)
    return telemetry.events
