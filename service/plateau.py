"""Loss plateaus: when a job's loss has stopped improving, decided here and nowhere else.

The rule (the spec's `plateau`, `service.contract.spec.PlateauSpec`), on rank 0's values of
`plateau.metric` (`loss`; `eval_loss` is already averaged over the ranks), in step order:

- smoothed: an exponential moving average with a half-life of `half_life_steps` steps, so that it
  weighs the same stretch of training whether the metric comes every step or every eval: a value
  `gap` steps after the previous one moves it by `1 - 2 ** (-gap / half_life)` of the difference.
  It starts at the first value; a half-life of 0 takes the raw values;
- improved: the smoothed value is below the best so far by at least `min_rel_improvement` of the
  best's magnitude (`smoothed < best - min_rel_improvement * |best|`: PyTorch's ReduceLROnPlateau's
  relative threshold); it becomes the best. A smaller gain does not move the best;
- a plateau: `window_steps` steps since the last improvement (or since the first value). It is
  found once; the next one needs an improvement first.

Only a step after the last one judged counts: a step that a restart, a recovery or a preemption
trains again from a checkpoint was judged the first time (a resumed run takes the same steps).

The state (`PlateauState`) is the job's `plateau` column. `service.jobs.JobService.ingest` judges the
points of each telemetry post under the job's row lock, so every API replica judges alike and a
restarted service forgets nothing; on a plateau it records an `anomaly` event, and with
`on_plateau: stop` asks the job to checkpoint and stop (`StopReason.PLATEAU`): the scheduler then
ends it `succeeded`, with the plateau as its message.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from service.contract.spec import PlateauSpec


class PlateauState(BaseModel):
    """Where a job's metric stands: what the next point is judged against (stored as JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int  # the last step judged
    smoothed: float
    best: float
    best_step: int
    found: bool = False  # a plateau was found since the best: the next one needs an improvement


@dataclass(frozen=True, kw_only=True)
class Plateau:
    """A plateau found at `step`."""

    rule: PlateauSpec
    step: int
    smoothed: float
    best: float
    best_step: int

    def describe(self) -> str:
        rule = self.rule
        smoothing = f"half-life {rule.half_life_steps} steps" if rule.half_life_steps else "raw"
        return (
            f"{rule.metric} plateaued at step {self.step}: no improvement of "
            f"{rule.min_rel_improvement:.3g} (relative) in {self.step - self.best_step} steps "
            f"(window_steps {rule.window_steps}); smoothed ({smoothing}) {self.smoothed:.4g}, "
            f"best {self.best:.4g} at step {self.best_step}"
        )


def judge(
    rule: PlateauSpec, state: PlateauState | None, points: Iterable[tuple[int, float]]
) -> tuple[PlateauState | None, Plateau | None]:
    """The state after `points` ((step, value), in any order), and the plateau they show, if any."""
    found: Plateau | None = None
    for step, value in sorted(points):
        if state is None:
            state = PlateauState(step=step, smoothed=value, best=value, best_step=step)
            continue
        if step <= state.step:
            continue  # trained again after a restart: judged the first time
        smoothed = value
        if rule.half_life_steps:
            weight = 1 - 2 ** (-(step - state.step) / rule.half_life_steps)
            smoothed = state.smoothed + weight * (value - state.smoothed)
        if smoothed < state.best - rule.min_rel_improvement * abs(state.best):
            state = PlateauState(step=step, smoothed=smoothed, best=smoothed, best_step=step)
        elif not state.found and step - state.best_step >= rule.window_steps:
            state = state.model_copy(update={"step": step, "smoothed": smoothed, "found": True})
            found = Plateau(
                rule=rule, step=step, smoothed=smoothed, best=state.best, best_step=state.best_step
            )
        else:
            state = state.model_copy(update={"step": step, "smoothed": smoothed})
    return state, found
