"""Recovery time per failure kind, and a chaos run: real kills of a running job's processes.

    .venv/bin/python benchmarks/recovery.py                  # each failure kind once, then the chaos run
    .venv/bin/python benchmarks/recovery.py --chaos-kills 6 --seed 2

One `apiary serve` (SQLite, its own local Ray, a temporary data dir) trains the e2e tests' job
(`mlp`, 2 workers of 1 CPU, checkpoint every `--every` steps). First undisturbed: the reference.
Then once per failure kind, killed for real once it passes the first checkpoint:

- worker: SIGKILL of one Ray Train worker. Ray Train restarts the group from the checkpoint.
- driver: SIGKILL of the job's driver (`python -m trainers.launch`). The service resubmits the job
  as attempt 2 from the checkpoint.
- service: SIGKILL of `apiary serve`, restarted on its port by this script (as a supervisor would).
  The job trains on; the restarted service adopts it.
- ray: SIGKILL of the local Ray's whole process group. The service starts a new local Ray and
  resubmits the job from the checkpoint.

Per kind:
- recovery: from the kill to the first training step after the resume, on the trainers' own clock
  (the metric point's time). For the service, no step is lost: recovery runs until the restarted
  service is healthy and shows the job's latest step.
- steps lost: the last step trained before the failure minus the step the run resumed from.
- identical: the run's final parameters compared with the reference's (`torch.equal` on every
  tensor) and its loss curve (the curve that counted) with the reference's.

Goals on this machine: worker <= 15 s, the others <= 30 s.

Chaos: one longer job, with `--chaos-kills` kills at seeded random steps, cycling through worker,
driver and service. Each kill waits until the job trains again after the previous one. The run must
end identical to its own undisturbed reference, and the report lists every failure with its lost
work. It stops by itself: a bounded number of kills, each with a timeout.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from api.client import ApiaryClient  # noqa: E402
from api.demo import classification_table, write_shards  # noqa: E402
from api.schemas import JobPublic, MetricPublic  # noqa: E402
from tests.e2e.conftest import Served, start_serve, stop_serve  # noqa: E402
from tests.support.processes import job_driver, train_workers  # noqa: E402
from trainers.checkpoint import build_model_from_checkpoint  # noqa: E402

KINDS = ("worker", "driver", "service", "ray")
GOALS_S = {"worker": 15.0, "driver": 30.0, "service": 30.0, "ray": 30.0}


@dataclass
class Failure:
    kind: str
    killed_at_step: int
    recovery_s: float
    steps_lost: int
    resumed_from: int | None


def spec(dataset: str, name: str, *, steps: int, every: int) -> dict[str, Any]:
    return {
        "name": name,
        "trainer": "mlp",
        "num_workers": 2,
        "resources_per_worker": {"CPU": 1},
        "dataset": {"uri": dataset},
        "max_steps": steps,
        "batch_size": 16,
        "max_failures": 10,
        # A converged classifier's gradient norm jumps 10-100x its mean on a hard batch (a 6,000-step
        # run of this job had 30 such steps): the default rollback would stop it. Not under test here.
        "on_anomaly": "warn",
        "checkpoint": {"every_steps": every},
        "config": {"task": "classification", "num_classes": 3, "lr": 0.01},
    }


class Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.database_url = f"sqlite:///{root / 'apiary.db'}"
        self.serves = 0
        self.served = self._start()

    def _start(self, port: int | None = None) -> Served:
        self.serves += 1
        return start_serve(
            data_dir=self.data_dir,
            database_url=self.database_url,
            log=self.root / f"serve-{self.serves}.log",
            port=port,
        )

    def client(self) -> ApiaryClient:
        return ApiaryClient(self.served.url)

    def restart_killed_service(self) -> None:
        port = int(self.served.url.rsplit(":", 1)[1])
        self.served.process.kill()
        self.served.process.wait(30)
        self.served = self._start(port)

    def stop(self) -> None:
        stop_serve(self.served)


def wait_for_step(client: ApiaryClient, job_id: int, step: int, timeout_s: float = 300) -> JobPublic:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(job_id)
        if job.state in ("succeeded", "failed", "cancelled"):
            raise RuntimeError(f"job {job_id} ended ({job.state}: {job.message}) before step {step}")
        if job.state == "running" and (job.latest_step or 0) >= step:
            return job
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} did not reach step {step} within {timeout_s:g} s")


def segments(client: ApiaryClient, job_id: int) -> dict[tuple[int, int], list[MetricPublic]]:
    """Rank 0's points of every (attempt, segment), as trained."""
    by_segment: dict[tuple[int, int], list[MetricPublic]] = {}
    for point in client.metrics(job_id, rank=0, segments="all", limit=100_000):
        by_segment.setdefault((point.attempt, point.segment), []).append(point)
    return by_segment


