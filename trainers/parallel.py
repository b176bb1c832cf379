"""How a model is spread over the ranks of a job (`JobSpec.strategy`) and at what precision it runs.

- `ddp`: every rank holds the whole model and optimizer state; `DistributedDataParallel`
  all-reduces the gradients in `backward()`.
- `fsdp`: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`). With `fsdp.units: blocks` every
  transformer block is its own unit, then the root takes what is left (embeddings, final norm,
  head); with `model` the whole model is one unit; `auto` (the default) is `model` on CPU and
  `blocks` on GPU. Each rank keeps 1/N of every parameter (and so of the optimizer state), and a
  block unit's full parameters exist only while it runs forward or backward
  (`fsdp.reshard_after_forward: false` keeps them from forward to backward). The root unit keeps
  its full parameters from forward to backward, as FSDP2 does by default: backward needs them
  first, so freeing them would add an all-gather and lower no peak. Wrapped here rather than with
  Ray's `prepare_model(parallel_strategy="fsdp")`, which refuses CPU; FSDP2 works with gloo. A job
  of exactly one worker has nothing to shard: its model runs unwrapped, as DDP's single rank does
  (an elastic job that may grow is sharded even at one worker, so that its checkpoints keep one
  layout whatever its size).

Why `auto` differs by device (benchmarks/fsdp_speed.py, benchmarks/RESULTS.md): each unit costs
one all-gather in forward, one in backward (when resharded) and one reduce-scatter. NCCL runs them
on their own streams, so FSDP2 gathers the next block while this one computes and per-block units
cost little beside the memory they save. gloo on CPU runs them on the compute's own cores: nothing
overlaps, every unit adds its latency, and one unit for the whole model is the fastest (0.98x DDP
on the small gpt against 0.71x per block).

This module depends on torch only (not Ray), so the same wrapping runs under Ray Train, in a plain
`torch.distributed` script (benchmarks/fsdp_memory.py) and in tests.

Precision (`JobSpec.precision`): `fp32`, or `bf16`. Unsharded, bf16 is
`torch.autocast(device_type, torch.bfloat16)` around forward and loss. Sharded, it is FSDP2's
`MixedPrecisionPolicy` as its authors recommend: each unit gathers its parameters in bf16 and
computes in bf16, gradients are reduced in fp32, and the model's output comes back in fp32 for the
loss (`autocast` then does nothing). Either way the stored parameters, gradients and optimizer state
stay fp32, so a checkpoint is the same whatever the precision.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from service.contract.spec import FsdpSpec, FsdpUnits, Strategy

logger = logging.getLogger(__name__)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank0_value(value: int, *, device: torch.device) -> int:
    """Rank 0's `value` on every rank (a collective: every rank calls it at the same point)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def gather_values(values: Sequence[float], *, device: torch.device) -> list[list[float]]:
    """Every rank's `values` (the same length on all), in rank order.

    A collective: every rank calls it at the same step. float64, so a NaN or an infinity travels
    as itself.
    """
    if not is_distributed() or dist.get_world_size() == 1:
        return [list(values)]
    mine = torch.tensor(list(values), dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [row.tolist() for row in gathered]


def parallelize(
    model: nn.Module,
    *,
    strategy: Strategy,
    device: torch.device,
    fsdp: FsdpSpec | None = None,
    precision: str = "fp32",
    max_workers: int | None = None,
    blocks: Sequence[nn.Module] | None = None,
) -> nn.Module:
    """Move `model` to `device` and wrap it for `strategy` over the default process group.

    Without a process group, or with one rank, the model is only moved: there is nothing to synchronize
    or shard (FSDP: only when the job never has more than one worker, `max_workers` 1, so that a job
    keeps one checkpoint layout whatever its size). Call before building the optimizer: FSDP replaces
    the parameters by sharded ones. `blocks`: FSDP's block units (`shard_model`).
    """
    if device.type == "cuda":
        # FSDP's device mesh and NCCL use the current device, which must be this rank's GPU.
        torch.cuda.set_device(device)
    model = model.to(device)
    if strategy is Strategy.FSDP:
        if not is_distributed():
            logger.warning(
                "strategy fsdp without a torch.distributed process group: the model is not sharded"
            )
            return model
        if dist.get_world_size() == 1 and max_workers == 1:
            logger.info("strategy fsdp on one worker: nothing to shard, the model runs unwrapped")
            return model
        return shard_model(
            model, device=device, options=fsdp or FsdpSpec(), precision=precision, blocks=blocks
        )
    if not is_distributed() or dist.get_world_size() == 1:
        return model
    return nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


# `units: auto` on CPU: one unit for a model of at most this many bytes of parameters, per block above.
# Measured (benchmarks/fsdp_speed.py, 2 gloo ranks): a 13 MB gpt ran at 0.98x DDP as one unit and
# 0.71-0.82x with block units; a 252 MB one at 0.26x as one unit and 0.41x with block units. One unit
# also holds the whole model's parameters during a pass, which is what sharding a large model avoids.
AUTO_ONE_UNIT_MAX_BYTES = 64 * 2**20


def fsdp_units(options: FsdpSpec, *, device: torch.device, param_bytes: int) -> FsdpUnits:
    """The units `options` asks for on `device` for a model of `param_bytes`: `auto` is one unit per
    block where collectives overlap compute (CUDA, NCCL), and where they cannot (CPU, gloo) one unit
    for a small model (the fewest collectives) and one per block for a large one."""
    if options.units is not FsdpUnits.AUTO:
        return options.units
    if device.type == "cuda" or param_bytes > AUTO_ONE_UNIT_MAX_BYTES:
        return FsdpUnits.BLOCKS
    return FsdpUnits.MODEL


def param_bytes(model: nn.Module) -> int:
    return sum(param.numel() * param.element_size() for param in model.parameters())


def shard_model(
    model: nn.Module,
    *,
    device: torch.device,
    options: FsdpSpec | None = None,
    precision: str = "fp32",
    blocks: Sequence[nn.Module] | None = None,
) -> nn.Module:
    """FSDP2 over all ranks of the default group: with block units each of `blocks` (None:
    `model.blocks`, if it is an `nn.ModuleList`) first, then the root; bf16 as FSDP2's mixed
    precision (see the module's docstring)."""
    # Imported here: FSDP and DTensor slow every worker's start, and DDP needs neither.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = options or FsdpSpec()
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    if precision == "bf16":
        # Compute in bf16, reduce gradients in fp32; the root hands its output back in fp32 (the loss).
        inner = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    elif precision == "fp32":
        inner = root = MixedPrecisionPolicy()
    else:
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    if blocks is None:
        found = getattr(model, "blocks", None)
        blocks = list(found) if isinstance(found, nn.ModuleList) else []
    units = fsdp_units(options, device=device, param_bytes=param_bytes(model))
    logger.info(
        "fsdp: units %s (asked: %s, on %s), reshard_after_forward %s",
        units.value,
        options.units.value,
        device.type,
        options.reshard_after_forward,
        extra={"action": "fsdp_wrapped", "units": units.value},
    )
    if units is FsdpUnits.BLOCKS:
        for block in blocks:
            fully_shard(
                block, mesh=mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=inner
            )
    # The root's parameters are gathered again at once for backward: resharding them would cost an
    # all-gather and lower no peak (FSDP2's own default for the root).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=root)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True when the model's state is split across ranks (FSDP), so every rank must save its part."""
    # FSDP is imported only by `shard_model`: if it was never imported, no model is sharded.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel (whose state_dict keys carry a `module.` prefix).

    An FSDP2 model is its own module (fully_shard keeps the parameter names); it is returned as is.
    """
    inner = getattr(model, "module", None)
    return inner if isinstance(model, nn.parallel.DistributedDataParallel) and inner is not None else model


@contextlib.contextmanager
def autocast(precision: str, *, device: torch.device, model: nn.Module | None = None) -> Iterator[None]:
    """Run the enclosed forward and loss of `model` at `precision` ("fp32" does nothing, "bf16"
    autocasts, unless `model` is sharded: FSDP's mixed precision policy already computes in bf16)."""
    if precision == "fp32" or (precision == "bf16" and model is not None and is_sharded(model)):
        yield
        return
    if precision != "bf16":
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        yield


def clip_grad_norm(model: nn.Module, *, max_norm: float) -> torch.Tensor:
    """Clip gradients to `max_norm` (inf = measure only); returns the total norm over all ranks' shards.

    With FSDP the gradients are DTensor shards and the norm comes back as a DTensor; its full value is
    the norm of the whole model, the same on every rank.
    """
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
    tensor = sys.modules.get("torch.distributed.tensor")  # imported with FSDP (shard_model)
    if tensor is not None and isinstance(norm, tensor.DTensor):
        norm = norm.full_tensor()
    return norm
