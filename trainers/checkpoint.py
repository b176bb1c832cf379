"""Checkpoints: one self-describing dict, `state.pt`, per checkpoint folder (and FSDP's shards), and
a completion marker, `_complete.json`, written last.

The dict holds everything a resumed run needs and everything a reader needs to rebuild the model
without the job's database row:

    format_version     int, bumped when the layout changes (2 added `model_format`, 3 renamed
                       `scheduler` to `lr_schedule`, 4 added the completion marker and
                       `skipped_batches`; 1 to 3 still read, but only explicitly: a run never
                       resumes from a folder without a marker)
    trainer            the spec's trainer name ("mlp", "gpt" or "package.module:ClassName")
    spec               the full JobSpec (`model_dump(mode="json")`)
    row_shape          the data's row shape the model was sized by ({"input_size": n} | {"seq_len": L})
    model_format       "full": model and optimizer are in this dict (DDP, written by rank 0);
                       "sharded": they are in the `sharded/` folder beside it (FSDP, below)
    model              ("full" only) the model's state_dict, unwrapped from DistributedDataParallel
    optimizer          ("full" only) optimizer.state_dict()
    lr_schedule        the LR schedule's state_dict() ({} for an own loop without one)
    step               optimizer steps completed                      (these four are `TrainState`)
    epoch              the epoch the last step's batch came from
    batches_in_epoch   batches each rank had taken from that epoch (the data position)
    samples_consumed   samples all ranks together had trained on
    skipped_batches    [[epoch, batch index in epoch], ...]: batches never trained on, skipped by an
                       anomaly rollback (`trainers.anomaly`); [] when reading formats 1 to 3
    recipe_state       (when the recipe has one) the recipe's own state, `Recipe.state_dict()` of
                       rank 0 (`trainers.recipe`), or an own loop's `extra` state (`trainers.context`)
    world_size         ranks that wrote it
    rng                one dict per rank: python, numpy, torch (and cuda) generator states

Only plain containers, numbers, strings and tensors go in, so it loads with
`torch.load(weights_only=True)`: reading a checkpoint never executes pickled code.

FSDP (`model_format: "sharded"`): every rank writes its own shards of model and optimizer with
`torch.distributed.checkpoint` (DCP) into `sharded/` (`__<rank>_0.distcp` files, plus `.metadata`
from rank 0), keyed by parameter name (`{"model": ..., "optimizer": ...}` of
`torch.distributed.checkpoint.state_dict.get_state_dict`). All ranks' files land in the one
checkpoint folder. DCP re-shards on load, so a checkpoint written by N ranks resumes on any number
of ranks, and `build_model_from_checkpoint` reads it in one process.

Completion marker (format 4): `_complete.json` = {"format_version", "step", "files": {relative path:
{"size_bytes", "sha256"}}}, every file of every rank. Rank 0 writes it after every rank's files are
in storage, and only then is the checkpoint reported to Ray Train and announced to the control
plane. A folder without it, or with a file that is missing or fails its checksum, is half-written:
a run never resumes from it (`latest_complete_checkpoint` falls back to the newest complete one,
and rank 0 removes the half-written ones newer than that, with a warning).

The live side is `TrainState` (the counters and data position) and `TrainParts` (model, optimizer,
LR schedule): `save_checkpoint` writes them, `restore_checkpoint` loads them back. `Checkpointer`
does it inside a Ray Train job:

- resume: it finds the run's newest complete checkpoint under `{storage}/{run_name}` (rank 0 checks,
  then tells the other ranks which);
- save: at a due step every rank snapshots its part of the state into host memory (`take_snapshot`:
  model, optimizer, LR schedule, RNG, TrainState; with FSDP the rank's local shards), and its
  `CheckpointWriter` writes and uploads that copy in a background thread while training goes on
  (`checkpoint.async`, the default; at most one write in flight). RNG, LR schedule, counters and
  model buffers are copied at the step; parameters and optimizer state, which change only in the
  optimizer's step, are copied by the writer's thread during the next forward and backward, and
  that next `optimizer.step()` waits for the copy (a step pre-hook), so the snapshot is exactly
  the state at the step.
- complete: at a later step boundary where every rank's write is done (one small collective per
  step, which also carries the stop request and rank 0's clock for `checkpoint.every_s`), the ranks
  gather their files' checksums, rank 0 writes the marker, and all ranks call `ray.train.report`
  with the finished folder (`checkpoint_upload_mode=NO_UPLOAD`: the files are already where Ray
  Train's upload would have put them). Ray Train's own upload could not order the marker: in SYNC
  mode report() returns on each rank once that rank's files are uploaded, not the others', and
  the controller registers the checkpoint once every rank has reported; ASYNC mode uploads in a
  thread with no way to wait for the other ranks' uploads either. A failed write leaves the
  previous checkpoint as the latest. The final checkpoint (max_steps) and the one taken when the
  job is asked to stop are complete before the loop returns.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import random
import re
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np
import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from torch import nn

from service.contract.errors import one_line
from service.contract.protocol import LaunchRequest
from service.contract.spec import JobSpec
from service.contract.storage import checkpoint_uri, resolve_uri, sha256_of
from service.planning.formulas import DEFAULT_MTBF_S, auto_checkpoint_interval_s, young_interval_s
from trainers.data_order import DataPosition
from trainers.parallel import is_sharded, unwrap_model
from trainers.recipe import RowShape, recipe_for
from trainers.telemetry import Telemetry

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"
MARKER_FILE = "_complete.json"
FORMAT_VERSION = 4
READABLE_FORMATS = (1, 2, 3, 4)
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)$")
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


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(kw_only=True)
class TrainParts:
    """The stateful objects of one rank: what a checkpoint restores tensors into."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    # None for a loop without one (`trainers.context`): its checkpoints hold an empty `lr_schedule`.
    lr_schedule: torch.optim.lr_scheduler.LRScheduler | None = None
    # The recipe's own state (`Recipe.state_dict`), the same on every rank: rank 0's is saved.
    extra: Stateful | None = None


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


