"""Prices and costs: the service's price signal (`APIARY_PRICE_SIGNAL`), read at run time, and what
each job costs by it.

The signal's format is `service.contract.signal`'s; this module reads it (a file, or an HTTP endpoint
that answers JSON) and reads it again every `price_signal_refresh_s`. A file that is bad when the
service starts stops the start with a clear error (`check_at_start`); a signal that cannot be read at
run time (an endpoint down, a file rewritten badly) leaves `PriceSignal.current` without one: the policy
then defers nothing (deferrable jobs start like any other, and their waiting reasons say why), and
the log says so once per change.

The cost ledger: every active job's gang costs, per hour it holds it, its GPUs (its CPUs when it has no
GPU) x the signal's value, in the unit `APIARY_PRICE_SIGNAL_UNIT` names:
- `price`: the value is a price per GPU-hour (CPU-hour); the cost is in that currency;
- `carbon`: the value is a carbon intensity in gCO2e/kWh; the cost is kg CO2e, with each GPU (CPU)
  drawing `APIARY_GPU_POWER_KW` (`APIARY_CPU_POWER_KW`).
Time the signal does not cover adds resource-hours but no cost (`priced_hours` says how much was priced).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service.contract.errors import one_line
from service.contract.signal import Signal, SignalError, parse_csv, parse_json
from service.scheduling.deferral import Deferral

logger = logging.getLogger(__name__)

Unit = Literal["price", "carbon"]
MAX_SIGNAL_BYTES = 16 * 1024 * 1024


def read_signal(source: str, *, timeout_s: float) -> Signal:
    """The signal at `source`: an http(s) URL answering JSON, else a CSV file's path."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=timeout_s) as answer:
                body = answer.read(MAX_SIGNAL_BYTES + 1)
        except (OSError, ValueError) as err:
            raise SignalError(f"price signal {source} cannot be read: {one_line(err)}") from None
        if len(body) > MAX_SIGNAL_BYTES:
            raise SignalError(f"price signal {source}: larger than {MAX_SIGNAL_BYTES} bytes")
        try:
            data = json.loads(body)
        except ValueError as err:
            raise SignalError(f"price signal {source}: not JSON ({one_line(err)})") from None
        return parse_json(data, source=source)
    path = Path(source)
    try:
        if path.stat().st_size > MAX_SIGNAL_BYTES:
            raise SignalError(f"price signal {source}: larger than {MAX_SIGNAL_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SignalError(f"price signal {source} cannot be read: {one_line(err)}") from None
    return parse_csv(text, source=source)


def check_at_start(source: str | None) -> None:
    """A bad signal FILE stops the start (a mistake to fix now); an endpoint is only read at run time
    (one that is down now may be up in a minute)."""
    if source is not None and not source.startswith(("http://", "https://")):
        read_signal(source, timeout_s=0)


class PriceSignal:
    """The signal as the scheduler sees it: read again every `refresh_s`, None while it cannot be.

    A file is read in the scheduler's pass (it is quick). An endpoint is read there only the first
    time (so that a restarted service does not start every deferrable job before it has a signal);
    after that, in a thread of its own, so that a slow endpoint never holds up a pass (the scheduler's
    lease lasts seconds): the pass goes on with what the last read gave.
    """

    def __init__(self, source: str | None, *, refresh_s: float, timeout_s: float = 5.0) -> None:
        self.source = source
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        # (signal, why there is none): replaced in one assignment, so a pass never sees half of a read.
        self._state: tuple[Signal | None, str] = (None, "no price signal (APIARY_PRICE_SIGNAL is not set)")
        self._read_at: float | None = None
        self._reading: threading.Thread | None = None

    @property
    def problem(self) -> str:
        return self._state[1]

    def current(self, now: float) -> Signal | None:
        if self.source is None:
            return None
        if self._read_at is None or now - self._read_at >= self.refresh_s:
            first, self._read_at = self._read_at is None, now
            if first or not self.source.startswith(("http://", "https://")):
                self._read()
            elif self._reading is None or not self._reading.is_alive():
                self._reading = threading.Thread(target=self._read, name="apiary-price-signal", daemon=True)
                self._reading.start()
        return self._state[0]

    def deferral(self, now: float, *, margin_s: float) -> Deferral:
        signal = self.current(now)
        return Deferral(signal=signal, margin_s=margin_s, unavailable=self.problem)

    def join(self, timeout_s: float) -> None:
        """Wait for a read under way in its thread (tests, and a clean stop)."""
        if self._reading is not None:
            self._reading.join(timeout_s)

    def _read(self) -> None:
        assert self.source is not None
        try:
            signal = read_signal(self.source, timeout_s=self.timeout_s)
        except SignalError as err:
            if err.message != self.problem:
                logger.warning(
                    "%s: deferrable jobs start like any other job until it can be read",
                    err.message,
                    extra={"action": "price_signal_unreadable", "source": self.source},
                )
            self._state = (None, err.message)
            return
        if self._state[0] is None:
            logger.info("price signal %s read", self.source, extra={"action": "price_signal_read"})
        self._state = (signal, "")


@dataclass(frozen=True, kw_only=True)
class Rates:
    """How a job's hours become cost (the module docstring)."""

    unit: Unit = "price"
    gpu_power_kw: float = 0.7
    cpu_power_kw: float = 0.01


@dataclass(frozen=True, kw_only=True)
class Accrued:
    resource_hours: float  # GPU-hours, or CPU-hours for a job without GPUs
    priced_hours: float  # the part of them the signal covered
    cost: float  # in the unit's terms (a currency, or kg CO2e)


@dataclass(frozen=True, kw_only=True)
class OwnerCost:
    """What one owner's jobs of a queue have cost (GET /queues); `owner` None: the whole queue's."""

    owner: str | None
    unit: str | None  # price | carbon; None for jobs whose ledger has not run yet
    resource_hours: float
    priced_hours: float
    cost: float


def sum_costs(rows: Sequence[OwnerCost]) -> list[OwnerCost]:
    """The totals of `rows` per unit (a queue's, from its owners')."""
    totals: dict[str | None, OwnerCost] = {}
    for row in rows:
        before = totals.get(
            row.unit, OwnerCost(owner=None, unit=row.unit, resource_hours=0, priced_hours=0, cost=0)
        )
        totals[row.unit] = OwnerCost(
            owner=None,
            unit=row.unit,
            resource_hours=before.resource_hours + row.resource_hours,
            priced_hours=before.priced_hours + row.priced_hours,
            cost=before.cost + row.cost,
        )
    return list(totals.values())


def charged_resource(resources: dict[str, float]) -> tuple[str, float]:
    """What a gang is charged for: ('GPU', its GPUs), or ('CPU', its CPUs) when it has no GPU."""
    gpus = resources.get("GPU", 0.0)
    return ("GPU", gpus) if gpus > 0 else ("CPU", resources.get("CPU", 0.0))


def accrue(
    signal: Signal | None, *, resources: dict[str, float], start: float, end: float, rates: Rates
) -> Accrued:
    """What holding `resources` (a gang's totals) over [start, end] costs."""
    kind, count = charged_resource(resources)
    seconds = max(0.0, end - start)
    value_s, known_s = signal.integral(start, end) if signal is not None else (0.0, 0.0)
    cost = count * value_s / 3600
    if rates.unit == "carbon":
        cost *= (rates.gpu_power_kw if kind == "GPU" else rates.cpu_power_kw) / 1000  # g/kWh x kWh -> kg
    return Accrued(resource_hours=count * seconds / 3600, priced_hours=count * known_s / 3600, cost=cost)