def kill(bench: Bench, kind: str, job_id: int) -> float:
    """Kill what `kind` names; returns the time of the kill."""
    if kind == "worker":
        pids = train_workers()
        assert pids, "no Ray Train worker is running"
        killed_at = time.time()
        os.kill(pids[-1], signal.SIGKILL)
    elif kind == "driver":
        pid = job_driver(job_id)
        assert pid is not None, f"no driver of job {job_id} is running"
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
    elif kind == "ray":
        killed_at = time.time()
        os.killpg(int(bench.served.ray_state()["pid"]), signal.SIGKILL)
    else:
        killed_at = time.time()
        bench.restart_killed_service()
    return killed_at


def recover(bench: Bench, kind: str, job_id: int, *, at_step: int) -> Failure:
    """Kill at `at_step` and measure until the job trains again."""
    with bench.client() as client:
        wait_for_step(client, job_id, at_step)
        before = segments(client, job_id)
    killed_at = kill(bench, kind, job_id)
    current = max(before)
    with bench.client() as client:
        if kind == "service":
            job = client.get(job_id)  # the restarted service is healthy: it answers with the job
            recovery_s = time.time() - killed_at
            after = segments(client, job_id)
            lost = 0 if set(after) == set(before) else -1  # -1: the service kill made it retrain
            return Failure(kind, job.latest_step or 0, recovery_s, lost, None)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            after = segments(client, job_id)
            new = [key for key in after if key > current]
            if new and after[min(new)]:
                break
            time.sleep(0.2)
        else:
            job = client.get(job_id)
            timeline = "\n".join(f"  {e.at} {e.actor}: {e.reason}" for e in client.events(job_id))
            raise TimeoutError(
                f"job {job_id} did not train again within 300 s of the {kind} kill; it is {job.state} "
                f"(attempt {job.attempt}):\n{timeline}"
            )
        first = min(after[min(new)], key=lambda point: point.step)
        last_before = max(point.step for point in after[current])
        resumed_from = first.step - 1
        return Failure(kind, last_before, first.time - killed_at, last_before - resumed_from, resumed_from)


def finish(bench: Bench, job_id: int, reference: JobPublic) -> tuple[JobPublic, bool]:
    """The job once it ended, and whether it is identical to `reference`."""
    with bench.client() as client:
        job = client.wait(job_id, timeout_s=900)
        return job, identical(client, job, reference)


def identical(client: ApiaryClient, job: JobPublic, reference: JobPublic) -> bool:
    if job.state != "succeeded":
        return False
    curve = {(p.step, p.rank): p.values["loss"] for p in client.metrics(job.id, limit=100_000)}
    expected = {(p.step, p.rank): p.values["loss"] for p in client.metrics(reference.id, limit=100_000)}
    final = build_model_from_checkpoint(urlparse(job.latest_checkpoint or "").path).state_dict()
    want = build_model_from_checkpoint(urlparse(reference.latest_checkpoint or "").path).state_dict()
    return (
        curve == expected
        and final.keys() == want.keys()
        and all(torch.equal(final[k], v) for k, v in want.items())
    )


def run_reference(bench: Bench, dataset: str, *, steps: int, every: int, name: str) -> JobPublic:
    with bench.client() as client:
        job = client.wait(client.submit(spec(dataset, name, steps=steps, every=every)).id, timeout_s=600)
    if job.state != "succeeded":
        raise RuntimeError(f"the reference run failed: {job.message}")
    return job


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3000, help="steps of each per-kind job")
    parser.add_argument("--every", type=int, default=1000, help="checkpoint interval in steps")
    parser.add_argument("--kinds", default=",".join(KINDS), help="failure kinds to measure, comma-separated")
    parser.add_argument("--chaos-kills", type=int, default=4, help="kills in the chaos run (0: no chaos run)")
    parser.add_argument("--chaos-steps", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="apiary-recovery-") as temporary:
        root = Path(temporary)
        dataset = (root / "clf").as_uri()
        write_shards(
            classification_table(num_rows=1024, num_features=8, num_classes=3), dataset, num_shards=4
        )
        bench = Bench(root)
        try:
            report(bench, dataset, args)
        finally:
            bench.stop()


def report(bench: Bench, dataset: str, args: argparse.Namespace) -> None:
    kill_step = args.every + args.every // 3  # past the first checkpoint: a third of an interval lost
    reference = run_reference(bench, dataset, steps=args.steps, every=args.every, name="reference")
    print(f"reference: {args.steps} steps, checkpoint every {args.every}, killed at step >= {kill_step}\n")
    print("| failure | recovery (s) | goal (s) | steps lost | resumed from | attempt | identical |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for kind in [kind for kind in args.kinds.split(",") if kind]:
        with bench.client() as client:
            job_id = client.submit(spec(dataset, f"kill-{kind}", steps=args.steps, every=args.every)).id
        failure = recover(bench, kind, job_id, at_step=kill_step)
        job, same = finish(bench, job_id, reference)
        print(
            f"| {kind} | {failure.recovery_s:.1f} | {GOALS_S[kind]:g} | {failure.steps_lost} | "
            f"{failure.resumed_from if failure.resumed_from is not None else '-'} | {job.attempt} | "
            f"{'yes' if same else 'NO'} |",
            flush=True,
        )

    if args.chaos_kills:
        chaos(bench, dataset, args)
    print(
        f"\n- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"- command: `{' '.join(['python', 'benchmarks/recovery.py', *sys.argv[1:]])}`")


def chaos(bench: Bench, dataset: str, args: argparse.Namespace) -> None:
    steps, every = args.chaos_steps, max(1, args.chaos_steps // 10)
    reference = run_reference(bench, dataset, steps=steps, every=every, name="chaos-reference")
    rng = random.Random(args.seed)
    points = sorted(rng.sample(range(every + 1, steps - every), args.chaos_kills))
    kinds = [("worker", "driver", "service")[index % 3] for index in range(args.chaos_kills)]
    print(f"\nchaos (seed {args.seed}): {steps} steps, checkpoint every {every}, kills at steps {points}\n")
    print("| # | failure | at step | recovery (s) | steps lost |")
    print("| ---: | --- | ---: | ---: | ---: |")
    with bench.client() as client:
        job_id = client.submit(spec(dataset, "chaos", steps=steps, every=every)).id
    total_lost = 0
    for number, (kind, step) in enumerate(zip(kinds, points, strict=True), start=1):
        try:
            failure = recover(bench, kind, job_id, at_step=step)
        except RuntimeError as err:  # the job ended before this kill: the run was faster than the plan
            print(f"| {number} | {kind} | - | - | - ({err}) |")
            break
        total_lost += max(0, failure.steps_lost)
        print(
            f"| {number} | {kind} | {failure.killed_at_step} | {failure.recovery_s:.1f} | "
            f"{failure.steps_lost} |",
            flush=True,
        )
    job, same = finish(bench, job_id, reference)
    print(
        f"\nchaos run: {job.state}, attempt {job.attempt}, restarts {job.restarts}, failures "
        f"{job.failures}, {total_lost} steps trained twice; identical to the undisturbed run: "
        f"{'yes' if same else 'NO'}"
    )


if __name__ == "__main__":
    main()
