"""`benchmarks/overhead_breakdown.py` pauses processes and moves them between cores: only the right
ones, and never leaves one stopped or moved."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from overhead_breakdown import Proc, classify, core_split, descendants, isolated, paused


def stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"


def settles(check: Callable[[], bool], timeout_s: float = 5) -> bool:
    """Signals land asynchronously: True once `check()` holds, False if it never does in time."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def tree() -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """A stand-in for `apiary serve` (a shell with two sleeping children) and a process outside it."""
    root = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"])
    outsider = subprocess.Popen(["sleep", "60"])
    deadline = time.monotonic() + 10
    while len(descendants(root.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield root, outsider
    for process in (root, outsider):
        process.kill()
        process.wait()


def test_pauses_only_descendants_and_resumes_them(tree: tuple[subprocess.Popen[bytes], ...]) -> None:
    root, outsider = tree
    children = [proc.pid for proc in descendants(root.pid)]
    assert len(children) == 2  # the two sleeps, not the shell itself

    with paused(root.pid, {"cluster"}) as paused_procs:  # a plain `sleep` counts as a cluster process
        assert sorted(proc.pid for proc in paused_procs) == sorted(children)
        assert settles(lambda: all(stopped(pid) for pid in children))
        assert not stopped(outsider.pid)
        assert not stopped(root.pid)  # the root is paused only with 'api'
    assert settles(lambda: not any(stopped(pid) for pid in children))


def test_resumes_on_error(tree: tuple[subprocess.Popen[bytes], ...]) -> None:
    root, _ = tree
    children = [proc.pid for proc in descendants(root.pid)]
    with pytest.raises(KeyboardInterrupt), paused(root.pid, {"cluster", "api"}):
        assert settles(lambda: all(stopped(pid) for pid in [root.pid, *children]))
        raise KeyboardInterrupt
    assert settles(lambda: not any(stopped(pid) for pid in [root.pid, *children]))


def test_classify_keeps_ranks_running() -> None:
    assert classify(Proc(1, "ray::RayTrainWorker")) == "rank"
    assert classify(Proc(2, "ray::TrainController.run")) == "job"
    assert classify(Proc(3, "ray::IDLE")) == "job"
    assert classify(Proc(4, "/venv/bin/python3 -m trainers.launch --request-file r.json")) == "job"
    assert classify(Proc(5, "ray::DashboardAgent")) == "cluster"
    assert classify(Proc(6, "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet")) == "cluster"


def cores_of_threads(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="moving processes between cores needs 2 cores")
def test_isolated_splits_the_cores_and_gives_them_back() -> None:
    rank_cores, other_cores = core_split()
    assert rank_cores and other_cores and not rank_cores & other_cores
    everything = rank_cores | other_cores
    # A stand-in `apiary serve` with a rank (its title set as Ray sets it), a helper with a second
    # thread, and a process outside it.
    helper_code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start()"
    root = subprocess.Popen(
        [
            "bash",
            "-c",
            f"(exec -a ray::RayTrainWorker sleep 60) & {sys.executable} -c '{helper_code}' & wait",
        ],
        start_new_session=True,
    )
    outsider = subprocess.Popen(["sleep", "60"])
    try:
        assert settles(
            lambda: sum(len(os.listdir(f"/proc/{p.pid}/task")) for p in descendants(root.pid)) == 3, 10
        )
        procs = descendants(root.pid)
        rank = next(p.pid for p in procs if classify(p) == "rank")
        helper = next(p.pid for p in procs if classify(p) != "rank")

        with (
            pytest.raises(KeyboardInterrupt),
            isolated(root.pid, rank_cores=rank_cores, other_cores=other_cores) as moved,
        ):
            assert sorted(p.pid for p in moved) == sorted([helper, root.pid])  # the ranks are not listed
            assert cores_of_threads(rank) == [rank_cores]
            assert cores_of_threads(helper) == [other_cores, other_cores]  # every thread
            assert cores_of_threads(root.pid) == [other_cores]
            assert os.sched_getaffinity(outsider.pid) == everything
            raise KeyboardInterrupt  # the cores come back on an error too
        for pid in (rank, helper, root.pid):
            assert cores_of_threads(pid) == [everything] * len(cores_of_threads(pid))
    finally:
        os.killpg(root.pid, signal.SIGKILL)  # the shell and its children
        outsider.kill()
        for process in (root, outsider):
            process.wait()
