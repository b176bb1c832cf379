"""Checkpoints: one self-describing dict, `state.pt`, per checkpoint folder (and FSDP's shards).

The dict holds everything a resumed run needs and everything a reader needs to rebuild the model
without the job's database row:

    format_version     int, bumped when the layout changes (2 added `model_format`, 3 renamed
                       `scheduler` to `lr_schedule`, 4 added `skipped_batches`; 1 to 3 still read)
    trainer            the spec's trainer name ("mlp", "gpt" or "package.module:function")
    spec               the full JobSpec (`model_dump(mode="json")`)
    row_shape          the data's row shape the model was sized by ({"input_size": n} | {"seq_len": L})
    model_format       "full": model and optimizer are in this dict (DDP, written by rank 0);
                       "sharded": they are in the `sharded/` folder beside it (FSDP, below)
    model              ("full" only) the model's state_dict, unwrapped from DistributedDataParallel
    optimizer          ("full" only) optimizer.state_dict()
    lr_schedule        the LR schedule's state_dict()
    step               optimizer steps completed                      (these four are `TrainState`)
    epoch              the epoch the last step's batch came from
    batches_in_epoch   batches each rank had taken from that epoch (the data position)
    samples_consumed   samples all ranks together had trained on
    skipped_batches    [[epoch, batch index in epoch], ...]: batches never trained on, skipped by an
                       anomaly rollback (`trainers.anomaly`); [] when reading formats 1 to 3
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

The live side is `TrainState` (the counters and data position) and `TrainParts` (model, optimizer,
LR schedule): `save_checkpoint` writes them, `restore_checkpoint` loads them back. `Checkpointer`
does it inside a Ray Train job: it finds the run's latest checkpoint to resume from, and saves at the
steps the spec asks for through `ray.train.report`, which persists the folder to the run's storage.
"""

from __future__ import annotations

import contextlib
import logging
import random
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from torch import nn

from service.protocol import LaunchRequest
from service.spec import JobSpec
from service.storage import checkpoint_uri, resolve_uri
from trainers.data_order import DataPosition
from trainers.parallel import is_sharded, unwrap_model
from trainers.registry import RowShape, builtin_trainer
from trainers.telemetry import Telemetry

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"
FORMAT_VERSION = 4
READABLE_FORMATS = (1, 2, 3, 4)
# The counters of TrainState, as state.pt stores them.
_STATE_FIELDS = ("step", "epoch", "batches_in_epoch", "samples_consumed")


