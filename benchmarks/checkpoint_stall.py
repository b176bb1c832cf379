"""Checkpoint stall benchmark: training time lost per checkpoint, async (snapshot + background write) vs a
synchronous save + fsync of the same state, side by side in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_stall.py                # 1 and 2 workers, ~3 min
    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_stall.py --workers 1

What it measures: `trainers.checkpoint.Checkpointer.end_step`, the code the Ray Train loop calls after
every step (the ranks' one collective, the host-memory snapshot, the background `CheckpointWriter`
with its staging, fsync, sha256 and move into the run folder, and the completion marker), in plain
`torch.distributed` gloo processes without Ray: `ray.train.report` (with `NO_UPLOAD`, a small message
to the controller, the same in both modes) is left out. The synchronous side is what a loop without
any of that does at the same steps: `torch.save` of the same state dict (model and AdamW state, rank 0
of DDP) into the run folder, then `fsync`, before the next step.

Each rank trains an MLP (4 x 1536-wide linear layers: 9.4M parameters, ~113 MB with the AdamW
moments), DDP over gloo with one torch thread per rank (as Ray Train gives a 1-CPU worker), and runs
three modes in turn, several rounds: no checkpoint, sync every K steps, async every K steps. The
stall per checkpoint of a mode is (its time for the steps - the no-checkpoint time) / checkpoints,
medians over rounds. Goal: async <= 5% of sync with one worker. With 2 workers on this 2-core machine
the writer thread competes with the two ranks for the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from service.contract.protocol import LaunchRequest
from service.contract.spec import JobSpec
from trainers.checkpoint import (
    Checkpointer,
    CheckpointWriter,
    TrainParts,
    TrainState,
    checkpoint_dir_name,
)
from trainers.telemetry import Telemetry

WIDTH = 1536
LAYERS = 4
BATCH = 64


class TimedWriter(CheckpointWriter):
    """`CheckpointWriter` that adds up how long optimizer steps waited for a snapshot's copy."""

    waited_s = 0.0

    def wait_copied(self) -> None:
        started = time.perf_counter()
        super().wait_copied()
        self.waited_s += time.perf_counter() - started


class LocalCheckpointer(Checkpointer):
    """`Checkpointer` outside Ray Train: the run folder is given and nothing is reported to Ray."""

    def _report(self, path: str | None, *, step: int) -> None:
        pass

    def _writer_for(self, *, sharded: bool) -> CheckpointWriter:
        assert not sharded  # DDP here: no process group of the writer's own
        if self._writer is None:
            self._writer = TimedWriter(run_path=self.run_path, filesystem=self.filesystem)
        return self._writer

    @property
    def waited_s(self) -> float:
        return self._writer.waited_s if isinstance(self._writer, TimedWriter) else 0.0


def build(seed: int) -> TrainParts:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model: nn.Module = nn.Sequential(*layers)
    if dist.get_world_size() > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return TrainParts(model=model, optimizer=optimizer, lr_schedule=lr_schedule)


