"""Checkpoints: one self-describing dict, `state.pt`, per checkpoint folder (and FSDP's shards).

The dict holds everything a resumed run needs and everything a reader needs to rebuild the model
without the job's database row:

    format_version     int, bumped when the layout changes (2 added `model_format`; 1 still reads)
    trainer            the spec's trainer name ("mlp", "gpt" or "package.module:function")
    spec               the full JobSpec (`model_dump(mode="json")`)
    row_shape          the data's row shape the model was sized by ({"input_size": n} | {"seq_len": L})
    model_format       "full": model and optimizer are in this dict (DDP, written by rank 0);
                       "sharded": they are in the `sharded/` folder beside it (FSDP, below)
    model              ("full" only) the model's state_dict, unwrapped from DistributedDataParallel
    optimizer          ("full" only) optimizer.state_dict()
    scheduler          LR scheduler state_dict()
    step               optimizer steps completed
    epoch              the epoch the last step's batch came from
    batches_in_epoch   batches each rank had taken from that epoch (the data position)
    samples_consumed   samples all ranks together had trained on
    world_size         ranks that wrote it
    rng                one dict per rank: python, numpy, torch (and cuda) generator states

Only plain containers, numbers, strings and tensors go in, so it loads with
`torch.load(weights_only=True)`: reading a checkpoint never executes pickled code.

FSDP (`model_format: "sharded"`): every rank writes its own shards of model and optimizer with
`torch.distributed.checkpoint` (DCP) into `sharded/` (`__<rank>_0.distcp` files, plus `.metadata`
from rank 0), keyed by parameter name (`{"model": ..., "optimizer": ...}` of
`torch.distributed.checkpoint.state_dict.get_state_dict`). Ray Train merges the ranks' folders
into one checkpoint folder. DCP re-shards on load, so a checkpoint written by N ranks resumes on
any number of ranks, and `build_model_from_checkpoint` reads it in one process.
"""

from __future__ import annotations

import contextlib
import random
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch
from torch import nn

from service.spec import JobSpec
from service.storage import resolve_uri
from trainers.models import build_model
from trainers.parallel import is_sharded, unwrap_model

STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)


def checkpoint_dir_name(step: int) -> str:
    """The folder name of the checkpoint taken after `step` steps, under {storage}/{run_name}/."""
    return f"checkpoint_{step:08d}"


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
    rank: int = 0,
) -> bool:
    """Write this rank's part of a checkpoint into `directory` (which must exist); True if it wrote any.

    Rank 0 writes `state.pt`. With a sharded (FSDP) model every rank must call this at the same step
    (DCP's save is a collective) and every rank's folder belongs to the checkpoint; with DDP only
    rank 0 writes. `rng` is every rank's `capture_rng_state()`, in rank order.
    """
    sharded = is_sharded(model)
    if sharded:
        dcp, get_state_dict, _ = _dcp()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=Path(directory, SHARDED_DIR)
        )
    if rank != 0:
        return sharded
    state: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "trainer": spec.trainer,
        "spec": spec.model_dump(mode="json"),
        "row_shape": dict(row_shape),
        "model_format": "sharded" if sharded else "full",
        "scheduler": scheduler.state_dict(),
        "step": step,
        "epoch": epoch,
        "batches_in_epoch": batches_in_epoch,
        "samples_consumed": samples_consumed,
        "world_size": len(rng),
        "rng": rng,
    }
    if not sharded:
        state["model"] = unwrap_model(model).state_dict()
        state["optimizer"] = optimizer.state_dict()
    torch.save(state, Path(directory) / STATE_FILE)
    return True


def load_checkpoint(directory: str | Path, *, s3_endpoint_url: str | None = None) -> dict[str, Any]:
    """Read the `state.pt` of a checkpoint folder, tensors on the CPU (FSDP's shards stay on disk)."""
    if _is_uri(directory):  # a file:// or s3:// URI, as the service records checkpoints
        with local_checkpoint(directory, s3_endpoint_url=s3_endpoint_url) as local:
            return load_checkpoint(local)
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not an Apiary checkpoint: it has no {STATE_FILE}")
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    version = state.get("format_version")
    if version not in READABLE_FORMATS:
        raise ValueError(
            f"{path} has checkpoint format {version}; this code reads formats {READABLE_FORMATS}"
        )
    state.setdefault("model_format", "full")
    return state


