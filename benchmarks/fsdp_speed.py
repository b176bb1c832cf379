"""FSDP speed: training throughput of FSDP's variants against DDP, on the same gloo ranks, in one run.

    .venv/bin/python benchmarks/fsdp_speed.py                 # small and large gpt, 2 ranks (~3 min here)
    .venv/bin/python benchmarks/fsdp_speed.py --sizes small --rounds 5

Plain `torch.distributed` with `--world-size` gloo processes on CPU (no Ray: the wrapping is the same
`trainers.parallel.parallelize` the Ray Train loop calls). For each model size, every round builds
the built-in `gpt` model from the same seed under each variant in turn: DDP (the baseline), and FSDP
with each `fsdp.units` (blocks | model) and `fsdp.reshard_after_forward` (true | false); trains
`--warmup` steps, then times `--steps` steps of the `gpt` loss, backward and AdamW. A variant's figure
is its median samples/s over the rounds; the ratio is against DDP's median in the same run (the
variants alternate within each round, so a busy machine slows them alike).

Also per variant: the state a rank keeps between steps (its parameters, gradients and AdamW moments,
its shards under FSDP) against DDP's, which should be about 1/N; and the one-worker case, where a job
of one worker with `strategy: fsdp` runs unwrapped (`parallelize(..., max_workers=1)`), timed against
DDP's single rank the same way (`--one-worker`).

2 ranks of gloo on CPU give FSDP no overlap of communication with compute (gloo's collectives run on
the same cores), so what FSDP costs here is an upper bound of what it costs on GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.spec import FsdpSpec, FsdpUnits, JobSpec, Strategy
from trainers.parallel import is_sharded, parallelize
from trainers.registry import builtin_trainer

SIZES = {
    # name: gpt config (the small model, and the ~63M-parameter one of fsdp_memory.py)
    "small": {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 4},
    "large": {"vocab_size": 8192, "d_model": 768, "n_layers": 8, "n_heads": 12},
}
SEQ_LEN = {"small": 64, "large": 128}
VARIANTS: dict[str, tuple[Strategy, FsdpSpec | None]] = {
    "ddp": (Strategy.DDP, None),
    "fsdp blocks, reshard": (Strategy.FSDP, FsdpSpec(units=FsdpUnits.BLOCKS, reshard_after_forward=True)),
    "fsdp blocks, keep": (Strategy.FSDP, FsdpSpec(units=FsdpUnits.BLOCKS, reshard_after_forward=False)),
    "fsdp model, reshard": (Strategy.FSDP, FsdpSpec(units=FsdpUnits.MODEL, reshard_after_forward=True)),
    "fsdp model, keep": (Strategy.FSDP, FsdpSpec(units=FsdpUnits.MODEL, reshard_after_forward=False)),
}


def make_spec(size: str, *, strategy: Strategy, fsdp: FsdpSpec | None, args: argparse.Namespace) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "fsdp-speed",
            "trainer": "gpt",
            "num_workers": args.world_size,
            "strategy": strategy.value,
            "fsdp": (fsdp or FsdpSpec()).model_dump(),
            "precision": args.precision,
            "dataset": {"uri": "file:///unused"},
            "max_steps": args.warmup + args.steps,
            "batch_size": args.batch_size,
            "config": SIZES[size],
        }
    )


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer moments (local shards under FSDP)."""

    def local(tensor: torch.Tensor) -> torch.Tensor:
        to_local = getattr(tensor, "to_local", None)
        return to_local() if to_local is not None else tensor

    total = 0
    for parameter in model.parameters():
        total += local(parameter).nbytes
        if parameter.grad is not None:
            total += local(parameter.grad).nbytes
    for state in optimizer.state.values():
        total += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def time_variant(
    size: str, variant: str, *, rank: int, world_size: int, args: argparse.Namespace, max_workers: int
) -> tuple[float, int]:
    """(samples/s over all ranks, this rank's state bytes) for one variant."""
    strategy, fsdp = VARIANTS[variant]
    spec = make_spec(size, strategy=strategy, fsdp=fsdp, args=args)
    trainer = builtin_trainer(spec)
    torch.manual_seed(0)
    model = parallelize(
        trainer.build_model({"seq_len": SEQ_LEN[size] + 1}),
        strategy=strategy,
        device=torch.device("cpu"),
        fsdp=fsdp,
        precision=args.precision,
        max_workers=max_workers,
    )
    assert is_sharded(model) == (strategy is Strategy.FSDP and max_workers > 1)
    optimizer, _ = trainer.build_optimizer(model, max_steps=spec.max_steps)
    generator = torch.Generator().manual_seed(rank)
    vocab = SIZES[size]["vocab_size"]

    def step() -> None:
        tokens = torch.randint(0, vocab, (args.batch_size, SEQ_LEN[size] + 1), generator=generator)
        loss = trainer.loss(model, {"tokens": tokens})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    if world_size > 1:
        dist.barrier()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    if world_size > 1:
        dist.barrier()
    elapsed = time.perf_counter() - started
    return args.steps * args.batch_size * world_size / elapsed, state_bytes(model, optimizer)


