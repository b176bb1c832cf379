"""Find the processes of a local Ray job on this machine (from /proc), to kill them as a failure would, and
the processes that hold a secret in their command line or environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def environ(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode(errors="replace")
    except OSError:
        return ""


def pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descends_from(pid: int, ancestor: int | None) -> bool:
    """Whether `ancestor` (None: any) started `pid`, or started what started it, and so on."""
    if ancestor is None:
        return True
    current: int | None = pid
    while current is not None and current > 1:
        if current == ancestor:
            return True
        current = parent(current)
    return False


def train_workers(ray: int | None = None) -> list[int]:
    """Ray Train worker processes (their title is `ray::RayTrainWorker...`); with `ray`, only those of
    the local Ray whose first process is `ray` (serve's local Ray: its pid), not another Ray's on the
    same machine."""
    workers = [pid for pid in pids() if cmdline(pid).startswith("ray::RayTrainWorker")]
    return [pid for pid in workers if descends_from(pid, ray)]


def job_driver(job_id: int, ray: int | None = None) -> int | None:
    """The `python -m trainers.launch` driver of Apiary job `job_id` (of the local Ray `ray`)."""
    for pid in pids():
        if (
            "-m trainers.launch" in cmdline(pid)
            and f'"job_id":{job_id},' in environ(pid).replace(" ", "")
            and descends_from(pid, ray)
        ):
            return pid
    return None


def alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def processes_holding(secret: str, *, besides: set[int]) -> list[str]:
    """The processes (of those this user may read) but `besides` (the service's own, the test's) whose
    command line or environment holds `secret`."""
    return [
        f"{part} of pid {pid}: {text[:200]!r}"
        for pid in pids()
        if pid not in besides
        for part, text in (("cmdline", cmdline(pid)), ("environ", environ(pid)))
        if secret in text
    ]


def run_test_in_own_process(test_file: str, name: str, *, flag: str, timeout_s: float) -> None:
    """Run test `name` of `test_file` in a pytest process of its own, with `flag`=1 in its environment
    (the test skips itself without it); assert that it passed. For a test whose driver joins a Ray
    cluster of its own while this process stays connected to another one."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{test_file}::{name}"],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, flag: "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    output = result.stdout[-5000:] + result.stderr[-2000:]
    assert result.returncode == 0 and " passed" in result.stdout, output
