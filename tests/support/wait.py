"""Polling, the one way the tests wait for something that happens elsewhere (a thread, a process, Ray)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None],
    *,
    timeout_s: float,
    interval_s: float = 0.1,
    what: str = "the condition",
) -> T:
    """Call `condition` until it returns something truthy, and return that; AssertionError after
    `timeout_s`. An exception from `condition` ends the wait at once (e.g. a process that exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(interval_s)
