"""Sweep value: what ASHA's early stopping saves against random search without it, on the same search
space and seed, in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/sweep_value.py                      # seed 5, ~2-4 min
    PYTHONPATH=. .venv/bin/python benchmarks/sweep_value.py --seeds 5,1,2,3,4    # a pair per seed
    PYTHONPATH=. .venv/bin/python benchmarks/sweep_value.py --target 0.3

Per seed, two sweeps of the example file of docs/sweeps.md: the `mlp` over `config.lr` (loguniform
1e-4..1) and `config.hidden_sizes` (64, 128 or 256 wide), `method: random`, 24 trials, 4 at once,
400 steps of 32 rows each, eval every 20 steps (8 batches); one with `early_stopping: {method:
asha, min_steps: 20, reduction_factor: 3}` (rungs at 20, 60 and 180 steps), one without. Measured:
- the trials' CPU-seconds (and steps) until one of them first reports an `eval_loss` at or below
  the target (goal: ASHA >= 2x less). The target is `--target`, or else, per seed, the objective
  that only the best 1/8 of random search's trials reached (its 3rd best final `eval_loss`): a
  point of the finished measurement that neither sweep sees while it runs;
- the best `eval_loss` each sweep had seen within an equal budget: the CPU-seconds of ASHA's whole
  sweep (random search's is larger);
- each sweep's best trial as the service reports it.

What is real: the sweeps are created, searched and pruned by the service (`SweepService.create`,
`SweepRunner.tick` with its sampler and ASHA, on a SQLite database), their trials are jobs that the
scheduler admits and reconciles (`Scheduler.tick`), and they report through the telemetry path
(`JobService.ingest`), whose reply tells a pruned trial to stop. The training is the built-in `mlp`
recipe (`trainers.recipes.MLPRecipe`: its model, Adam, loss and `evaluate`) on
`api.demo.classification_table` data (4,096 training rows, 512 held out, 16 features, 10 classes),
each trial's spec exactly as its launch request hands it to a trainer.

What is not: the cluster is `tests.support.fakes.FakeBackend`, and the trials run in this process,
serially, one torch thread each (as a 1-CPU Ray worker), not on Ray. The trials the sweep holds at
once advance in lockstep, `eval.every_steps` steps at a time; after each such round the sweep's
runner and the scheduler tick once (the live service ticks on its clock, `sweep_interval_s`), and a
trial learns that it must stop from the reply to its next telemetry post, before its next step. The
CPU-seconds are the trials' training and eval compute only (`time.thread_time`); the control plane,
a trial's start-up, its data loading and checkpoints are not counted (in either sweep). The batches
are the training rows in an order drawn from (spec seed, epoch), not Ray Data's stream. The steps
column is the same count without the machine's noise: CPU-seconds of the same work vary with the
load of a shared machine, steps do not.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _common import command, machine  # noqa: E402

from api.demo import classification_table, write_shards  # noqa: E402
from service.auth import User  # noqa: E402
from service.cluster import RayJobStatus  # noqa: E402
from service.contract.protocol import LaunchRequest, MetricPoint, TelemetryBatch  # noqa: E402
from service.contract.sweep import SweepSpec, trial_spec  # noqa: E402
from service.runtime import Runtime  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store import repository  # noqa: E402
from service.sweeps import first_point  # noqa: E402
from tests.support.fakes import FakeBackend  # noqa: E402
from trainers.recipe import recipe_for  # noqa: E402

NUM_FEATURES, NUM_CLASSES = 16, 10
TRAIN_ROWS, EVAL_ROWS = 4096, 512


def sweep_file(*, train_uri: str, eval_uri: str, seed: int, asha: bool) -> dict[str, Any]:
    return {
        "name": "value-asha" if asha else "value-random",
        "base": {
            "name": "mlp",
            "trainer": "mlp",
            "num_workers": 1,
            "resources_per_worker": {"CPU": 1},
            "dataset": {"uri": train_uri},
            "eval": {"dataset": {"uri": eval_uri}, "every_steps": 20, "max_batches": 8},
            "max_steps": 400,
            "batch_size": 32,
            # Bad numerics are part of the search: a diverging trial goes on until the sweep stops it.
            "on_anomaly": "warn",
            "config": {"task": "classification", "num_classes": NUM_CLASSES},
        },
        "space": {
            "config.lr": {"loguniform": [1e-4, 1.0]},
            "config.hidden_sizes": {"choice": [[64], [128], [256]]},
        },
        "method": "random",
        "seed": seed,
        "max_trials": 24,
        "parallel": 4,
        "objective": {"metric": "eval_loss", "mode": "min"},
        **({"early_stopping": {"method": "asha", "min_steps": 20, "reduction_factor": 3}} if asha else {}),
    }


class Tables:
    """The training and held-out rows, in memory (the same rows the parquet shards hold)."""

    def __init__(self) -> None:
        self.train = classification_table(
            num_rows=TRAIN_ROWS, num_features=NUM_FEATURES, num_classes=NUM_CLASSES, seed=0
        )
        self.eval = classification_table(
            num_rows=EVAL_ROWS, num_features=NUM_FEATURES, num_classes=NUM_CLASSES, seed=1
        )


@dataclass
class TrialRun:
    """One trial's training, as its trainer runs it from the launch request."""

    request: LaunchRequest
    token: str
    tables: Tables
    step: int = 0
    cpu_s: float = 0.0
    model: Any = None
    optimizer: Any = None
    schedule: Any = None
    recipe: Any = None
    collate: Any = None
    eval_batches: list[Any] = field(default_factory=list)
    order: list[int] = field(default_factory=list)

    def start(self) -> None:
        spec = self.request.spec
        assert spec.dataset is not None
        started = time.thread_time()
        self.recipe = recipe_for(spec)
        row_shape = {"input_size": NUM_FEATURES}
        self.collate = self.recipe.build_collate(row_shape, uri=spec.dataset.uri)
        torch.manual_seed(spec.seed)
        self.model = self.recipe.build_model(row_shape)
        self.optimizer, self.schedule = self.recipe.build_optimizer(
            self.model, max_steps=spec.required_max_steps
        )
        assert spec.eval is not None and spec.eval.max_batches is not None
        size = spec.required_batch_size
        self.eval_batches = [
            self.collate(self.tables.eval.slice(i * size, size)) for i in range(spec.eval.max_batches)
        ]
        self.cpu_s += time.thread_time() - started

    @property
    def every_steps(self) -> int:
        assert self.request.spec.eval is not None and self.request.spec.eval.every_steps is not None
        return self.request.spec.eval.every_steps

    @property
    def done(self) -> bool:
        return self.step >= self.request.spec.required_max_steps

    def advance(self) -> dict[str, float]:
        """Train up to the next eval step, then evaluate: the eval metrics (`eval_loss`)."""
        spec = self.request.spec
        size = spec.required_batch_size
        per_epoch = TRAIN_ROWS // size
        started = time.thread_time()
        for _ in range(self.every_steps):
            epoch, index = divmod(self.step, per_epoch)
            if index == 0:
                generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + epoch)
                self.order = torch.randperm(TRAIN_ROWS, generator=generator).tolist()
            rows = self.tables.train.take(self.order[index * size : (index + 1) * size])
            loss = self.recipe.loss(self.model, self.collate(rows))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.schedule.step()
            self.step += 1
        self.model.eval()
        with torch.no_grad():
            total = sum(float(self.recipe.evaluate(self.model, batch)["loss"]) for batch in self.eval_batches)
        self.model.train()
        self.cpu_s += time.thread_time() - started
        return {"eval_loss": total / len(self.eval_batches)}


