"""FSDP speed: training throughput of FSDP's variants against DDP, on the same ranks, in one run.

    .venv/bin/python benchmarks/fsdp_speed.py                 # small and large gpt, 2 gloo ranks
    .venv/bin/python benchmarks/fsdp_speed.py --sizes small --rounds 5 --one-worker
    .venv/bin/python benchmarks/fsdp_speed.py --sizes large --rounds 1 --steps 5 --breakdown
    .venv/bin/python benchmarks/fsdp_speed.py --device cuda --world-size 2 --precision bf16

Plain `torch.distributed` with `--world-size` processes, gloo on CPU or NCCL on CUDA (one GPU per
rank; no Ray: the wrapping is the same `trainers.parallel.parallelize` the Ray Train loop calls). For
each model size, every round builds the built-in `gpt` model from the same seed under each variant
in turn: DDP (the baseline), and FSDP with one unit per block (`fsdp.units: blocks`, with
`reshard_after_forward` true and false) and one unit for the whole model (`model`); the report marks
the variant that the default `fsdp.units: auto` picks on this device. Each variant trains
`--warmup` steps, then times `--steps` steps of the `gpt` loss (under the job's precision, as the
loop runs it), backward and AdamW. A variant's figure is its median samples/s over the rounds; the
ratio is against DDP's median in the same run (the variants alternate within each round, so a busy
machine slows them alike).

Also per variant: the state a rank keeps between steps (its parameters, gradients and AdamW moments,
its shards under FSDP) against DDP's, which should be about 1/N; and the one-worker case, where a job
of one worker with `strategy: fsdp` runs unwrapped (`parallelize(..., max_workers=1)`), timed against
DDP's single rank the same way (`--one-worker`).

`--breakdown` also profiles one more step of each variant in the last round, on every rank
(`torch.profiler`), and splits it: the wall time of forward (with the loss), backward and the
optimizer step; the time the collectives took by kind (on CPU, gloo runs each on its own thread
while the rank waits or computes; on CUDA, the NCCL kernels' GPU time); and the rank's own thread:
compute, time in c10d calls, in FSDP's or DDP's hooks (copies into and out of the collectives'
buffers, DDP's buckets), in DTensor dispatch, and idle (waiting for a collective or for a core).

gloo on CPU gives FSDP no overlap of communication with compute (its collectives run on the same
cores) and has no reduce-scatter of its own (the profile shows one all-reduce of the whole buffer
per reduce-scatter), so what FSDP costs here is an upper bound of what it costs on GPUs with NCCL.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.contract.spec import FsdpSpec, FsdpUnits, JobSpec, Strategy
from trainers.parallel import autocast, fsdp_units, is_sharded, parallelize, param_bytes
from trainers.recipe import recipe_for, split_loss

SIZES = {
    # name: gpt config (the small model, and the ~63M-parameter one of fsdp_memory.py)
    "small": {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 4},
    "large": {"vocab_size": 8192, "d_model": 768, "n_layers": 8, "n_heads": 12},
}
SEQ_LEN = {"small": 64, "large": 128}
# name: (strategy, FSDP options). With units `model` the one unit is the root, which FSDP2 never
# reshards after forward (trainers/parallel.py), so `reshard_after_forward` changes nothing there.
VARIANTS: dict[str, tuple[Strategy, FsdpSpec | None]] = {
    "ddp": (Strategy.DDP, None),
    "fsdp-blocks-reshard": (Strategy.FSDP, FsdpSpec(units=FsdpUnits.BLOCKS, reshard_after_forward=True)),
    "fsdp-blocks-keep": (Strategy.FSDP, FsdpSpec(units=FsdpUnits.BLOCKS, reshard_after_forward=False)),
    "fsdp-model": (Strategy.FSDP, FsdpSpec(units=FsdpUnits.MODEL)),
}


def default_variant(size: str, *, device: torch.device, args: argparse.Namespace) -> str:
    """The variant that the spec's defaults (`FsdpSpec()`) amount to for `size` on `device`."""
    defaults = FsdpSpec()
    trainer = recipe_for(make_spec(size, strategy=Strategy.FSDP, fsdp=defaults, args=args))
    with torch.device("meta"):  # the parameters' sizes, without their memory
        model = trainer.build_model({"seq_len": SEQ_LEN[size] + 1})
    if fsdp_units(defaults, device=device, param_bytes=param_bytes(model)) is FsdpUnits.MODEL:
        return "fsdp-model"
    return "fsdp-blocks-reshard" if defaults.reshard_after_forward else "fsdp-blocks-keep"


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


