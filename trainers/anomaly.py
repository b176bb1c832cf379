"""Bad numerics: which steps are anomalies, and how the ranks agree on one.

A step is an anomaly when, after `backward()` and before the optimizer applies its gradients:

- `nan` / `inf`: the rank's loss, or the gradient norm, is NaN or infinite; or
- `spike`: the gradient norm is more than `anomaly.zscore` standard deviations above the mean of
  the last `anomaly.window` normal steps, once at least `anomaly.min_steps` of them are known. Only
  upward spikes count (a sudden drop is not a danger), and only a norm at least `MIN_SPIKE_RATIO`
  times the mean: a converged run's tiny, jittery gradient norms reach high z-scores on rises that
  do no harm (a 3,000-step `mlp` run in benchmarks/recovery.py had 9.4 at 1.3x its mean). The
  standard deviation is floored at `MIN_RELATIVE_STD` of the mean, so a nearly constant history
  does not turn a small rise into a spike.

`AnomalyDetector` judges one rank's steps and keeps the gradient-norm history; it is pure (floats
in, an `Anomaly` or None out) and knows nothing of torch or of the other ranks. A step joins the
history only when the loop applies it (`accept`), so anomalies never shift the mean. The history is
keyed by step: judging step n again (after a rollback) forgets every step >= n, so a rolled-back
run judges its replayed steps against exactly the history it had the first time. A run resumed
from a checkpoint starts with an empty history (it is not in the checkpoint), so spikes are looked
for again after `min_steps`.

Agreement: every rank must act on the same anomaly at the same step, or the next collective hangs.
Under DDP and FSDP the gradient norm is the same on every rank, but the loss is each rank's own (and
one rank's NaN loss makes every rank's gradient norm NaN). So every rank encodes what it saw
(`encode`), the ranks all-gather those few numbers (`trainers.parallel.gather_values`), and every
rank decodes the same table into the same verdict (`decide`). When several ranks saw something, the verdict
names the root cause: a loss before a gradient norm (a bad loss is why the norm is bad), a
non-finite value before a spike, then the lowest rank.

What happens then is the spec's `on_anomaly` (`service.contract.spec.AnomalyAction`), carried out by the
train loop (`trainers.loop`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from service.contract.spec import AnomalySpec

AnomalyKind = Literal["nan", "inf", "spike"]
Metric = Literal["loss", "grad_norm"]

# The standard deviation of the window is at least this fraction of its mean.
MIN_RELATIVE_STD = 0.01
# A spike is also at least this multiple of the window's mean gradient norm.
MIN_SPIKE_RATIO = 2.0

_KINDS: tuple[AnomalyKind, ...] = ("nan", "inf", "spike")
_METRICS: tuple[Metric, ...] = ("loss", "grad_norm")
# What one rank contributes to the step's collective: anomaly seen, kind, metric, value, z-score.
ENCODED_LENGTH = 5


@dataclass(frozen=True, kw_only=True)
class Anomaly:
    """What one rank saw at one step."""

    kind: AnomalyKind
    metric: Metric
    step: int
    rank: int
    value: float
    zscore: float | None = None  # spikes only

    def describe(self) -> str:
        """One line for a person: `loss is NaN at step 412 on rank 1`."""
        where = f"at step {self.step} on rank {self.rank}"
        if self.kind == "spike":
            return f"{self.metric} spiked to {self.value:.4g} (z-score {self.zscore:.1f}) {where}"
        return f"{self.metric} is {_number(self.value)} {where}"

    def event_data(self) -> dict[str, float | int | str]:
        """The numbers of the `anomaly` event (a non-finite value as text: telemetry JSON has no NaN)."""
        data: dict[str, float | int | str] = {
            "anomaly": self.kind,  # not "kind": that is the event's own
            "metric": self.metric,
            "value": self.value if math.isfinite(self.value) else _number(self.value),
        }
        if self.zscore is not None:
            data["zscore"] = self.zscore
        return data


class AnomalyDetector:
    """One rank's judge of its steps' loss and gradient norm (see the module docstring)."""

    def __init__(self, *, zscore: float, window: int, min_steps: int, rank: int = 0) -> None:
        if not 2 <= min_steps <= window:
            raise ValueError(f"need 2 <= min_steps <= window, got min_steps={min_steps}, window={window}")
        self.threshold = zscore
        self.min_steps = min_steps
        self.rank = rank
        self._history: deque[tuple[int, float]] = deque(maxlen=window)

    @classmethod
    def from_spec(cls, spec: AnomalySpec, *, rank: int) -> AnomalyDetector:
        return cls(zscore=spec.zscore, window=spec.window, min_steps=spec.min_steps, rank=rank)

    def check(self, *, step: int, loss: float, grad_norm: float) -> Anomaly | None:
        """Judge step `step` (1-based: the step being taken); None when it is normal."""
        self._forget_from(step)
        measured: tuple[tuple[Metric, float], ...] = (("loss", loss), ("grad_norm", grad_norm))
        for metric, value in measured:
            if math.isnan(value):
                return Anomaly(kind="nan", metric=metric, step=step, rank=self.rank, value=value)
            if math.isinf(value):
                return Anomaly(kind="inf", metric=metric, step=step, rank=self.rank, value=value)
        zscore = self.zscore(grad_norm)
        if zscore is not None and zscore > self.threshold and grad_norm >= MIN_SPIKE_RATIO * self._mean():
            return Anomaly(
                kind="spike", metric="grad_norm", step=step, rank=self.rank, value=grad_norm, zscore=zscore
            )
        return None

    def accept(self, *, step: int, grad_norm: float) -> None:
        """Step `step` was applied: its gradient norm joins the history (a non-finite one never does)."""
        self._forget_from(step)
        if math.isfinite(grad_norm):
            self._history.append((step, grad_norm))

    def _mean(self) -> float:
        return sum(norm for _, norm in self._history) / len(self._history)

    def zscore(self, grad_norm: float) -> float | None:
        """How far `grad_norm` is above the history's mean, in standard deviations; None before min_steps."""
        if len(self._history) < self.min_steps:
            return None
        norms = [norm for _, norm in self._history]
        mean = sum(norms) / len(norms)
        std = math.sqrt(sum((norm - mean) ** 2 for norm in norms) / (len(norms) - 1))
        floor = max(MIN_RELATIVE_STD * abs(mean), 1e-12)
        return (grad_norm - mean) / max(std, floor)

    def _forget_from(self, step: int) -> None:
        while self._history and self._history[-1][0] >= step:
            self._history.pop()