@dataclass
class Outcome:
    name: str
    cpu_s: float = 0.0  # the trials' compute, all of them, so far
    # Each eval: (the trials' CPU-seconds so far, their steps so far, its eval_loss).
    reports: list[tuple[float, int, float]] = field(default_factory=list)
    finals: list[float] = field(default_factory=list)  # the objective of each trial that succeeded
    states: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    reported_best: str = ""

    def to_target(self, target: float) -> tuple[float, int] | None:
        """The trials' (CPU-seconds, steps) when one of them first reported eval_loss <= target."""
        return next(((spent, steps) for spent, steps, loss in self.reports if loss <= target), None)

    def best_within(self, budget_s: float) -> float:
        seen = [loss for spent, _, loss in self.reports if spent <= budget_s + 1e-9 and math.isfinite(loss)]
        return min(seen, default=math.inf)


def run_sweep(runtime: Runtime, backend: FakeBackend, body: dict[str, Any], *, tables: Tables) -> Outcome:
    """Run one sweep to its end, recording every eval with the trials' CPU-seconds so far."""
    outcome = Outcome(name=body["name"])
    sweep = runtime.sweeps.create(SweepSpec.model_validate(body), by=User(name="bench"))
    trials: dict[int, tuple[str, TrialRun]] = {}
    seen = len(backend.submitted)
    while True:
        runtime.sweep_runner.tick()  # judge the trials at their rungs, start the next ones
        runtime.scheduler.tick()  # admit and submit them; reconcile the ended
        for submission_id, request in backend.submitted[seen:]:
            backend.statuses[submission_id] = RayJobStatus.RUNNING
            trial = TrialRun(request=request, token=backend.tokens[submission_id], tables=tables)
            trial.start()
            outcome.cpu_s += trial.cpu_s
            trials[request.job_id] = (submission_id, trial)
        seen = len(backend.submitted)
        runtime.scheduler.tick()
        with runtime.db.session() as session:  # type: ignore[union-attr]
            if repository.get_sweep(session, sweep.id).state != "running":
                break
        for job_id, (submission_id, trial) in list(trials.items()):
            attempt = trial.request.attempt
            if runtime.jobs.ingest(job_id, TelemetryBatch(attempt=attempt), token=trial.token).stop:
                del trials[job_id]  # pruned: it stops before its next step, and its Ray job ends
                backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
                continue
            before = trial.cpu_s
            values = trial.advance()
            outcome.cpu_s += trial.cpu_s - before
            outcome.steps += trial.every_steps
            outcome.reports.append((outcome.cpu_s, outcome.steps, values["eval_loss"]))
            point = MetricPoint(step=trial.step, rank=0, time=time.time(), values=values)
            runtime.jobs.ingest(job_id, TelemetryBatch(attempt=attempt, points=[point]), token=trial.token)
            if trial.done:
                del trials[job_id]
                backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
    view = runtime.sweeps.view(sweep.id)
    for trial_view in view.trials:
        state = trial_view.job.state.value
        outcome.states[state] = outcome.states.get(state, 0) + 1
        if state == "succeeded" and trial_view.objective is not None:
            outcome.finals.append(trial_view.objective)
    outcome.reported_best = view.sweep.message or ""
    return outcome


