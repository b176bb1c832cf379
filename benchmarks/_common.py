"""What the benchmarks share: the machine line each prints for `benchmarks/RESULTS.md`, and a fresh
PostgreSQL database for the ones that measure both databases.

A benchmark runs as a script from the repository root (`python benchmarks/NAME.py`); its one line of
preamble puts the repository on `sys.path` (`sys.path.insert(0, str(ROOT))`), then it imports this
module (`from _common import ...`: the script's folder is first on `sys.path`).
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from contextlib import AbstractContextManager
from pathlib import Path

from tests.support.databases import fresh_postgres_database

ROOT = Path(__file__).resolve().parents[1]
# The server a benchmark creates its throwaway databases on (APIARY_BENCH_PG_URL to change it).
PG_ADMIN_URL = os.environ.get("APIARY_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def postgres_database() -> AbstractContextManager[str]:
    """A new, empty database on `PG_ADMIN_URL` (its URL), dropped at the end."""
    return fresh_postgres_database(PG_ADMIN_URL, prefix="apiary_bench")


def machine() -> str:
    """This machine and the load it ran under: one line for RESULTS.md."""
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{platform.node()}: {platform.machine()}, {os.cpu_count()} cores, {memory_gib:.0f} GiB, "
        f"{platform.python_implementation()} {platform.python_version()}; load {load} (1/5/15 min)"
    )


def command() -> str:
    """The command line that ran this benchmark."""
    return shlex.join([Path(sys.executable).name, *sys.argv])