@dataclass(kw_only=True)
class Snapshot:
    """One rank's part of the checkpoint of one step, as the writer writes it.

    `take_snapshot` takes it at the step; its tensors become copies that share nothing with the live
    model and optimizer by `finish_copy` (the writer's thread, while the next step's forward and
    backward run), which sets `copied`. Until then the optimizer must not step (`CheckpointWriter.guard`).
    """

    step: int
    contents: dict[str, Any] | None = None  # `state.pt` (rank 0 only)
    shards: dict[str, Any] | None = None  # FSDP: {"model", "optimizer"} of this rank's shards, for DCP
    metrics: dict[str, float] = field(default_factory=dict)
    copied: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return checkpoint_dir_name(self.step)

    def finish_copy(self) -> None:
        """Copy the tensors still shared with the live model and optimizer; sets `copied`, also on failure."""
        try:
            if self.shards is not None:
                self.shards = _resolve(self.shards)
            if self.contents is not None:
                self.contents = _resolve(self.contents)
        finally:
            self.copied.set()


def take_snapshot(
    parts: TrainParts,
    state: TrainState,
    *,
    spec: JobSpec,
    row_shape: RowShape,
    rng: list[dict[str, Any]],
    rank: int = 0,
    copy_tensors: bool = True,
) -> Snapshot:
    """This rank's part of the checkpoint of `state`, to write while training goes on (`copy_tensors`), or
    the live tensors themselves, to write before the next step.

    With a sharded (FSDP) model every rank must call this at the same step and holds a part (its
    shards); with DDP only rank 0 does. `rng` is every rank's `capture_rng_state()`, in rank order.

    With `copy_tensors`, everything but the parameters and the optimizer state is copied here (RNG,
    LR schedule, counters, and model buffers, which a forward pass may change); the parameters and
    the optimizer state change only in `optimizer.step()`, so they are copied by `finish_copy`, which
    must run before the next optimizer step: the writer's thread does it while the next step's
    forward and backward run. The copies share nothing with the live objects: steps taken after that
    do not change what is written.
    """
    sharded = is_sharded(parts.model)
    snapshot = Snapshot(step=state.step)
    parameters = {_storage_of(parameter) for parameter in parts.model.parameters()}

    def snap(value: Any, *, later: Callable[[torch.Tensor], bool]) -> Any:
        return _host_copy(value, later=later) if copy_tensors else value

    def model_part(state_dict: Any) -> Any:
        return snap(state_dict, later=lambda tensor: _storage_of(tensor) in parameters)

    def optimizer_part(state_dict: Any) -> Any:
        return snap(state_dict, later=lambda tensor: True)

    def other(value: Any) -> Any:
        return snap(value, later=lambda tensor: False)

    if not copy_tensors:
        snapshot.copied.set()
    if sharded:
        _, get_state_dict, _ = _dcp()
        model_state, optimizer_state = get_state_dict(parts.model, parts.optimizer)
        snapshot.shards = {"model": model_part(model_state), "optimizer": optimizer_part(optimizer_state)}
    if rank != 0:
        return snapshot
    contents: dict[str, Any] = other(
        {
            "format_version": FORMAT_VERSION,
            "trainer": spec.trainer,
            "spec": spec.model_dump(mode="json"),
            "row_shape": dict(row_shape),
            "model_format": "sharded" if sharded else "full",
            "lr_schedule": parts.lr_schedule.state_dict() if parts.lr_schedule is not None else {},
            **{name: getattr(state, name) for name in _STATE_FIELDS},
            "skipped_batches": [list(batch) for batch in state.skipped_batches],
            "world_size": len(rng),
            "rng": rng,
        }
    )
    extra = parts.extra.state_dict() if parts.extra is not None else {}
    if extra:
        contents["recipe_state"] = other(extra)
    if not sharded:
        contents["model"] = model_part(unwrap_model(parts.model).state_dict())
        contents["optimizer"] = optimizer_part(parts.optimizer.state_dict())
    snapshot.contents = contents
    return snapshot


