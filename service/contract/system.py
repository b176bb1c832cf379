"""The system figures of a rank (`service.contract.protocol.SystemStats`): what each is called, how it
is shown, and when one stands out from the other ranks' (the job page marks it, Prometheus has it as
`apiary_rank_outlier`, and the service records an event when a rank starts or stops standing out).

The rule, for each figure in `SYSTEM_FIGURES` that the rank and at least one other rank of the job
report: the rank stands out when its value is more than `SYSTEM_OUTLIER_FACTOR` times the median of
the other ranks' values and beyond it by at least the figure's `floor` (smaller differences are
noise: a few MiB of memory, a few percent of CPU). GPU utilization stands out the other way: when it
is less than the median divided by the factor (a starved GPU). The service marks and unmarks a figure after
`service.store.repository.STRAGGLER_POSTS` posts in a row that say so, as it does a straggler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A figure stands out when it is more than this multiple of the other ranks' median.
SYSTEM_OUTLIER_FACTOR = 2.0
MIB = 1024 * 1024


@dataclass(frozen=True)
class SystemFigure:
    label: str  # what a person reads
    floor: float  # the least difference from the median that counts
    unit: str  # "%", "B" or "B/s"
    low: bool = False  # it stands out below the others, not above


# The figures compared across ranks (and carried by metric points for the exporters), by field name.
SYSTEM_FIGURES = {
    "cpu_percent": SystemFigure("CPU", 50.0, "%"),
    "rss_bytes": SystemFigure("memory (RSS)", 512 * MIB, "B"),
    # A GPU far busier than the others' is not at fault (they may wait for it: a straggler shows that);
    # one far idler is starved.
    "gpu_utilization_percent": SystemFigure("GPU utilization", 20.0, "%", low=True),
    "gpu_memory_bytes": SystemFigure("GPU memory", 1024 * MIB, "B"),
    "data_read_bytes_per_s": SystemFigure("data read", MIB, "B/s"),
    "net_sent_bytes_per_s": SystemFigure("network sent", MIB, "B/s"),
    "net_recv_bytes_per_s": SystemFigure("network received", MIB, "B/s"),
}


def system_outliers(
    mine: Mapping[str, Any], others: Sequence[Mapping[str, Any]], *, factor: float = SYSTEM_OUTLIER_FACTOR
) -> dict[str, tuple[bool, float]]:
    """For each figure of `SYSTEM_FIGURES` that this rank (`mine`, a `SystemStats` as a dict) and at least
    one other rank report: whether it stands out from the others' median now, and that median."""
    verdicts: dict[str, tuple[bool, float]] = {}
    for name, figure in SYSTEM_FIGURES.items():
        value = mine.get(name)
        values = sorted(other[name] for other in others if other.get(name) is not None)
        if value is None or not values:
            continue
        median = values[len(values) // 2]
        if figure.low:
            out = value * factor < median and median - value >= figure.floor
        else:
            out = value > factor * median and value - median >= figure.floor
        verdicts[name] = (out, median)
    return verdicts


def show_figure(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:.0f}%"
    for scale, prefix in ((1024**3, "Gi"), (MIB, "Mi"), (1024, "Ki")):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"
