"""FSDP memory: peak memory per worker of FSDP versus DDP, on a `gpt` model large enough to show sharding.

    .venv/bin/python benchmarks/fsdp_memory.py

One run does both sides, one after the other (so they never share the machine's memory): plain
`torch.distributed` with 2 gloo processes on CPU (no Ray: the wrapping is the same
`trainers.parallel.parallelize` the Ray Train loop calls, and Ray would only add its own constant
per-process cost). Each rank builds the built-in `gpt` model (~63M parameters by default), wraps it
for the strategy, builds the `gpt` AdamW optimizer and trains `--steps` steps on random tokens.

Figures per rank (the largest over ranks):
- state: bytes of what a rank keeps between steps, counted from the tensors themselves: its
  parameters, gradients and AdamW moments (its shards under FSDP). The goal is about 1/N of DDP's.
- peak: the process's peak resident memory during the training steps (VmHWM, reset with
  /proc/self/clear_refs once the model is wrapped and the optimizer built) minus its resident
  memory before the model was built: state plus activations, DDP's gradient buckets and FSDP's
  transient all-gathered blocks. Building the model (fully, on every rank, before sharding; the
  loop does the same) is not part of it. glibc's malloc keeps freed blocks of the sizes it has seen
  (its mmap threshold grows with them), which under FSDP's gather-and-free pattern counted ~0.7 GB
  of freed memory as resident here; the workers run with a fixed `MALLOC_MMAP_THRESHOLD_` so large
  tensors are mapped and unmapped and resident memory follows live memory (for both sides).
The report ends with the machine and the command, for `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import shlex
import socket
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

# Run as a script from the repository root: make `service` and `trainers` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.contract.spec import JobSpec, Strategy
from trainers.parallel import clip_grad_norm, parallelize
from trainers.recipe import recipe_for, split_loss

MIB = 1 << 20


def make_spec(args: argparse.Namespace, strategy: Strategy) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "fsdp-memory",
            "trainer": "gpt",
            "num_workers": args.world_size,
            "strategy": strategy.value,
            "dataset": {"uri": "file:///unused"},
            "max_steps": args.steps,
            "batch_size": args.batch_size,
            "config": {
                "vocab_size": args.vocab_size,
                "d_model": args.d_model,
                "n_layers": args.n_layers,
                "n_heads": args.n_heads,
            },
        }
    )


def _proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _release_freed_memory() -> None:
    """Return freed heap pages to the OS, so resident memory counts only live tensors."""
    gc.collect()
    # Without glibc there is no malloc_trim; resident memory may then include freed pages.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def worker(rank: int, world_size: int, spec_json: str, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        spec = JobSpec.model_validate_json(spec_json)
        seq_len = 65
        _release_freed_memory()
        baseline = _proc_status_bytes("VmRSS")

        torch.manual_seed(spec.seed)
        trainer = recipe_for(spec)
        model = trainer.build_model({"seq_len": seq_len})
        num_parameters = sum(p.numel() for p in model.parameters())
        model = parallelize(model, strategy=spec.strategy, device=torch.device("cpu"))
        optimizer, _ = trainer.build_optimizer(model, max_steps=spec.required_max_steps)
        _release_freed_memory()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident memory

        generator = torch.Generator().manual_seed(rank)
        vocab_size = trainer.config.vocab_size
        started = time.perf_counter()
        for _ in range(spec.required_max_steps):
            tokens = torch.randint(0, vocab_size, (spec.required_batch_size, seq_len), generator=generator)
            loss, _ = split_loss(trainer.loss(model, {"tokens": tokens}))
            optimizer.zero_grad(set_to_none=True)  # as the loop does; the last step's gradients stay
            loss.backward()
            clip_grad_norm(model, max_norm=1.0)
            optimizer.step()
        step_s = (time.perf_counter() - started) / spec.required_max_steps
        peak = _proc_status_bytes("VmHWM")

        parameters = list(model.parameters())
        state = {
            "parameters": sum(_local_bytes(p) for p in parameters),
            "gradients": sum(_local_bytes(p.grad) for p in parameters if p.grad is not None),
            "optimizer": sum(
                _local_bytes(value)
                for per_param in optimizer.state.values()
                for value in per_param.values()
                if isinstance(value, torch.Tensor)
            ),
        }
        result = {
            "rank": rank,
            "num_parameters": num_parameters,
            "state_bytes": state,
            "peak_above_baseline_bytes": peak - baseline,
            "step_s": step_s,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_side(args: argparse.Namespace, strategy: Strategy) -> dict[str, Any]:
    spec = make_spec(args, strategy)
    with tempfile.TemporaryDirectory(prefix="apiary-fsdp-memory-") as out:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.start_processes(
            worker,
            args=(args.world_size, spec.model_dump_json(), out, port),
            nprocs=args.world_size,
            start_method="spawn",
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world_size)]
    return {
        "num_parameters": ranks[0]["num_parameters"],
        "state_bytes": max(sum(r["state_bytes"].values()) for r in ranks),
        "state_parts": ranks[0]["state_bytes"],
        "peak_bytes": max(r["peak_above_baseline_bytes"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
    }


def report(args: argparse.Namespace, ddp: dict[str, Any], fsdp: dict[str, Any]) -> str:
    n = args.world_size

    def row(name: str, side: dict[str, Any]) -> str:
        parts = side["state_parts"]
        return (
            f"| {name} | {side['state_bytes'] / MIB:.0f} | {parts['parameters'] / MIB:.0f} | "
            f"{parts['gradients'] / MIB:.0f} | {parts['optimizer'] / MIB:.0f} | "
            f"{side['peak_bytes'] / MIB:.0f} | {side['step_s']:.2f} |"
        )

    state_ratio = fsdp["state_bytes"] / ddp["state_bytes"]
    peak_ratio = fsdp["peak_bytes"] / ddp["peak_bytes"]
    lines = [
        f"model: gpt, {ddp['num_parameters'] / 1e6:.1f}M parameters (d_model {args.d_model}, "
        f"{args.n_layers} layers, vocab {args.vocab_size}), AdamW, batch {args.batch_size} x 64 tokens "
        f"per rank, {n} ranks (plain torch.distributed, gloo, CPU), {args.steps} steps",
        "",
        "| strategy | state MiB/rank | params | grads | AdamW | peak MiB/rank | s/step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        row("ddp", ddp),
        row("fsdp", fsdp),
        "",
        f"FSDP / DDP per rank: state (params + grads + optimizer) {state_ratio:.3f} (goal ~1/{n} = "
        f"{1 / n:.3f}); peak {peak_ratio:.3f}",
    ]
    return "\n".join(lines)


def machine_and_command() -> str:
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    machine = (
        f"{platform.node()}: {os.cpu_count()} CPUs, {memory_gib:.0f} GiB, {platform.machine()}, "
        f"torch {torch.__version__}"
    )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    return (
        f"- {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, command: `{command}`\n"
        f"- machine: {machine}; load average {load}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    # Read by glibc when each spawned worker starts (module docstring: peak).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    ddp = run_side(args, Strategy.DDP)
    fsdp = run_side(args, Strategy.FSDP)
    print(report(args, ddp, fsdp))
    print()
    print(machine_and_command())


if __name__ == "__main__":
    main()