@dataclass(kw_only=True)
class TrainState:
    """Where training stands: what a checkpoint restores besides the tensors and the RNG."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # the epoch of the data position (the last step's or skipped batch)
    batches_in_epoch: int = 0  # batches each rank took from that epoch: the data position
    samples_consumed: int = 0  # samples all ranks together trained on
    # (epoch, batch index in that epoch) of every batch a rollback skipped (`trainers.anomaly`): each
    # rank passes over its batch at that index. One entry per rollback, so it also counts them.
    skipped_batches: list[tuple[int, int]] = field(default_factory=list)

    def data_position(self, *, batch_size: int) -> DataPosition:
        return DataPosition(self.epoch, self.batches_in_epoch * batch_size)

    def advance(self, *, epoch: int, samples: int) -> None:
        """Count one optimizer step on a batch of `epoch` (`samples` over all ranks)."""
        self.pass_batch(epoch=epoch)
        self.step += 1
        self.samples_consumed += samples

    def next_batch(self, epoch: int) -> tuple[int, int]:
        """(epoch, index in it) of the batch of `epoch` that comes next from the data position."""
        return (epoch, self.batches_in_epoch if epoch == self.epoch else 0)

    def pass_batch(self, *, epoch: int) -> None:
        """Move the data position past the next batch of `epoch` (with no step, for a skipped one)."""
        if epoch != self.epoch:
            self.epoch, self.batches_in_epoch = epoch, 0
        self.batches_in_epoch += 1


@dataclass(kw_only=True)
class TrainParts:
    """The stateful torch objects of one rank: what a checkpoint restores tensors into."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LRScheduler


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


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, in rank order (a collective: all ranks must call it)."""
    mine = capture_rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def seed_rank(seed: int, *, rank: int, step: int) -> None:
    """Seed python, numpy and torch from (seed, rank, step), so ranks draw different dropout masks."""
    mixed = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)


def save_checkpoint(
    directory: str | Path,
    parts: TrainParts,
    state: TrainState,
    *,
    spec: JobSpec,
    row_shape: RowShape,
    rng: list[dict[str, Any]],
    rank: int = 0,
) -> bool:
    """Write this rank's part of a checkpoint into `directory` (which must exist); True if it wrote any.

    Rank 0 writes `state.pt`. With a sharded (FSDP) model every rank must call this at the same step
    (DCP's save is a collective) and every rank's folder belongs to the checkpoint; with DDP only
    rank 0 writes. `rng` is every rank's `capture_rng_state()`, in rank order.
    """
    sharded = is_sharded(parts.model)
    if sharded:
        dcp, get_state_dict, _ = _dcp()
        model_state, optimizer_state = get_state_dict(parts.model, parts.optimizer)
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=Path(directory, SHARDED_DIR)
        )
    if rank != 0:
        return sharded
    contents: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "trainer": spec.trainer,
        "spec": spec.model_dump(mode="json"),
        "row_shape": dict(row_shape),
        "model_format": "sharded" if sharded else "full",
        "lr_schedule": parts.lr_schedule.state_dict(),
        **{name: getattr(state, name) for name in _STATE_FIELDS},
        "skipped_batches": [list(batch) for batch in state.skipped_batches],
        "world_size": len(rng),
        "rng": rng,
    }
    if not sharded:
        contents["model"] = unwrap_model(parts.model).state_dict()
        contents["optimizer"] = parts.optimizer.state_dict()
    torch.save(contents, Path(directory) / STATE_FILE)
    return True


def load_checkpoint(directory: str | Path, *, s3_endpoint_url: str | None = None) -> dict[str, Any]:
    """Read the `state.pt` of a checkpoint folder, tensors on the CPU (FSDP's shards stay on disk)."""
    if _is_uri(directory):  # a file:// or s3:// URI, as the service records checkpoints
        with local_checkpoint(directory, s3_endpoint_url=s3_endpoint_url) as local:
            return load_checkpoint(local)
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not an Apiary checkpoint: it has no {STATE_FILE}")
    contents: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    version = contents.get("format_version")
    if version not in READABLE_FORMATS:
        raise ValueError(
            f"{path} has checkpoint format {version}; this code reads formats {READABLE_FORMATS}"
        )
    contents.setdefault("model_format", "full")  # format 1
    if "scheduler" in contents:  # formats 1 and 2
        contents["lr_schedule"] = contents.pop("scheduler")
    contents.setdefault("skipped_batches", [])  # formats 1 to 3
    return contents


def train_state_of(contents: dict[str, Any]) -> TrainState:
    """The `TrainState` a checkpoint's `state.pt` dict holds."""
    return TrainState(
        **{name: int(contents[name]) for name in _STATE_FIELDS},
        skipped_batches=[(int(epoch), int(index)) for epoch, index in contents.get("skipped_batches", [])],
    )


def restore_checkpoint(
    directory: str | Path, parts: TrainParts, *, contents: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load model, optimizer and LR schedule from a checkpoint folder; return its `state.pt` dict.

    `contents` is that dict when the caller already loaded it (`load_checkpoint`), to not read it
    twice. Call on every rank after `trainers.parallel.parallelize` and building the optimizer. A
    sharded checkpoint loads into any number of ranks (DCP re-shards it) and into a DDP model too; a
    full one loads into a DDP or single-process model only.
    """
    if contents is None:
        contents = load_checkpoint(directory)
    model, optimizer = parts.model, parts.optimizer
    if contents["model_format"] == "sharded":
        dcp, get_state_dict, set_state_dict = _dcp()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # dcp.load fills these dicts in place, each rank reading the slices of its own shards.
        dcp.load(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=Path(directory, SHARDED_DIR)
        )
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    elif is_sharded(model):
        raise ValueError(
            f"checkpoint {directory} was written with strategy {contents['spec']['strategy']!r} "
            "(full state); resume it with that strategy"
        )
    else:
        unwrap_model(model).load_state_dict(contents["model"])
        optimizer.load_state_dict(contents["optimizer"])
    parts.lr_schedule.load_state_dict(contents["lr_schedule"])
    return contents


def build_model_from_checkpoint(directory: str | Path, *, s3_endpoint_url: str | None = None) -> nn.Module:
    """Rebuild a built-in trainer's model from a checkpoint folder and load its weights (eval mode, CPU).

    Works for both layouts; a sharded one is gathered from its shards in this one process.
    """
    if _is_uri(directory):
        with local_checkpoint(directory, s3_endpoint_url=s3_endpoint_url) as local:
            return build_model_from_checkpoint(local)
    contents = load_checkpoint(directory)
    model = builtin_trainer(JobSpec.model_validate(contents["spec"])).build_model(contents["row_shape"])
    if contents["model_format"] == "sharded":
        dcp, _, _ = _dcp()
        model_state = model.state_dict()
        # no_dist: this process reads every shard itself, whatever process group may be running; torch
        # warns that it assumes exactly that.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load({"model": model_state}, checkpoint_id=Path(directory, SHARDED_DIR), no_dist=True)
        model.load_state_dict(model_state)
    else:
        model.load_state_dict(contents["model"])
    return model.eval()


def resume_position(
    *, epoch: int, batches_in_epoch: int, saved_world_size: int, world_size: int
) -> tuple[int, int]:
    """The (epoch, batches_in_epoch) to resume from, given a checkpoint's data position.

    The same world size continues at the exact next batch. A different one changes every rank's
    range (the order is a function of the world size), so no position in the old order maps onto
    the new one: training continues with the next epoch, and the rest of this one is skipped.
    """
    if saved_world_size == world_size:
        return epoch, batches_in_epoch
    logger.warning(
        "checkpoint written by %d ranks, this run has %d: data continues at the start of epoch %d",
        saved_world_size,
        world_size,
        epoch + 1,
    )
    return epoch + 1, 0


# ---------------------------------------------------------------------------------------------------
# Inside a Ray Train job. Ray Train is imported where it is used: reading or writing a checkpoint
# folder needs only torch.
# ---------------------------------------------------------------------------------------------------


class Checkpointer:
    """One rank's checkpoints of one run: where to resume from, and saving at the steps the spec asks.

    Ray Train keeps a run's checkpoints under `{storage_uri}/{run_name}`, and its latest one is where
    a restarted worker group or a resubmitted job resumes. Saving is collective: every rank calls
    `save` at the same steps (`due`). With DDP rank 0 writes the checkpoint; with FSDP every rank
    also writes its shards, and Ray Train merges the ranks' folders into one checkpoint folder.
    """

    def __init__(
        self, request: LaunchRequest, *, row_shape: RowShape, rank: int, telemetry: Telemetry
    ) -> None:
        self.request = request
        self.spec = request.spec
        self.row_shape = row_shape
        self.rank = rank
        self.telemetry = telemetry
        self._last_saved: str | None = None  # the folder name of this group's last save, for `last`

    def due(self, step: int) -> bool:
        every = self.spec.checkpoint.every_steps
        return step == self.spec.max_steps or (every is not None and step % every == 0)

    @contextlib.contextmanager
    def latest(self) -> Iterator[Resume | None]:
        """The run's latest checkpoint, opened to resume from (None on a fresh run).

        Its folder (downloaded first, from S3) lives until the block ends: restore inside it.
        """
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as directory:
            yield Resume(directory=Path(directory), contents=load_checkpoint(directory), seed=self.spec.seed)

    def save(self, parts: TrainParts, state: TrainState, *, metrics: dict[str, float]) -> None:
        """Write the checkpoint of `state` and persist it to the run's storage; rank 0 announces it."""
        import ray.train

        name = checkpoint_dir_name(state.step)
        self._last_saved = name
        rng = gather_rng_states()
        metrics = {"step": state.step, "samples_consumed": state.samples_consumed, **metrics}
        if self.rank != 0 and not is_sharded(parts.model):
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
            return
        with tempfile.TemporaryDirectory(prefix="apiary-checkpoint-") as directory:
            save_checkpoint(
                directory, parts, state, spec=self.spec, row_shape=self.row_shape, rng=rng, rank=self.rank
            )
            # Synchronous upload: when report() returns, the folder is in storage under `name`.
            ray.train.report(
                metrics, checkpoint=ray.train.Checkpoint.from_directory(directory), checkpoint_dir_name=name
            )
        if self.rank == 0:
            uri = checkpoint_uri(
                storage_uri=self.request.storage_uri, run_name=self.request.run_name, name=name
            )
            self.telemetry.checkpoint_saved(state.step, uri)

    @contextlib.contextmanager
    def last(self) -> Iterator[Resume | None]:
        """The run's latest checkpoint, opened again mid-run (an anomaly rollback); None if it has none.

        That is the last one this group saved (every rank knows its name; with DDP only rank 0's
        `ray.train.get_checkpoint()` would have followed it), or else the one the group started from.
        """
        if self._last_saved is None:
            with self.latest() as resume:
                yield resume
            return
        uri = checkpoint_uri(
            storage_uri=self.request.storage_uri, run_name=self.request.run_name, name=self._last_saved
        )
        with local_checkpoint(uri, s3_endpoint_url=self.request.s3_endpoint_url) as directory:
            yield Resume(directory=directory, contents=load_checkpoint(directory), seed=self.spec.seed)


@dataclass(frozen=True, kw_only=True)
class Resume:
    """A checkpoint opened to resume from: its folder and its `state.pt` dict."""

    directory: Path
    contents: dict[str, Any]
    seed: int

    def train_state(self, *, world_size: int) -> TrainState:
        """Where to go on from: the checkpoint's data position (a new epoch on another world size)."""
        state = train_state_of(self.contents)
        state.epoch, state.batches_in_epoch = resume_position(
            epoch=state.epoch,
            batches_in_epoch=state.batches_in_epoch,
            saved_world_size=self.contents["world_size"],
            world_size=world_size,
        )
        return state

    def restore(self, parts: TrainParts, *, rank: int, world_size: int) -> None:
        """Load the tensors into `parts` (every rank) and this rank's RNG states."""
        restore_checkpoint(self.directory, parts, contents=self.contents)
        saved_world_size = self.contents["world_size"]
        if saved_world_size == world_size:
            restore_rng_state(self.contents["rng"][rank])
            return
        if rank == 0:
            logger.warning(
                "checkpoint written by %d ranks, this run has %d: RNG reseeded from (seed, rank, step)",
                saved_world_size,
                world_size,
            )
        seed_rank(self.seed, rank=rank, step=self.contents["step"])


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

    Only sharded (FSDP) checkpoints need it, and importing it slows every process's start (it pulls
    in DTensor): the job driver and DDP workers never pay for it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict
