"""Checkpoints: one self-describing dict, `state.pt`, per checkpoint folder.

The dict holds everything a resumed run needs and everything a reader needs to rebuild the model
without the job's database row:

    format_version     int, bumped when the layout changes
    trainer            the spec's trainer name ("mlp", "gpt" or "package.module:function")
    spec               the full JobSpec (`model_dump(mode="json")`)
    row_shape          the data's row shape the model was sized by ({"input_size": n} | {"seq_len": L})
    model              the model's state_dict, unwrapped from DistributedDataParallel
    optimizer          optimizer.state_dict()
    scheduler          LR scheduler state_dict()
    step               optimizer steps completed
    epoch              the epoch the last step's batch came from
    batches_in_epoch   batches each rank had taken from that epoch (the data position)
    samples_consumed   samples all ranks together had trained on
    world_size         ranks that wrote it
    rng                one dict per rank: python, numpy, torch (and cuda) generator states

Only plain containers, numbers, strings and tensors go in, so it loads with
`torch.load(weights_only=True)`: reading a checkpoint never executes pickled code.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from service.spec import JobSpec
from trainers.models import build_model

STATE_FILE = "state.pt"
FORMAT_VERSION = 1


def checkpoint_dir_name(step: int) -> str:
    """The folder name of the checkpoint taken after `step` steps, under {storage}/{run_name}/."""
    return f"checkpoint_{step:08d}"


def checkpoint_uri(*, storage_uri: str, run_name: str, name: str) -> str:
    """Where Ray Train persists checkpoint folder `name` of a run, as a URI the control plane can store.

    A storage_uri without a scheme is a local absolute path and becomes `file:///abs/...`; any other
    URI (file://, s3://) is extended as is: `{storage_uri}/{run_name}/{name}`.
    """
    if "://" not in storage_uri:
        return Path(storage_uri, run_name, name).absolute().as_uri()
    return f"{storage_uri.rstrip('/')}/{run_name}/{name}"


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel (whose state_dict keys carry a `module.` prefix)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(model, nn.parallel.DistributedDataParallel) and inner is not None else model


def capture_rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple)  # legacy=True always gives the tuple form
    name, keys, pos, has_gauss, cached_gaussian = numpy_state
    return {
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["name"],
            np.asarray(numpy_state["keys"], dtype=np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    directory: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    spec: JobSpec,
    row_shape: dict[str, int],
    step: int,
    epoch: int,
    batches_in_epoch: int,
    samples_consumed: int,
    rng: list[dict[str, Any]],
) -> Path:
    """Write `state.pt` into `directory` (which must exist) and return its path.

    `rng` is every rank's `capture_rng_state()`, in rank order.
    """
    path = Path(directory) / STATE_FILE
    state = {
        "format_version": FORMAT_VERSION,
        "trainer": spec.trainer,
        "spec": spec.model_dump(mode="json"),
        "row_shape": dict(row_shape),
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
        "epoch": epoch,
        "batches_in_epoch": batches_in_epoch,
        "samples_consumed": samples_consumed,
        "world_size": len(rng),
        "rng": rng,
    }
    torch.save(state, path)
    return path


def load_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Read the `state.pt` of a checkpoint folder, tensors on the CPU."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not an Apiary checkpoint: it has no {STATE_FILE}")
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format {version}; this code reads format {FORMAT_VERSION}")
    return state


def build_model_from_checkpoint(directory: str | Path) -> nn.Module:
    """Rebuild a built-in trainer's model from a checkpoint folder and load its weights (eval mode, CPU)."""
    state = load_checkpoint(directory)
    spec = JobSpec.model_validate(state["spec"])
    model = build_model(spec, row_shape=state["row_shape"])
    model.load_state_dict(state["model"])
    return model.eval()
