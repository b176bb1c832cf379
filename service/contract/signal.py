"""The price signal's format: a time series of price or carbon intensity (`APIARY_PRICE_SIGNAL`).

A signal is a list of intervals `start, end, value`: a CSV file with exactly those columns (a header
row, times as Unix seconds or ISO 8601; an ISO time without a zone is UTC), or an HTTP endpoint's JSON
`[{"start": ..., "end": ..., "value": ...}]`. Intervals may leave gaps and need not be sorted, but they
must not overlap. Its horizon is whatever it gives: time outside every interval is unknown.

What the value means is the service's setting (`APIARY_PRICE_SIGNAL_UNIT`): a price per GPU-hour (per
CPU-hour for a job without GPUs), or a carbon intensity in gCO2e/kWh. Deferral
(service.scheduling.deferral) and the cost ledger (service.costs) read it through `Signal.integral`.

This module does no I/O: the service reads the file or the endpoint (service.costs) and parses here.
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Any, Protocol

from service.contract.errors import ApiaryError

COLUMNS = ("start", "end", "value")
MAX_POINTS = 100_000


class SignalError(ApiaryError, ValueError):
    """The price signal cannot be read: see APIARY_PRICE_SIGNAL."""


def parse_time(value: Any) -> float:
    """Unix seconds from a number (Unix seconds) or an ISO 8601 string (UTC when it names no zone)."""
    if isinstance(value, bool):
        raise ValueError(f"{_shown(value)} is not a time (Unix seconds or ISO 8601)")
    if isinstance(value, int | float):
        seconds = float(value) if abs(value) < 2**53 else math.inf
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                parsed = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
            except ValueError:
                raise ValueError(f"{_shown(value)} is not a time (Unix seconds or ISO 8601)") from None
            seconds = (parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)).timestamp()
    else:
        raise ValueError(f"{_shown(value)} is not a time (Unix seconds or ISO 8601)")
    if not math.isfinite(seconds) or not 0 <= seconds < 2**37:
        raise ValueError(f"{_shown(value)} is not a time between 1970 and year 6000")
    return seconds


@dataclass(frozen=True)
class Point:
    start: float
    end: float
    value: float


@dataclass(frozen=True)
class Signal:
    """Sorted, non-overlapping intervals; the value is unknown outside them."""

    points: tuple[Point, ...]

    def __post_init__(self) -> None:
        assert all(a.end <= b.start for a, b in itertools.pairwise(self.points))

    @cached_property
    def starts(self) -> list[float]:
        return [point.start for point in self.points]

    @property
    def horizon(self) -> float | None:
        """The end of the last interval (the forecast's horizon); None for an empty signal."""
        return self.points[-1].end if self.points else None

    @cached_property
    def boundaries(self) -> list[float]:
        """Every start and end, sorted: where the value may change."""
        return sorted({t for point in self.points for t in (point.start, point.end)})

    @cached_property
    def highest(self) -> float:
        return max((point.value for point in self.points), default=0.0)

    def integral(self, start: float, end: float) -> tuple[float, float]:
        """(value x seconds, seconds known) over [start, end]: the known part only. O(log n): from
        the running sums up to each end."""
        if end <= start:
            return 0.0, 0.0
        value_end, known_end = self._up_to(end)
        value_start, known_start = self._up_to(start)
        return value_end - value_start, known_end - known_start

    @cached_property
    def _sums(self) -> tuple[list[float], list[float]]:
        """Value x seconds and seconds known before each interval's start."""
        values, known = [0.0], [0.0]
        for point in self.points:
            values.append(values[-1] + (point.end - point.start) * point.value)
            known.append(known[-1] + point.end - point.start)
        return values, known

    def _up_to(self, at: float) -> tuple[float, float]:
        index = bisect.bisect_right(self.starts, at) - 1
        if index < 0:
            return 0.0, 0.0
        point = self.points[index]
        inside = min(at, point.end) - point.start
        values, known = self._sums
        return values[index] + inside * point.value, known[index] + inside


def build_signal(rows: Sequence[tuple[Any, Any, Any]], *, source: str) -> Signal:
    """A signal from (start, end, value) rows; `source` names where they came from in errors."""
    if len(rows) > MAX_POINTS:
        raise SignalError(f"price signal {source}: {len(rows)} intervals, at most {MAX_POINTS} are read")
    points = []
    for number, (start, end, value) in enumerate(rows, start=1):
        where = f"price signal {source}, interval {number}"
        try:
            point = Point(start=parse_time(start), end=parse_time(end), value=_value(value))
        except ValueError as err:
            raise SignalError(f"{where}: {err}") from None
        if point.end <= point.start:
            raise SignalError(f"{where}: end ({end}) must be after start ({start})")
        points.append(point)
    points.sort(key=lambda point: point.start)
    for before, after in itertools.pairwise(points):
        if after.start < before.end:
            raise SignalError(
                f"price signal {source}: intervals overlap ({_iso(before.start)}-{_iso(before.end)} and "
                f"{_iso(after.start)}-{_iso(after.end)}): each time may have one value"
            )
    return Signal(points=tuple(points))


def parse_csv(text: str, *, source: str) -> Signal:
    """A CSV document with the header `start,end,value`."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None:
        raise SignalError(f"price signal {source}: the file is empty; it needs the header start,end,value")
    if tuple(name.strip().lower() for name in header) != COLUMNS:
        raise SignalError(
            f"price signal {source}: the header is {','.join(header)!r}; it must be start,end,value"
        )
    rows: list[tuple[Any, Any, Any]] = []
    for line, row in enumerate(reader, start=2):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(COLUMNS):
            raise SignalError(
                f"price signal {source}, line {line}: {len(row)} columns, expected 3 (start,end,value)"
            )
        rows.append((row[0], row[1], row[2]))
    return build_signal(rows, source=source)


def parse_json(data: Any, *, source: str) -> Signal:
    """A JSON value `[{start, end, value}, ...]`."""
    if not isinstance(data, list):
        raise SignalError(f"price signal {source}: expected a JSON list of {{start, end, value}}")
    rows: list[tuple[Any, Any, Any]] = []
    for number, item in enumerate(data, start=1):
        if not isinstance(item, dict) or set(item) < set(COLUMNS):
            raise SignalError(f"price signal {source}, interval {number}: needs start, end and value")
        rows.append((item["start"], item["end"], item["value"]))
    return build_signal(rows, source=source)


def _value(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"value {_shown(value)} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"value {_shown(value)} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"value {_shown(value)} must be a finite number >= 0")
    return number


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Spec(Protocol):
    @property
    def uses_gpu(self) -> bool: ...


class _Ledger(Protocol):
    """A job as its cost ledger shows it (the API's JobPublic)."""

    @property
    def spec(self) -> _Spec: ...
    @property
    def resource_hours(self) -> float: ...
    @property
    def priced_hours(self) -> float: ...
    @property
    def cost(self) -> float: ...
    @property
    def cost_unit(self) -> str | None: ...


def job_cost_text(job: _Ledger) -> str:
    """A job's cost ledger in words (`apiary show`, the web view): '3.20 GPU-h, cost 1.45' or
    '3.20 GPU-h, 0.812 kg CO2e (2.00 GPU-h priced)'."""
    resource = "GPU" if job.spec.uses_gpu else "CPU"
    text = f"{job.resource_hours:.2f} {resource}-h"
    if job.priced_hours <= 0:
        return f"{text}, not priced (no price signal)"
    text += f", {job.cost:.3g} kg CO2e" if job.cost_unit == "carbon" else f", cost {job.cost:.4g}"
    if job.priced_hours < job.resource_hours * (1 - 1e-6):
        text += f" ({job.priced_hours:.2f} {resource}-h priced)"
    return text