# -- agreement across ranks ----------------------------------------------------------------------------


def encode(anomaly: Anomaly | None) -> list[float]:
    """This rank's contribution to the step's collective (`ENCODED_LENGTH` floats)."""
    if anomaly is None:
        return [0.0, 0.0, 0.0, 0.0, math.nan]
    return [
        1.0,
        float(_KINDS.index(anomaly.kind)),
        float(_METRICS.index(anomaly.metric)),
        anomaly.value,
        math.nan if anomaly.zscore is None else anomaly.zscore,
    ]


def decide(rows: Sequence[Sequence[float]], *, step: int) -> Anomaly | None:
    """The root anomaly of step `step` on any rank (None: none), from every rank's `encode`d row, in rank
    order (the same on all ranks)."""
    seen: list[Anomaly] = []
    for rank, row in enumerate(rows):
        if len(row) != ENCODED_LENGTH:
            raise ValueError(f"rank {rank} sent {len(row)} values, expected {ENCODED_LENGTH}")
        if row[0]:
            zscore = row[4]
            seen.append(
                Anomaly(
                    kind=_KINDS[int(row[1])],
                    metric=_METRICS[int(row[2])],
                    step=step,
                    rank=rank,
                    value=row[3],
                    zscore=None if math.isnan(zscore) else zscore,
                )
            )
    return min(
        seen,
        key=lambda a: (_METRICS.index(a.metric), a.kind == "spike", a.rank),
        default=None,
    )


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"