def state_bytes(parts: TrainParts) -> int:
    tensors = list(parts.model.state_dict().values())
    tensors += [t for s in parts.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def train(
    parts: TrainParts, *, steps: int, mode: str, every: int, checkpointer: LocalCheckpointer, run_dir: Path
) -> tuple[float, float]:
    """Seconds for `steps` steps with checkpoints every `every` steps in `mode` (none, sync, async), and
    seconds of those spent inside the checkpoint calls and in optimizer steps waiting for a copy."""
    rank = dist.get_rank()
    state = TrainState()
    lr_schedule = parts.lr_schedule
    assert lr_schedule is not None
    inside = 0.0
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        batch = torch.randn(BATCH, WIDTH)
        loss = parts.model(batch).square().mean()
        parts.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        parts.optimizer.step()
        lr_schedule.step()
        state.advance(epoch=0, samples=BATCH)
        call_started = time.perf_counter()
        if mode == "async":
            checkpointer.end_step(parts, state, metrics={}, stop_requested=False)
        elif mode == "sync" and state.step % every == 0 and rank == 0:
            contents = {
                "model": parts.model.state_dict(),
                "optimizer": parts.optimizer.state_dict(),
                "lr_schedule": lr_schedule.state_dict(),
                "step": state.step,
            }
            folder = run_dir / checkpoint_dir_name(state.step)
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "state.pt", "wb") as stream:
                torch.save(contents, stream)
                stream.flush()
                os.fsync(stream.fileno())
        elif mode == "none":
            dist.all_reduce(torch.zeros(3, dtype=torch.int32))  # the per-step collective async has
        inside += time.perf_counter() - call_started
    dist.barrier()
    elapsed = time.perf_counter() - started
    return elapsed, inside + checkpointer.waited_s


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parts = build(seed=0)
    with tempfile.TemporaryDirectory(prefix="apiary-stall-", dir=args.workdir) as root:
        root_path = Path(root)
        box: list[Any] = [root if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        root_path = Path(box[0])
        times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        inside: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        for round_index in range(args.rounds + 1):  # round 0 warms up
            for mode in ("none", "sync", "async"):
                run_dir = root_path / f"{mode}-{round_index}"
                spec = JobSpec.model_validate(
                    {
                        "name": "stall",
                        "trainer": "mlp",
                        "num_workers": world_size,
                        "dataset": {"uri": "file:///unused"},
                        "max_steps": 10**9,  # no final checkpoint inside the timed steps
                        "batch_size": BATCH,
                        "config": {"num_classes": 2},
                        "checkpoint": {"every_steps": args.every, "async": True},
                    }
                )
                request = LaunchRequest(
                    job_id=1,
                    attempt=1,
                    spec=spec,
                    storage_uri=str(root_path),
                    run_name=run_dir.name,
                    telemetry_url=None,
                )
                telemetry = Telemetry(url=None, attempt=1, rank=rank)
                with LocalCheckpointer(
                    request,
                    row_shape={"input_size": WIDTH},
                    rank=rank,
                    telemetry=telemetry,
                    storage=(str(run_dir), pafs.LocalFileSystem()),
                ) as checkpointer:
                    elapsed, in_calls = train(
                        parts,
                        steps=args.steps,
                        mode=mode,
                        every=args.every,
                        checkpointer=checkpointer,
                        run_dir=run_dir,
                    )
                    checkpointer.flush()  # the last write may still be in flight: not timed
                if round_index > 0:
                    times[mode].append(elapsed)
                    inside[mode].append(in_calls)
                if rank == 0:
                    for folder in run_dir.glob("checkpoint_*"):
                        for file in folder.rglob("*"):
                            if file.is_file():
                                file.unlink()
        if rank == 0:
            results.put({"times": times, "inside": inside, "state_bytes": state_bytes(parts)})
    dist.destroy_process_group()


def measure(world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = 29_500 + os.getpid() % 1000 + world_size
    processes = [
        context.Process(target=worker, args=(rank, world_size, port, args, results))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    result = results.get(timeout=3600)
    for process in processes:
        process.join()
    times, inside = result["times"], result["inside"]
    checkpoints = args.steps // args.every
    # Other processes on the machine only ever add time: the least disturbed round of each mode.
    base = min(times["none"])
    stall = {mode: (min(times[mode]) - base) / checkpoints for mode in ("sync", "async")}
    in_calls = {
        mode: (statistics.median(inside[mode]) - statistics.median(inside["none"])) / checkpoints
        for mode in ("sync", "async")
    }
    return {
        "world_size": world_size,
        "state_mb": result["state_bytes"] / 1e6,
        "step_s": base / args.steps,
        "sync_stall_s": stall["sync"],
        "async_stall_s": stall["async"],
        "ratio": stall["async"] / stall["sync"],
        "sync_in_calls_s": in_calls["sync"],
        "async_in_calls_s": in_calls["async"],
        "times": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=40, help="steps per timed run")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per mode (after one warm-up)")
    parser.add_argument("--workdir", default=None, help="where the run folders go (default: the temp dir)")
    args = parser.parse_args()
    for world_size in args.workers:
        r = measure(world_size, args)
        print(
            f"{world_size} worker(s): state {r['state_mb']:.0f} MB, step {r['step_s'] * 1000:.0f} ms; "
            f"stall per checkpoint: sync {r['sync_stall_s'] * 1000:.0f} ms, "
            f"async {r['async_stall_s'] * 1000:.1f} ms; async / sync = {r['ratio']:.3f}"
        )
        print(
            f"    in the training thread's checkpoint calls and copy waits, per checkpoint: sync "
            f"{r['sync_in_calls_s'] * 1000:.0f} ms, async {r['async_in_calls_s'] * 1000:.1f} ms; "
            f"async / sync = {r['async_in_calls_s'] / r['sync_in_calls_s']:.3f}"
        )
        for mode, values in r["times"].items():
            print(f"    {mode:5s} {', '.join(f'{v:.2f}' for v in values)} s for {args.steps} steps")


if __name__ == "__main__":
    main()