def restore_checkpoint(
    directory: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load model, optimizer and LR schedule from a checkpoint folder; return its `state.pt` dict.

    `state` is that dict when the caller already loaded it (`load_checkpoint`), to not read it twice.
    Call on every rank after `trainers.parallel.parallelize` and `build_optimizer`. A sharded
    checkpoint loads into any number of ranks (DCP re-shards it) and into a DDP model too; a full one
    loads into a DDP or single-process model only.
    """
    if state is None:
        state = load_checkpoint(directory)
    if state["model_format"] == "sharded":
        dcp, get_state_dict, set_state_dict = _dcp()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # dcp.load fills these dicts in place, each rank reading the slices of its own shards.
        dcp.load(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=Path(directory, SHARDED_DIR)
        )
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    elif is_sharded(model):
        raise ValueError(
            f"checkpoint {directory} was written with strategy {state['spec']['strategy']!r} (full state); "
            "resume it with that strategy"
        )
    else:
        unwrap_model(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state


def build_model_from_checkpoint(directory: str | Path, *, s3_endpoint_url: str | None = None) -> nn.Module:
    """Rebuild a built-in trainer's model from a checkpoint folder and load its weights (eval mode, CPU).

    Works for both layouts; a sharded one is gathered from its shards in this one process.
    """
    if _is_uri(directory):
        with local_checkpoint(directory, s3_endpoint_url=s3_endpoint_url) as local:
            return build_model_from_checkpoint(local)
    state = load_checkpoint(directory)
    spec = JobSpec.model_validate(state["spec"])
    model = build_model(spec, row_shape=state["row_shape"])
    if state["model_format"] == "sharded":
        dcp, _, _ = _dcp()
        model_state = model.state_dict()
        # no_dist: this process reads every shard itself, whatever process group may be running; torch
        # warns that it assumes exactly that.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load({"model": model_state}, checkpoint_id=Path(directory, SHARDED_DIR), no_dist=True)
        model.load_state_dict(model_state)
    else:
        model.load_state_dict(state["model"])
    return model.eval()


# ---------------------------------------------------------------------------------------------------
# Checkpoints in object storage. Ray Train uploads them to `{storage_uri}/{run_name}/` (local or s3://)
# and the service records their URIs; readers outside Ray Train download the folder first.
# ---------------------------------------------------------------------------------------------------


def _is_uri(directory: str | Path) -> bool:
    return isinstance(directory, str) and "://" in directory


@contextlib.contextmanager
def local_checkpoint(directory: str | Path, *, s3_endpoint_url: str | None = None) -> Iterator[Path]:
    """A checkpoint folder as a local path: a local path or file:// URI as is; an s3:// URI downloaded
    into a temporary folder that is removed on exit.
    """
    if not _is_uri(directory):
        yield Path(directory)
        return
    path, filesystem = resolve_uri(str(directory), s3_endpoint_url=s3_endpoint_url)
    if isinstance(filesystem, pafs.LocalFileSystem):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="apiary-checkpoint-") as temporary:
        yield download_checkpoint(str(directory), Path(temporary), s3_endpoint_url=s3_endpoint_url)


def download_checkpoint(uri: str, destination: Path, *, s3_endpoint_url: str | None = None) -> Path:
    """Copy the checkpoint folder at `uri` (e.g. `s3://bucket/prefix/job-7/checkpoint_00000100`, as the
    service records it) with everything in it (FSDP's shards too) into `destination`; returns it.
    """
    source, filesystem = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    if filesystem.get_file_info(f"{source}/{STATE_FILE}").type != pafs.FileType.File:
        raise FileNotFoundError(f"{uri} is not an Apiary checkpoint: it has no {STATE_FILE}")
    destination.mkdir(parents=True, exist_ok=True)
    pafs.copy_files(
        source,
        str(destination),
        source_filesystem=filesystem,
        destination_filesystem=pafs.LocalFileSystem(),
    )
    return destination


def _dcp() -> tuple[Any, Any, Any]:
    """`torch.distributed.checkpoint` with `get_state_dict` and `set_state_dict`, imported on first use.

    Only sharded (FSDP) checkpoints need it, and importing it costs every process about a second at
    start (it pulls in DTensor): the job driver and DDP workers never pay for it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict
