"""Can a job's Ray worker processes be started in advance, with torch imported, for its actors?

    .venv/bin/python benchmarks/worker_reuse.py

Ray Train runs the controller and every rank as an actor. An actor needs a worker process of its
own job and runtime_env; this checks whether an idle worker process that already ran a task of the
same job, with the same runtime_env (the way to start one early and import torch in it), is given to
an actor, with and without a placement group (Ray Train places its workers in one). It prints the
process ids: the same id means reuse. With Ray 2.60 it does not happen, so a warm pool of task
workers cannot speed up a Train worker group's start (benchmarks/RESULTS.md, start-up).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

RUNTIME_ENV = {"env_vars": {"APIARY_WARM": "1"}}


@ray.remote(num_cpus=0, runtime_env=RUNTIME_ENV)
def warm() -> int:
    import torch  # noqa: F401  # what a warm worker would hold already

    return os.getpid()


class _Rank:
    def pid(self) -> int:
        return os.getpid()


Rank: Any = ray.remote(num_cpus=1, runtime_env=RUNTIME_ENV)(_Rank)


def main() -> None:
    ray.init(num_cpus=4, include_dashboard=False)
    print(f"ray {ray.__version__}")
    for placed in (False, True):
        warm_pids = set(ray.get([warm.remote() for _ in range(2)]))
        time.sleep(0.5)  # the task workers are idle in the pool now
        if placed:
            group = placement_group([{"CPU": 1}] * 2)
            ray.get(group.ready())
        started = time.monotonic()
        ranks = [
            Rank.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
                if placed
                else "DEFAULT",
            ).remote()
            for i in range(2)
        ]
        rank_pids = set(ray.get([rank.pid.remote() for rank in ranks]))
        print(
            f"{'in a placement group' if placed else 'no placement group'}: idle task workers "
            f"{sorted(warm_pids)}, actors {sorted(rank_pids)} in {time.monotonic() - started:.2f} s: "
            f"{'REUSED' if warm_pids & rank_pids else 'not reused (fresh processes)'}"
        )
        for rank in ranks:
            ray.kill(rank)
    ray.shutdown()


if __name__ == "__main__":
    main()
