"""Start-up milestones of a job's processes, for finding where the seconds before step 1 go.

Each process of a job (the driver, the Train controller, every Train worker) records named marks with
the wall clock (`mark`), and one of its lines in the job's log (`emit`) carries them all:

    apiary-startup {"role": "driver", "pid": 123, "marks": {"process_started": 1764633600.12, ...}}

Ray forwards the controller's and the workers' output to the driver's log, so one log holds every
process's line; `benchmarks/overhead.py` reads them back and splits the time from submission to the
end of step 1. `process_started` is the kernel's own start time of the process (from /proc), so the
marks also show what a process spent before any of its Python code ran (the interpreter, Ray's
worker start-up, imports). A mark costs a dict assignment; nothing here imports torch or Ray.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import cache

PREFIX = "apiary-startup"

_marks: dict[str, float] = {}


def mark(name: str) -> bool:
    """Record `name` at the current wall-clock time, the first time only (a rollback that builds the
    model again keeps the first start's marks); True when this call recorded it."""
    if name in _marks:
        return False
    _marks[name] = time.time()
    return True


def marks() -> dict[str, float]:
    """This process's marks so far, `process_started` first where the platform tells it."""
    started = process_started_at()
    return ({"process_started": started} if started is not None else {}) | _marks


def emit(role: str) -> None:
    """Print this process's marks as one `apiary-startup` line (stdout: Ray forwards it to the job log)."""
    line = json.dumps({"role": role, "pid": os.getpid(), "marks": marks()}, separators=(",", ":"))
    print(f"{PREFIX} {line}", file=sys.stdout, flush=True)


def parse(log: str) -> list[dict[str, object]]:
    """Every `apiary-startup` record in a job's log, in order (Ray prefixes forwarded lines)."""
    records = []
    for line in log.splitlines():
        _, found, payload = line.partition(f"{PREFIX} ")
        if found:
            try:
                records.append(json.loads(payload))
            except ValueError:
                continue  # a line cut by the log's rotation
    return records


@cache
def process_started_at() -> float | None:
    """The unix time at which the kernel started this process (Linux: /proc), or None elsewhere."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as stat:
            # Field 22 (starttime, in clock ticks since boot) comes after the command name, which is in
            # parentheses and may itself hold spaces.
            fields = stat.read().rpartition(")")[2].split()
        with open("/proc/uptime") as uptime:
            # Seconds since boot now, read beside the wall clock (btime in /proc/stat is whole seconds).
            now, since_boot = time.time(), float(uptime.read().split()[0])
        return now - since_boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