def write_snapshot(snapshot: Snapshot, directory: str | Path, *, process_group: Any = None) -> list[str]:
    """Write `snapshot` into the local folder `directory`; returns the files written, relative to it.

    With shards, every rank of `process_group` (None: the default group) must call this together:
    DCP's save is a collective.
    """
    written: list[str] = []
    if snapshot.shards is not None:
        dcp, _, _ = _dcp()
        before = set(_files_under(Path(directory)))
        dcp.save(snapshot.shards, checkpoint_id=Path(directory, SHARDED_DIR), process_group=process_group)
        written += sorted(set(_files_under(Path(directory))) - before)
    if snapshot.contents is not None:
        # Through a Python file object: torch.save then writes with Python's write(), which lets go of
        # the GIL; given a path, it writes from C++ holding the GIL, and stalls the training thread
        # (seen: pauses of 70-120 ms while 113 MB were written in the background).
        with open(Path(directory) / STATE_FILE, "wb") as stream:
            torch.save(snapshot.contents, stream)
        written.append(STATE_FILE)
    return written


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

    The synchronous form of `take_snapshot` + `write_snapshot`, with no copy and no marker: rank 0
    writes `state.pt`; with a sharded (FSDP) model every rank must call this at the same step (DCP's
    save is a collective) and writes its shards; with DDP only rank 0 writes.
    """
    snapshot = take_snapshot(
        parts, state, spec=spec, row_shape=row_shape, rng=rng, rank=rank, copy_tensors=False
    )
    return bool(write_snapshot(snapshot, directory))


@dataclass(frozen=True)
class _Later:
    """A live tensor in a snapshot, to be copied by `Snapshot.finish_copy`."""

    tensor: torch.Tensor


def _host_copy(value: Any, *, later: Callable[[torch.Tensor], bool]) -> Any:
    """`value` with every container rebuilt and every tensor copied, or marked `_Later` where `later` says."""
    if isinstance(value, torch.Tensor):
        return _Later(value) if later(value) else _copy_tensor(value)
    if isinstance(value, dict):
        return {key: _host_copy(item, later=later) for key, item in value.items()}
    if isinstance(value, list):
        return [_host_copy(item, later=later) for item in value]
    if isinstance(value, tuple):
        return tuple(_host_copy(item, later=later) for item in value)
    return copy.deepcopy(value)


def _resolve(value: Any) -> Any:
    """`value` with every `_Later` replaced by a copy of its tensor (containers are the snapshot's own)."""
    if isinstance(value, _Later):
        return _copy_tensor(value.tensor)
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = _resolve(item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            value[index] = _resolve(item)
    elif isinstance(value, tuple):
        return tuple(_resolve(item) for item in value)
    return value


def _copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor clones its local shard (no communication); a CPU tensor needs `clone`, as `.cpu()`
    # would return the tensor itself.
    return tensor.detach().clone() if tensor.device.type == "cpu" or _is_dtensor(tensor) else tensor.cpu()


def _storage_of(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
    return int(local.untyped_storage().data_ptr())


def _is_dtensor(value: torch.Tensor) -> bool:
    return type(value).__name__ == "DTensor"


def _files_under(directory: Path) -> Iterator[str]:
    if directory.is_dir():
        for path in directory.rglob("*"):
            if path.is_file():
                yield path.relative_to(directory).as_posix()


# ---------------------------------------------------------------------------------------------------
# Completion markers: a checkpoint folder is complete when its `_complete.json` lists every file of
# every rank with its size and sha256, and the files match.
# ---------------------------------------------------------------------------------------------------


def digest_files(directory: str | Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {"size_bytes", "sha256"}} of the local files `names` under `directory`."""
    local = pafs.LocalFileSystem()
    return {
        name: {
            "size_bytes": Path(directory, name).stat().st_size,
            "sha256": sha256_of(str(Path(directory, name)), local),
        }
        for name in names
    }


def write_marker(
    path: str, filesystem: pafs.FileSystem, *, step: int, files: dict[str, dict[str, Any]]
) -> None:
    """Write the completion marker of the checkpoint folder at `path`: call it after every file is there."""
    if STATE_FILE not in files:
        raise ValueError(f"checkpoint at {path}: no {STATE_FILE} among its files")
    body = json.dumps(
        {"format_version": FORMAT_VERSION, "step": step, "files": files}, indent=1, sort_keys=True
    )
    location = f"{path}/{MARKER_FILE}"
    if isinstance(filesystem, pafs.LocalFileSystem):
        with open(location, "w") as stream:
            stream.write(body)
            stream.flush()
            os.fsync(stream.fileno())
        _fsync_dir(path)
    else:
        with filesystem.open_output_stream(location) as stream:
            stream.write(body.encode())


def read_marker(path: str, filesystem: pafs.FileSystem) -> dict[str, Any] | None:
    """The completion marker of the checkpoint folder at `path`; None if it has none."""
    try:
        with filesystem.open_input_stream(f"{path}/{MARKER_FILE}") as stream:
            marker: dict[str, Any] = json.loads(stream.read())
    except FileNotFoundError:
        return None
    return marker


def checkpoint_problem(path: str, filesystem: pafs.FileSystem) -> str | None:
    """Why the checkpoint folder at `path` must not be resumed from; None when it is complete.

    Complete: it has a completion marker, and every file the marker lists is there with its size and
    sha256 (this reads every byte once).
    """
    try:
        marker = read_marker(path, filesystem)
    except (OSError, ValueError) as err:
        return f"its {MARKER_FILE} cannot be read ({one_line(err)})"
    if marker is None:
        return f"it has no {MARKER_FILE} (half-written, or written before completion markers)"
    files: dict[str, dict[str, Any]] = marker.get("files") or {}
    if STATE_FILE not in files:
        return f"its {MARKER_FILE} lists no {STATE_FILE}"
    infos = filesystem.get_file_info([f"{path}/{name}" for name in files])
    for (name, expected), info in zip(files.items(), infos, strict=True):
        if info.type != pafs.FileType.File:
            return f"{name} is missing"
        if info.size != expected["size_bytes"]:
            return f"{name} has {info.size} bytes, {MARKER_FILE} says {expected['size_bytes']}"
    for name, expected in files.items():
        if sha256_of(f"{path}/{name}", filesystem) != expected["sha256"]:
            return f"{name} fails its sha256 check"
    return None


def list_checkpoints(run_path: str, filesystem: pafs.FileSystem) -> list[tuple[int, str]]:
    """The checkpoint folders of the run at `run_path`, as (step, path), newest first."""
    infos = filesystem.get_file_info(pafs.FileSelector(run_path, allow_not_found=True))
    found = []
    for info in infos:
        match = _CHECKPOINT_DIR.match(info.base_name)
        if info.type == pafs.FileType.Directory and match:
            found.append((int(match.group(1)), f"{run_path.rstrip('/')}/{info.base_name}"))
    return sorted(found, reverse=True)


def latest_complete_checkpoint(
    run_path: str, filesystem: pafs.FileSystem, *, remove_incomplete: bool = False
) -> str | None:
    """The path of the newest complete checkpoint of the run at `run_path` (None without one).

    Every folder newer than it is refused with a warning; with `remove_incomplete`, a half-written one
    is also removed (one written before completion markers, format 1 to 3, is only left out).
    """
    for _, path in list_checkpoints(run_path, filesystem):
        problem = checkpoint_problem(path, filesystem)
        if problem is None:
            return path
        if _written_before_markers(path, filesystem):
            logger.warning("not resuming from %s: it was written before completion markers", path)
            continue
        if remove_incomplete:
            logger.warning("removing half-written checkpoint %s: %s", path, problem)
            with contextlib.suppress(OSError):
                filesystem.delete_dir(path)
        else:
            logger.warning("not resuming from %s: %s", path, problem)
    return None


def _written_before_markers(path: str, filesystem: pafs.FileSystem) -> bool:
    if read_marker(path, filesystem) is not None:
        return False
    try:
        with filesystem.open_input_stream(f"{path}/{STATE_FILE}") as stream:
            contents = torch.load(io.BytesIO(stream.read()), map_location="cpu", weights_only=True)
    except Exception:  # a truncated state.pt: half-written
        return False
    return isinstance(contents, dict) and contents.get("format_version") in (1, 2, 3)


def _fsync_dir(path: str | Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ---------------------------------------------------------------------------------------------------
# The background writer: one snapshot at a time, written locally, checksummed, then moved or uploaded
# into the run's storage.
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WriteOutcome:
    """What one rank's write of a snapshot came to: its files in storage, or why it failed."""

    step: int
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None
    write_s: float = 0.0  # from the start of the write (its copy included) until its files were in storage


def finish_checkpoint(path: str, filesystem: pafs.FileSystem, *, outcomes: list[WriteOutcome]) -> bool:
    """Complete the checkpoint folder at `path` from every rank's write (rank 0, after all of them);
    True when it is complete.

    Writes the completion marker with every rank's files when every write succeeded; otherwise warns,
    removes the folder and leaves the previous checkpoint as the latest (the next due step tries again).
    """
    step = outcomes[0].step
    failed = [(rank, each.error) for rank, each in enumerate(outcomes) if each.error is not None]
    if failed:
        rank, error = failed[0]
        logger.warning(
            "checkpoint at step %d failed on rank %d (%s): the latest checkpoint stays the previous one, "
            "and the next due step tries again",
            step,
            rank,
            error,
        )
        with contextlib.suppress(OSError):
            filesystem.delete_dir(path)
        return False
    files = {name: digest for each in outcomes for name, digest in each.files.items()}
    try:
        write_marker(path, filesystem, step=step, files=files)
    except Exception:
        logger.warning(
            "checkpoint at step %d: writing its completion marker failed; the latest checkpoint stays "
            "the previous one",
            step,
            exc_info=True,
        )
        return False
    return True


class CheckpointWriter:
    """Writes one rank's snapshots into `{run_path}/{checkpoint name}` on `filesystem`, one at a time, in
    a background thread.

    Each write goes to a local staging folder first (fsynced), is checksummed there, and is then moved
    (local storage) or uploaded (S3) file by file into the checkpoint folder. The marker is not the
    writer's job: it needs every rank's files (`Checkpointer`). `process_group` is what DCP's save
    uses in the background (not the training's group: collectives of two threads on one group would
    interleave).
    """

    def __init__(self, *, run_path: str, filesystem: pafs.FileSystem, process_group: Any = None) -> None:
        self.run_path = run_path.rstrip("/")
        self.filesystem = filesystem
        self.process_group = process_group
        self._step: int | None = None
        self._snapshot: Snapshot | None = None
        self._done = threading.Event()
        self._outcome: WriteOutcome | None = None

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make every `optimizer.step()` first wait until the snapshot in flight holds its own copies."""
        optimizer.register_step_pre_hook(lambda *_: self.wait_copied())

    def wait_copied(self) -> None:
        """Block until the snapshot in flight (if any) no longer shares tensors with the live objects."""
        snapshot = self._snapshot
        if snapshot is not None and not snapshot.copied.is_set():
            started = time.perf_counter()
            snapshot.copied.wait()
            logger.debug(
                "optimizer step waited %.3f s for the checkpoint's copy", time.perf_counter() - started
            )

    @property
    def in_flight(self) -> int | None:
        """The step of the snapshot submitted and not yet waited for (written or not); None if none."""
        return self._step

    @property
    def busy(self) -> bool:
        """True while the write in flight is still running."""
        return self._step is not None and not self._done.is_set()

    def submit(self, snapshot: Snapshot) -> None:
        """Start writing `snapshot`; the last one must have been waited for."""
        if self._step is not None:
            raise RuntimeError(f"checkpoint at step {self._step} is still in flight: wait() for it first")
        self._step, self._snapshot, self._outcome = snapshot.step, snapshot, None
        self._done.clear()
        # A daemon thread: a write stuck on a lost peer (DCP) must not keep a failed worker alive.
        threading.Thread(
            target=self._write, args=(snapshot,), name="apiary-checkpoint-writer", daemon=True
        ).start()

    def wait(self) -> WriteOutcome:
        """Block until the write in flight is done; its outcome (a failure is returned, not raised)."""
        if self._step is None:
            raise RuntimeError("no checkpoint write in flight")
        self._done.wait()
        outcome, self._step, self._snapshot, self._outcome = self._outcome, None, None, None
        assert outcome is not None
        return outcome

    def checkpoint_path(self, step: int) -> str:
        return f"{self.run_path}/{checkpoint_dir_name(step)}"

    def _write(self, snapshot: Snapshot) -> None:
        started = time.monotonic()
        try:
            snapshot.finish_copy()
            files = self.write_now(snapshot)
            self._outcome = WriteOutcome(step=snapshot.step, files=files, write_s=time.monotonic() - started)
        except Exception as err:
            logger.warning("writing the checkpoint at step %d failed", snapshot.step, exc_info=True)
            self._outcome = WriteOutcome(step=snapshot.step, error=f"{type(err).__name__}: {one_line(err)}")
        finally:
            self._done.set()

    def write_now(self, snapshot: Snapshot) -> dict[str, dict[str, Any]]:
        """Write `snapshot` in this thread; its files' digests. Raises on failure."""
        destination = self.checkpoint_path(snapshot.step)
        with tempfile.TemporaryDirectory(prefix="apiary-checkpoint-") as staging:
            names = write_snapshot(snapshot, staging, process_group=self.process_group)
            for name in names:
                _fsync_file(Path(staging, name))
            files = digest_files(staging, names)
            if snapshot.contents is not None:
                # A marker left by an earlier write of this step must not vouch for the new files.
                with contextlib.suppress(FileNotFoundError):
                    self.filesystem.delete_file(f"{destination}/{MARKER_FILE}")
            self._persist(Path(staging), names, destination)
        return files

    def _persist(self, staging: Path, names: list[str], destination: str) -> None:
        if isinstance(self.filesystem, pafs.LocalFileSystem):
            for name in names:
                target = Path(destination, name)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(staging / name, target)  # a rename when on the same filesystem
            for folder in {Path(destination, name).parent for name in names}:
                _fsync_dir(folder)
            return
        for name in names:
            remote = f"{destination}/{name}"
            self.filesystem.create_dir(remote.rsplit("/", 1)[0], recursive=True)
            pafs.copy_files(
                str(staging / name),
                remote,
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=self.filesystem,
            )


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


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
    if parts.lr_schedule is not None:
        parts.lr_schedule.load_state_dict(contents["lr_schedule"])
    if parts.extra is not None and "recipe_state" in contents:
        parts.extra.load_state_dict(contents["recipe_state"])
    return contents


def build_model_from_checkpoint(directory: str | Path, *, s3_endpoint_url: str | None = None) -> nn.Module:
    """Rebuild a recipe's model from a checkpoint folder and load its weights (eval mode, CPU); the
    recipe's module is imported.

    Works for both layouts; a sharded one is gathered from its shards in this one process.
    """
    if _is_uri(directory):
        with local_checkpoint(directory, s3_endpoint_url=s3_endpoint_url) as local:
            return build_model_from_checkpoint(local)
    contents = load_checkpoint(directory)
    model = recipe_for(JobSpec.model_validate(contents["spec"])).build_model(contents["row_shape"])
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
# checkpoint: {auto: true}
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AutoCadence:
    """The time between checkpoints that checkpoint.auto chose, and why (the job's event says it)."""

    interval_s: float
    mtbf_s: float
    reason: str


def auto_cadence(*, save_s: float, mtbf_s: float, mtbf_basis: str, async_: bool) -> AutoCadence:
    """The cadence for a measured save time and an MTBF: Daly's optimum (service.planning.formulas), treating
    the
    whole write as the save's cost (an async save stalls less, so this errs towards saving less often);
    an async save is never due before the last one could be written."""
    floor_s = save_s if async_ else 0.0
    interval_s = auto_checkpoint_interval_s(save_s=save_s, mtbf_s=mtbf_s, min_interval_s=floor_s)
    floor = " (the write time: one async write at a time)" if interval_s == save_s and async_ else ""
    return AutoCadence(
        interval_s=interval_s,
        mtbf_s=mtbf_s,
        reason=f"checkpoint every {interval_s:.1f} s{floor}: Daly's optimum for a {save_s:.2f} s save and "
        f"an MTBF of {mtbf_s / 3600:.1f} h ({mtbf_basis}); Young's sqrt(2 x save x MTBF) is "
        f"{young_interval_s(save_s=save_s, mtbf_s=mtbf_s):.1f} s",
    )


# ---------------------------------------------------------------------------------------------------
# Inside a Ray Train job. Ray Train is imported where it is used: reading or writing a checkpoint
# folder needs only torch.
# ---------------------------------------------------------------------------------------------------


class Checkpointer:
    """One rank's checkpoints of one run: where to resume from, and saving at the steps the spec asks.

    The run's checkpoints live under `{storage_uri}/{run_name}` (Ray Train's run folder), and its
    newest complete one is where a restarted worker group or a resubmitted job resumes. Every rank
    calls `end_step` at the end of every step: the ranks agree there (one small collective) on
    whether to stop, whether a checkpoint is due and whether the write in flight is done everywhere,
    and the checkpoint whose write is done on every rank is completed (marker) and reported.
    """

    def __init__(
        self,
        request: LaunchRequest,
        *,
        row_shape: RowShape,
        rank: int,
        telemetry: Telemetry,
        device: torch.device | None = None,
        storage: tuple[str, pafs.FileSystem] | None = None,
    ) -> None:
        self.request = request
        self.spec = request.spec
        self.row_shape = row_shape
        self.rank = rank
        self.telemetry = telemetry
        self.device = device or torch.device("cpu")
        # The run's folder: Ray Train's own (`{storage_uri}/{run_name}`, with the filesystem object that
        # Ray Train compares a reported checkpoint's with), unless given.
        self.run_path, self.filesystem = storage or _ray_run_storage()
        self._writer: CheckpointWriter | None = None
        # The time between checkpoints (rank 0's clock decides): the spec's every_s, or with
        # checkpoint.auto the cadence chosen from the last measured save (None: none measured yet, so
        # the first save comes after the first step).
        self._every_s = self.spec.checkpoint.every_s
        self._cadence: AutoCadence | None = None
        self._metrics: dict[str, float] = {}  # of the checkpoint in flight
        self.started_step: int | None = None  # the step of the last checkpoint started (this run)
        self._last_snapshot_at = time.monotonic()
        self._guarded: list[torch.optim.Optimizer] = []  # optimizers whose step waits for the copy

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass  # a write still in flight (the loop failed) goes on in its daemon thread, never completed

    def due(self, step: int) -> bool:
        """A checkpoint is due after `step` by the step count (every_steps, max_steps)."""
        every = self.spec.checkpoint.every_steps
        return step == self.spec.max_steps or (every is not None and step % every == 0)

    @contextlib.contextmanager
    def latest(self) -> Iterator[Resume | None]:
        """The run's newest complete checkpoint, opened to resume from (None on a fresh run).

        Rank 0 picks it (and removes half-written folders newer than it) and tells the other ranks, so
        all resume from the same one. Its folder (downloaded first, from S3) lives until the block
        ends: restore inside it.
        """
        path = (
            latest_complete_checkpoint(self.run_path, self.filesystem, remove_incomplete=True)
            if self.rank == 0
            else None
        )
        path = _from_rank_0(path)
        if path is None:
            yield None
            return
        with _local_folder(path, self.filesystem) as directory:
            yield Resume(directory=directory, contents=load_checkpoint(directory), seed=self.spec.seed)

    def end_step(
        self, parts: TrainParts, state: TrainState, *, metrics: dict[str, float], stop_requested: bool
    ) -> bool:
        """Checkpoint after this step if one is due, finish the one in flight if it is written; every rank
        calls it after every step. True when the ranks agreed to stop here (the checkpoint is complete).
        """
        writer = self._writer
        # checkpoint.auto: the first save (or a retry of a failed first one) measures the save time.
        measure = self.spec.checkpoint.auto and self._cadence is None
        time_due = self.rank == 0 and (
            (measure and (writer is None or writer.in_flight is None))
            or (self._every_s is not None and time.monotonic() - self._last_snapshot_at >= self._every_s)
        )
        stop, writing, time_due = _any_rank_each(
            [stop_requested, writer is not None and writer.busy, time_due], device=self.device
        )
        final = stop or (self.spec.max_steps is not None and state.step >= self.spec.max_steps)
        due = final or time_due or self.due(state.step)
        if writer is not None and writer.in_flight is not None and (due or not writing):
            if writing and self.rank == 0:
                logger.info(
                    "checkpoint at step %d is still being written: step %d waits for it",
                    writer.in_flight,
                    state.step,
                )
            self._complete()
        if due:
            self._start(parts, state, metrics=metrics)
            if final or not self.spec.checkpoint.async_:
                self._complete()
        return stop

    def save(self, parts: TrainParts, state: TrainState, *, metrics: dict[str, float]) -> None:
        """Checkpoint `state` now and return when it is complete (every rank calls it at the same step)."""
        self.flush()
        self._start(parts, state, metrics=metrics)
        self._complete()

    def flush(self) -> None:
        """Wait for the checkpoint in flight, if any, and complete it (every rank calls it together)."""
        if self._writer is not None and self._writer.in_flight is not None:
            self._complete()

    @contextlib.contextmanager
    def last(self) -> Iterator[Resume | None]:
        """The run's newest complete checkpoint, opened again mid-run (an anomaly rollback); None if it
        has none. The checkpoint in flight is completed first (every rank calls it at the same step)."""
        self.flush()
        with self.latest() as resume:
            yield resume

    def _start(self, parts: TrainParts, state: TrainState, *, metrics: dict[str, float]) -> None:
        """Copy this rank's part of the checkpoint to host memory and write it in the background."""
        rng = gather_rng_states()
        snapshot = take_snapshot(
            parts, state, spec=self.spec, row_shape=self.row_shape, rng=rng, rank=self.rank
        )
        self._metrics = {"step": state.step, "samples_consumed": state.samples_consumed, **metrics}
        self.started_step = state.step
        self._last_snapshot_at = time.monotonic()
        writer = self._writer_for(sharded=snapshot.shards is not None)
        if parts.optimizer not in self._guarded:
            writer.guard(parts.optimizer)
            self._guarded.append(parts.optimizer)
        writer.submit(snapshot)

    def _writer_for(self, *, sharded: bool) -> CheckpointWriter:
        if self._writer is None:
            # DCP's save is a collective: in the writer's thread it gets a group of its own. Every rank
            # gets here at the same step, so they create it together.
            group = None
            if sharded and dist.is_initialized():
                group = dist.new_group(backend="gloo")
            self._writer = CheckpointWriter(
                run_path=self.run_path, filesystem=self.filesystem, process_group=group
            )
        return self._writer

    def _complete(self) -> None:
        """Wait for this rank's write, then on every rank: marker and report, or the failure (collective)."""
        assert self._writer is not None and self._writer.in_flight is not None
        self.telemetry.progress("checkpoint")  # a large write may take minutes: not a hang
        outcome = self._writer.wait()
        self.telemetry.deliver_before_checkpoint()  # every rank posts its points before the marker
        outcomes = _gather(outcome)
        path = self._writer.checkpoint_path(outcome.step)
        complete = self.rank == 0 and finish_checkpoint(path, self.filesystem, outcomes=outcomes)
        if any(each.error is not None for each in outcomes):
            return  # no rank reports: they all know it failed
        if self.rank == 0 and self.spec.checkpoint.auto:
            self._retune(save_s=max(each.write_s for each in outcomes), step=outcome.step)
        self._report(path if complete else None, step=outcome.step)
        if complete:
            write_s = max(each.write_s for each in outcomes)
            self.telemetry.checkpoint_saved(outcome.step, self.uri(outcome.step), write_s=write_s)

    def uri(self, step: int) -> str:
        """Where the checkpoint of `step` lies, as the control plane records it."""
        return checkpoint_uri(
            storage_uri=self.request.storage_uri,
            run_name=self.request.run_name,
            name=checkpoint_dir_name(step),
        )

    def _retune(self, *, save_s: float, step: int) -> None:
        """checkpoint.auto (rank 0): the cadence for the save just measured; an event when it is the first
        or moves by more than a quarter."""
        cadence = auto_cadence(
            save_s=save_s,
            mtbf_s=self.request.mtbf_s or DEFAULT_MTBF_S,
            mtbf_basis=self.request.mtbf_basis or f"default {DEFAULT_MTBF_S / 3600:g} h",
            async_=self.spec.checkpoint.async_,
        )
        before, self._cadence, self._every_s = self._cadence, cadence, cadence.interval_s
        if before is None or abs(cadence.interval_s - before.interval_s) > 0.25 * before.interval_s:
            self.telemetry.event(
                "checkpoint_cadence",
                step=step,
                message=cadence.reason,
                interval_s=round(cadence.interval_s, 3),
                save_s=round(save_s, 3),
                mtbf_s=round(cadence.mtbf_s, 1),
            )

    def _report(self, path: str | None, *, step: int) -> None:
        """Register the complete checkpoint at `path` with Ray Train (every rank calls it: a barrier; only
        rank 0 passes the folder, which is already in the run's storage)."""
        import ray.train

        ray.train.report(
            self._metrics,
            checkpoint=ray.train.Checkpoint(path, filesystem=self.filesystem) if path is not None else None,
            checkpoint_dir_name=checkpoint_dir_name(step),
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
        )


def _ray_run_storage() -> tuple[str, pafs.FileSystem]:
    import ray.train

    storage = ray.train.get_context().get_storage()
    return storage.experiment_fs_path, storage.storage_filesystem


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _any_rank_each(flags: list[bool], *, device: torch.device) -> list[bool]:
    """For each flag, True on every rank when it is true on any (one collective)."""
    if not _distributed():
        return flags
    tensor = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(value) for value in tensor.tolist()]


def _gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a collective)."""
    if not _distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _from_rank_0(value: Any) -> Any:
    """Rank 0's `value` on every rank (a collective)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _local_folder(path: str, filesystem: pafs.FileSystem) -> Iterator[Path]:
    """The checkpoint folder at `path` on `filesystem` as a local folder (downloaded unless local)."""
    if isinstance(filesystem, pafs.LocalFileSystem):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="apiary-checkpoint-") as temporary:
        pafs.copy_files(
            path, temporary, source_filesystem=filesystem, destination_filesystem=pafs.LocalFileSystem()
        )
        yield Path(temporary)


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