def warm_up(tables: Tables, request: LaunchRequest) -> None:
    """One round of a throwaway trial: the first torch calls' one-time costs fall on neither sweep."""
    trial = TrialRun(request=request, token="", tables=tables)
    trial.start()
    trial.advance()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="5", help="comma-separated: one pair of sweeps per seed")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="the eval_loss a trial must reach; default: per seed, the objective that only the best "
        "1/8 of random search's trials reached (its ceil(max_trials/8)-th best final eval_loss)",
    )
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    torch.set_num_threads(1)
    started = time.perf_counter()
    tables = Tables()
    results: list[tuple[int, float, Outcome, Outcome]] = []
    with tempfile.TemporaryDirectory(prefix="apiary-sweep-value-") as workdir:
        root = Path(workdir)
        train_uri, eval_uri = (root / "train").as_uri(), (root / "eval").as_uri()
        write_shards(tables.train, train_uri, num_shards=2)
        write_shards(tables.eval, eval_uri, num_shards=1)
        settings = Settings(
            data_dir=root / "data", data_roots=str(root), local_user="bench", tensorboard=False
        )
        backend = FakeBackend(nodes=[{"CPU": 16.0}])
        runtime = Runtime(settings, backend=backend, run_scheduler=False)
        runtime.start()
        try:
            for seed in seeds:
                files = [
                    sweep_file(train_uri=train_uri, eval_uri=eval_uri, seed=seed, asha=asha)
                    for asha in (True, False)
                ]
                if not results:
                    spec = SweepSpec.model_validate(files[0])
                    warm_up(
                        tables,
                        LaunchRequest(
                            job_id=1,
                            attempt=1,
                            spec=trial_spec(spec, first_point(spec), index=0),
                            storage_uri=root.as_uri(),
                            run_name="warm-up",
                            telemetry_url=None,
                            data_cpus=1.0,
                        ),
                    )
                asha, plain = (run_sweep(runtime, backend, body, tables=tables) for body in files)
                top = math.ceil(files[1]["max_trials"] / 8)
                target = args.target if args.target is not None else sorted(plain.finals)[top - 1]
                results.append((seed, target, asha, plain))
        finally:
            runtime.stop()
    print(f"# {machine()}")
    print(f"# {command()}")
    print(
        f"# wall {time.perf_counter() - started:.0f} s; CPU-s: the trials' compute; "
        "budget: ASHA's whole sweep"
    )
    print(
        f"{'seed':>4s} {'target':>7s} | {'CPU-s to target: ASHA':>21s} {'random':>7s} {'ratio':>6s} | "
        f"{'steps: ASHA':>11s} {'random':>7s} {'ratio':>6s} | {'budget':>6s} {'best: ASHA':>10s} "
        f"{'random':>7s} | ASHA's trials"
    )
    ratios = []
    for seed, target, asha, plain in results:
        budget_s = min(asha.cpu_s, plain.cpu_s)
        asha_at, plain_at = asha.to_target(target), plain.to_target(target)
        cpu_ratio = steps_ratio = math.nan
        if asha_at is not None and plain_at is not None:
            cpu_ratio, steps_ratio = plain_at[0] / asha_at[0], plain_at[1] / asha_at[1]
        ratios.append(cpu_ratio)
        states = ", ".join(f"{count} {state}" for state, count in sorted(asha.states.items()))
        print(
            f"{seed:4d} {target:7.4f} | {_at(asha_at, 0):>21s} {_at(plain_at, 0):>7s} {cpu_ratio:5.2f}x | "
            f"{_at(asha_at, 1):>11s} {_at(plain_at, 1):>7s} {steps_ratio:5.2f}x | {budget_s:6.2f} "
            f"{asha.best_within(budget_s):10.4f} {plain.best_within(budget_s):7.4f} | {states}"
        )
    for seed, _, asha, plain in results:
        print(
            f"  seed {seed}: whole sweeps: ASHA {asha.cpu_s:.2f} CPU-s, {asha.steps} steps, "
            f"{asha.reported_best}; random {plain.cpu_s:.2f} CPU-s, {plain.steps} steps, "
            f"{plain.reported_best}"
        )
    finite = [ratio for ratio in ratios if math.isfinite(ratio)]
    if finite:
        median = statistics.median(finite)
        verdict = "met" if median >= 2 else "not met"
        print(
            f"CPU-seconds to the target, random / ASHA: median {median:.2f}x over {len(finite)} seed(s) "
            f"(goal >= 2x: {verdict})"
        )


def _at(reached: tuple[float, int] | None, index: int) -> str:
    if reached is None:
        return "never"
    return f"{reached[0]:.2f}" if index == 0 else str(reached[1])


if __name__ == "__main__":
    main()