def _worker(rank: int, world_size: int, folder: str, args: argparse.Namespace, out: Any) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=Path(folder, "rendezvous").as_uri(), rank=rank, world_size=world_size
    )
    results: dict[str, dict[str, list[float]]] = {}
    max_workers = 1 if world_size == 1 else world_size
    variants = list(VARIANTS) if world_size > 1 else ["ddp", "fsdp blocks, reshard"]
    for size in args.sizes.split(","):
        for round_ in range(args.rounds):
            # Alternate the order each round, so that no variant always runs first (or last).
            order = variants if round_ % 2 == 0 else list(reversed(variants))
            for variant in order:
                rate, state = time_variant(
                    size, variant, rank=rank, world_size=world_size, args=args, max_workers=max_workers
                )
                entry = results.setdefault(f"{size}/{variant}", {"rate": [], "state": []})
                entry["rate"].append(rate)
                entry["state"].append(state)
    if rank == 0:
        out.put(results)
        out.close()
        out.join_thread()  # flushed before os._exit below
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see tests/unit/test_trainer_parallel.py: no interpreter finalization after FSDP2


def run(world_size: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        processes = [
            context.Process(target=_worker, args=(rank, world_size, folder, args, out))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        results: dict[str, dict[str, list[float]]] = out.get(timeout=3600)
        for process in processes:
            process.join(600)
    return results


def report(results: dict[str, dict[str, list[float]]], *, world_size: int) -> None:
    sizes = sorted({key.split("/")[0] for key in results}, key=list(SIZES).index)
    for size in sizes:
        base = results[f"{size}/ddp"]
        base_rate, base_state = statistics.median(base["rate"]), base["state"][0]
        print(f"  {size} gpt {SIZES[size]}, {world_size} rank(s):")
        for variant in VARIANTS:
            entry = results.get(f"{size}/{variant}")
            if entry is None:
                continue
            rate = statistics.median(entry["rate"])
            label = variant if world_size > 1 or variant == "ddp" else "fsdp (one worker: unwrapped)"
            state = entry["state"][0]
            print(
                f"    {label:<28} {rate:8.1f} samples/s  {rate / base_rate:5.2f}x DDP   "
                f"state/rank {state / 2**20:7.1f} MiB ({state / base_state:.2f} of DDP's)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--one-worker", action="store_true", help="also time one worker: fsdp vs ddp")
    args = parser.parse_args()
    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"host {socket.gethostname()}, load {tuple(round(x, 1) for x in os.getloadavg())}"
    )
    print(f"{args.world_size} gloo ranks, {args.precision}, {args.rounds} rounds of {args.steps} steps:")
    report(run(args.world_size, args), world_size=args.world_size)
    if args.one_worker:
        print("one worker:")
        report(run(1, args), world_size=1)
    print(f"load after {tuple(round(x, 1) for x in os.getloadavg())}")
    print("command: .venv/bin/python benchmarks/fsdp_speed.py " + shlex.join(sys.argv[1:]))


if __name__ == "__main__":
    main()