def rank_device(rank: int, args: argparse.Namespace) -> torch.device:
    return torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")


def synchronize(device: torch.device, world_size: int) -> None:
    """Every rank's queued work done: the GPU's kernels, then all ranks at one point."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if world_size > 1:
        dist.barrier()


def build_variant(
    size: str, variant: str, *, rank: int, args: argparse.Namespace, max_workers: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(model, optimizer, step function) of one variant, built from the same seed on every rank."""
    strategy, fsdp = VARIANTS[variant]
    spec = make_spec(size, strategy=strategy, fsdp=fsdp, args=args)
    trainer = recipe_for(spec)
    device = rank_device(rank, args)
    torch.manual_seed(0)
    model = parallelize(
        trainer.build_model({"seq_len": SEQ_LEN[size] + 1}),
        strategy=strategy,
        device=device,
        fsdp=fsdp,
        precision=args.precision,
        max_workers=max_workers,
    )
    assert is_sharded(model) == (strategy is Strategy.FSDP and max_workers > 1)
    optimizer, _ = trainer.build_optimizer(model, max_steps=spec.required_max_steps)
    generator = torch.Generator().manual_seed(rank)
    vocab = SIZES[size]["vocab_size"]

    def step() -> None:
        # As trainers/loop.py runs a step: forward and loss under the job's precision, then the rest.
        tokens = torch.randint(0, vocab, (args.batch_size, SEQ_LEN[size] + 1), generator=generator)
        with record_function("phase: forward"), autocast(args.precision, device=device, model=model):
            loss, _ = split_loss(trainer.loss(model, {"tokens": tokens.to(device)}))
        optimizer.zero_grad(set_to_none=True)
        with record_function("phase: backward"):
            loss.backward()
        with record_function("phase: optimizer"):
            optimizer.step()

    return model, optimizer, step


def time_variant(
    size: str,
    variant: str,
    *,
    rank: int,
    world_size: int,
    args: argparse.Namespace,
    max_workers: int,
    profile: bool = False,
) -> tuple[float, int, dict[str, float] | None]:
    """(samples/s over all ranks, this rank's state bytes, and with `profile` the split of one more
    step on this rank) for one variant."""
    model, optimizer, step = build_variant(size, variant, rank=rank, args=args, max_workers=max_workers)
    device = rank_device(rank, args)
    for _ in range(args.warmup):
        step()
    synchronize(device, world_size)
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(device, world_size)
    elapsed = time.perf_counter() - started
    rate = args.steps * args.batch_size * world_size / elapsed
    return (
        rate,
        state_bytes(model, optimizer),
        profile_step(step, device=device, world_size=world_size) if profile else None,
    )


# Collective kinds, by the words in a profiler event's name (gloo:all_gather, ncclDevKernel_AllGather...).
COLLECTIVES = {
    "all-gather": ("all_gather", "allgather"),
    "reduce-scatter": ("reduce_scatter", "reducescatter"),
    "all-reduce": ("all_reduce", "allreduce"),
}
# CPU work a wrapper does around its collectives: FSDP2's hooks (copy-in/out), DDP's reducer (buckets).
HOOK_RANGES = ("FSDP::", "fsdp::", "torch::distributed::reducer", "torch.distributed.ddp.reducer")
PHASES = ("forward", "backward", "optimizer")
SPLIT = ("step", *PHASES, *COLLECTIVES, "compute", "c10d calls", "hooks", "DTensor", "idle")
SPLIT_NOTE = {
    "cpu": "gloo runs the collectives on its own thread (a reduce-scatter as an all-reduce of the whole "
    "buffer); the rest is the rank's own thread: compute, time in c10d calls, in FSDP's or DDP's hooks, "
    "in DTensor dispatch, and idle (waiting for collectives or for a core)",
    "cuda": "collectives: NCCL kernel time on the GPU; the rest is the rank's CPU thread",
}


def split_step(profiler: torch.profiler.profile, *, device: torch.device) -> dict[str, float]:
    """ms of one profiled step (without "step", the caller's wall time): see SPLIT_NOTE."""
    split = dict.fromkeys(SPLIT[1:], 0.0)
    busy_ms = 0.0
    for event in profiler.events():
        name, lowered = event.name, event.name.lower()
        kind = next((k for k, words in COLLECTIVES.items() if any(w in lowered for w in words)), None)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if kind is not None and "nccl" in lowered:
                split[kind] += event.device_time_total / 1e3
            continue
        self_ms = event.self_cpu_time_total / 1e3  # 0 for gloo's collectives: they run elsewhere
        busy_ms += self_ms
        if name.startswith("phase: "):
            split[name.removeprefix("phase: ")] += event.cpu_time_total / 1e3
        if lowered.startswith("gloo:") and kind is not None:
            split[kind] += event.cpu_time_total / 1e3
        elif name.startswith("c10d::"):
            split["c10d calls"] += self_ms
        elif name == "PythonSubclass":
            split["DTensor"] += self_ms
        else:
            # Self time inside a hook's range: each event once, so nothing is counted twice.
            parent = event
            while parent is not None and not parent.name.startswith(HOOK_RANGES):
                parent = parent.cpu_parent
            split["hooks" if parent is not None else "compute"] += self_ms
    split["idle"] = -busy_ms  # the caller adds the step's wall time
    return split


def split_text(split: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.0f}" for name, value in split.items())


def profile_step(step: Callable[[], None], *, device: torch.device, world_size: int) -> dict[str, float]:
    """The split of one more `step` on this rank, profiled (see SPLIT_NOTE)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        started = time.perf_counter()
        step()
        synchronize(device, world_size)
        wall_ms = (time.perf_counter() - started) * 1e3
    split = split_step(profiler, device=device)
    split["idle"] += wall_ms
    return {"step": wall_ms, **split}


def _worker(rank: int, world_size: int, folder: str, args: argparse.Namespace, out: Any) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        init_method=Path(folder, "rendezvous").as_uri(),
        rank=rank,
        world_size=world_size,
    )
    results: dict[str, dict[str, list[Any]]] = {}
    max_workers = 1 if world_size == 1 else world_size
    variants = args.variants if world_size > 1 else ["ddp", "fsdp-model"]
    for size in args.sizes.split(","):
        for round_ in range(args.rounds):
            # Alternate the order each round, so that no variant always runs first (or last).
            order = variants if round_ % 2 == 0 else list(reversed(variants))
            for variant in order:
                rate, state, split = time_variant(
                    size,
                    variant,
                    rank=rank,
                    world_size=world_size,
                    args=args,
                    max_workers=max_workers,
                    profile=args.breakdown and world_size > 1 and round_ == args.rounds - 1,
                )
                entry = results.setdefault(f"{size}/{variant}", {"rate": [], "state": []})
                entry["rate"].append(rate)
                entry["state"].append(state)
                if split is not None:
                    # Every rank's split, in rank order (rank 0 reports them).
                    gathered: list[dict[str, float] | None] = [None] * world_size
                    dist.all_gather_object(gathered, split)
                    entry["split"] = [value for value in gathered if value is not None]
                if rank == 0:  # as it goes: a run cut short still shows what it measured
                    print(f"    ({size} {variant}, round {round_ + 1}: {rate:.1f} samples/s)", flush=True)
                    if split is not None:
                        print(
                            f"    ({size} {variant}, rank 0's profiled step, ms: {split_text(split)})",
                            flush=True,
                        )
    if rank == 0:
        out.put(results)
        out.close()
        out.join_thread()  # flushed before os._exit below
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see tests/unit/test_trainer_parallel.py: no interpreter finalization after FSDP2


def run(world_size: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        processes = [
            context.Process(target=_worker, args=(rank, world_size, folder, args, out))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        results: dict[str, dict[str, Any]] = out.get(timeout=3600)
        for process in processes:
            process.join(600)
    return results


def report(
    results: dict[str, dict[str, Any]], *, world_size: int, device: torch.device, args: argparse.Namespace
) -> None:
    sizes = sorted({key.split("/")[0] for key in results}, key=list(SIZES).index)
    for size in sizes:
        default = default_variant(size, device=device, args=args)
        base = results[f"{size}/ddp"]
        base_rate, base_state = statistics.median(base["rate"]), base["state"][0]
        print(f"  {size} gpt {SIZES[size]}, {world_size} rank(s):")
        for variant in VARIANTS:
            entry = results.get(f"{size}/{variant}")
            if entry is None:
                continue
            rate = statistics.median(entry["rate"])
            if world_size == 1:
                label = variant if variant == "ddp" else "fsdp (one worker: unwrapped)"
            else:
                label = variant + (" (default)" if variant == default else "")
            state = entry["state"][0]
            print(
                f"    {label:<30} {rate:8.1f} samples/s  {rate / base_rate:5.2f}x DDP   "
                f"state/rank {state / 2**20:7.1f} MiB ({state / base_state:.2f} of DDP's)"
            )
        splits = {variant: results.get(f"{size}/{variant}", {}).get("split") for variant in VARIANTS}
        if any(splits.values()):
            print(f"  {size} gpt, one profiled step, ms, mean over ranks ({SPLIT_NOTE[device.type]}):")
            print(f"    {'variant':<30}" + "".join(f"{column:>15}" for column in SPLIT))
            for variant, split in splits.items():
                if split:
                    means = [statistics.fmean(rank_split[column] for rank_split in split) for column in SPLIT]
                    print(f"    {variant:<30}" + "".join(f"{mean:15.1f}" for mean in means))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU a rank, NCCL")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from: {', '.join(VARIANTS)} (ddp, the baseline, is always run)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--one-worker", action="store_true", help="also time one worker: fsdp vs ddp")
    parser.add_argument(
        "--breakdown", action="store_true", help="also profile one step of each variant: where its time goes"
    )
    args = parser.parse_args()
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    args.variants = ["ddp", *(name for name in VARIANTS if name in names and name != "ddp")]
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        parser.error(
            f"--device cuda --world-size {args.world_size} needs as many GPUs; "
            f"torch sees {torch.cuda.device_count()}"
        )
    device = torch.device(args.device)
    gpus = f", {torch.cuda.get_device_name(0)}" if args.device == "cuda" else ""
    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs{gpus}, torch {torch.__version__}, "
        f"host {socket.gethostname()}, load {tuple(round(x, 1) for x in os.getloadavg())}"
    )
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"{args.world_size} {backend} ranks, {args.precision}, {args.rounds} rounds of {args.steps} steps:")
    report(run(args.world_size, args), world_size=args.world_size, device=device, args=args)
    if args.one_worker:
        print("one worker:")
        report(run(1, args), world_size=1, device=device, args=args)
    print(f"load after {tuple(round(x, 1) for x in os.getloadavg())}")
    print("command: .venv/bin/python benchmarks/fsdp_speed.py " + shlex.join(sys.argv[1:]))


if __name__ == "__main__":
    main()
