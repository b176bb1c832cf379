"""Profiles on request (`JobSpec.profile`): `torch.profiler` on every rank for a window of steps.

The training context (`trainers.context`) drives it at its step boundary, so recipes (the built-in
loop) and own loops (`ctx.report`) are profiled alike; a Ray Train function is not (its spec refuses
`profile`: `service.contract.trainer_kind`).

- The profiler starts on every rank once step `start_step - 1` is complete (at `ctx.restore` for
  `start_step` 1, or a run that resumed exactly there), marks each step (`ProfilerStep#N` in the
  trace: the step's data wait, forward, backward, optimizer and its step boundary), and stops after
  step `end_step`'s report, or where the loop ends if that comes first (a stop, a preemption). A run
  that resumes past `start_step` does not profile again.
- Every rank writes its Chrome trace to `service.contract.profiles.profile_folder` (local folders and
  S3 alike, as checkpoints go) as `rank-R.pt.trace.json`: TensorBoard's PyTorch profiler plugin reads
  the folder as a run with a worker per rank, and Perfetto (ui.perfetto.dev) opens each file.
- Every rank summarizes its own trace (`summarize_trace`): the time its collectives ran against the
  time its compute ran. The ranks gather their figures (one small collective) and rank 0 writes them
  all to `summary.json` beside the traces and posts the `profile` event (`profile_event`).

A trace that cannot be written (storage down) is a warning, never a failed job.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.profiler

from service.contract.profiles import PROFILE_EVENT, SUMMARY_FILE, profile_folder, trace_name
from service.contract.protocol import LaunchRequest
from service.contract.spec import ProfileSpec
from service.contract.storage import resolve_uri
from trainers.parallel import gather_values
from trainers.telemetry import Telemetry

logger = logging.getLogger(__name__)

# Collectives in a PyTorch trace: the annotation each c10d backend puts around a collective on the
# thread that runs it ("gloo:all_reduce", "nccl:all_reduce"), c10d's own ops on the calling thread
# ("c10d::allreduce_"), NCCL's parameter record, and NCCL's kernels on a GPU ("ncclDevKernel_...").
_COMMUNICATION_PREFIXES = ("gloo:", "nccl:", "ucc:", "mpi:", "c10d::", "record_param_comms", "nccl")
_STEP_PREFIX = "ProfilerStep#"
# What counts as a rank's work: its device's kernels and copies when it has any (a GPU rank: its CPU
# ops only launch them, so its communication is NCCL's kernels too), else its CPU ops.
_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_CPU_CATEGORIES = frozenset({"cpu_op"})


@dataclass(frozen=True)
class Split:
    """Where one rank's profiled steps went, in seconds of wall time.

    `compute_s` and `communication_s` are the time any compute (any collective) was running, each
    counted once however many ran at once; `overlap_s` is the time both were. `idle_s` is the window's
    time with neither (waiting on data, Python, the host)."""

    window_s: float
    compute_s: float
    communication_s: float
    overlap_s: float

    @property
    def idle_s(self) -> float:
        return max(self.window_s - (self.compute_s + self.communication_s - self.overlap_s), 0.0)

    def percent(self, seconds: float) -> float:
        return 100.0 * seconds / self.window_s if self.window_s > 0 else 0.0

    def values(self) -> list[float]:
        return [self.window_s, self.compute_s, self.communication_s, self.overlap_s]


def is_communication(name: str) -> bool:
    return name.startswith(_COMMUNICATION_PREFIXES)


def summarize_trace(trace: Mapping[str, Any]) -> Split:
    """The compute/communication split of a Chrome trace that `torch.profiler` exported.

    The window is the union of the `ProfilerStep#N` spans (all the trace when it has none); compute and
    communication are unions of their events' spans (microseconds: `ts`, `dur`) within it."""
    events = [
        event
        for event in trace.get("traceEvents", [])
        if isinstance(event, Mapping) and event.get("ph") == "X" and isinstance(event.get("dur"), int | float)
    ]
    steps = [_span(event) for event in events if str(event.get("name", "")).startswith(_STEP_PREFIX)]
    if not steps:
        spans = [_span(event) for event in events]
        steps = [(min(start for start, _ in spans), max(end for _, end in spans))] if spans else []
    window = _union(steps)
    on_device = any(event.get("cat") in _DEVICE_CATEGORIES for event in events)
    compute, communication = [], []
    for event in events:
        category = event.get("cat")
        if on_device and category not in _DEVICE_CATEGORIES:
            continue  # the host's side of a GPU rank: launches, not the work
        if is_communication(str(event.get("name", ""))):
            communication.append(_span(event))
        elif category in _DEVICE_CATEGORIES or category in _CPU_CATEGORIES:
            compute.append(_span(event))
    compute_in = _intersect(_union(compute), window)
    communication_in = _intersect(_union(communication), window)
    return Split(
        window_s=_length(window) / 1e6,
        compute_s=_length(compute_in) / 1e6,
        communication_s=_length(communication_in) / 1e6,
        overlap_s=_length(_intersect(compute_in, communication_in)) / 1e6,
    )


def _span(event: Mapping[str, Any]) -> tuple[float, float]:
    start = float(event.get("ts", 0.0))
    return start, start + float(event["dur"])


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two sorted, disjoint lists of spans."""
    out: list[tuple[float, float]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: Iterable[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def profile_event(
    splits: Sequence[Split | None], *, start_step: int, end_step: int, folder: str
) -> tuple[str, dict[str, int | float | str]]:
    """The `profile` event's message and data, from every rank's split (None: the rank wrote no trace)."""
    written = {rank: split for rank, split in enumerate(splits) if split is not None}
    data: dict[str, int | float | str] = {
        "start_step": start_step,
        "end_step": end_step,
        "ranks": len(splits),
        "traces": len(written),
        "folder": folder,
    }
    where = f"profiled steps {start_step}-{end_step} on {len(splits)} ranks"
    if not written:
        return f"{where}: no rank could write its trace (see the job's log)", data
    count = len(written)

    def mean(values: Iterable[float]) -> float:
        return sum(values) / count

    shares = {rank: split.percent(split.communication_s) for rank, split in written.items()}
    most = max(shares, key=lambda rank: shares[rank])
    data.update(
        window_s=round(mean(split.window_s for split in written.values()), 6),
        compute_s=round(mean(split.compute_s for split in written.values()), 6),
        communication_s=round(mean(split.communication_s for split in written.values()), 6),
        overlap_s=round(mean(split.overlap_s for split in written.values()), 6),
        idle_s=round(mean(split.idle_s for split in written.values()), 6),
        compute_percent=round(mean(split.percent(split.compute_s) for split in written.values()), 2),
        communication_percent=round(mean(shares.values()), 2),
        communication_percent_max=round(shares[most], 2),
        communication_max_rank=most,
    )
    per_rank = ", ".join(
        f"{rank}: {split.percent(split.compute_s):.0f}/{shares[rank]:.0f}%" for rank, split in written.items()
    )
    missing = f"; {len(splits) - count} ranks wrote no trace" if count < len(splits) else ""
    message = (
        f"{where}: compute {data['compute_percent']:.0f}%, "
        f"communication {data['communication_percent']:.0f}% of {data['window_s']:.3f} s on average "
        f"(rank {most} communicates the most, {shares[most]:.0f}%){missing}; "
        f"per rank, compute/communication: {per_rank}"
    )
    return message, data


class StepProfiler:
    """One rank's profile of the spec's window (see the module); `TrainContext` calls it at the step
    boundary with the last complete step."""

    def __init__(
        self,
        window: ProfileSpec,
        *,
        request: LaunchRequest,
        rank: int,
        device: torch.device,
        telemetry: Telemetry,
    ) -> None:
        self.window = window
        self.request = request
        self.rank = rank
        self.device = device
        self.telemetry = telemetry
        self._profiler: torch.profiler.profile | None = None
        self._done = False

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def at_restore(self, step: int) -> None:
        """The loop (re)starts after step `step` (0: a fresh run): start when the window begins next."""
        if self._profiler is None and not self._done and step == self.window.start_step - 1:
            self._start()

    def at_step(self, step: int) -> None:
        """Step `step` is complete on this rank: start, mark the next step, or finish."""
        profiler = self._profiler
        if profiler is None:
            self.at_restore(step)
        elif step >= self.window.end_step:
            self.finish(step)
        else:
            profiler.step()  # ProfilerStep#(step + 1) from here

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # A schedule that always records: the profiler then marks each step in the trace.
        profiler = torch.profiler.profile(
            activities=activities, schedule=lambda _: torch.profiler.ProfilerAction.RECORD
        )
        profiler.step_num = self.window.start_step
        profiler.start()
        self._profiler = profiler
        if self.rank == 0:
            logger.info("profiling steps %d-%d", self.window.start_step, self.window.end_step)

    def finish(self, step: int) -> None:
        """Stop after step `step` (every rank, the same step: a collective), save and summarize."""
        profiler = self._profiler
        if profiler is None:
            return
        self._profiler, self._done = None, True
        profiler.stop()
        start_step = self.window.start_step
        folder = profile_folder(
            storage_uri=self.request.storage_uri,
            run_name=self.request.run_name,
            start_step=start_step,
            end_step=step,
        )
        split: Split | None = None
        try:
            split = self._save(profiler, folder)
        except Exception as err:  # storage down, a full disk: the job goes on without this trace
            logger.warning("rank %d could not save its profile to %s: %s", self.rank, folder, err)
        gathered = gather_values(
            [1.0 if split else 0.0, *(split or Split(0, 0, 0, 0)).values()], device=self.device
        )
        if self.rank != 0:
            return
        splits = [Split(*row[1:]) if row[0] else None for row in gathered]
        message, data = profile_event(splits, start_step=start_step, end_step=step, folder=folder)
        try:
            self._write(folder, SUMMARY_FILE, json.dumps(_summary(splits, data)).encode())
        except Exception as err:
            logger.warning("could not write the profile's summary to %s: %s", folder, err)
        logger.info("%s", message)
        self.telemetry.event(PROFILE_EVENT, step=step, message=message, **data)

    def _save(self, profiler: torch.profiler.profile, folder: str) -> Split:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="apiary-profile-") as staging:
            local = Path(staging, trace_name(self.rank))
            profiler.export_chrome_trace(str(local))
            with local.open("rb") as stream:
                split = summarize_trace(json.load(stream))
            self._copy(local, folder)
        logger.debug("rank %d saved its profile in %.2f s", self.rank, time.perf_counter() - started)
        return split

    def _copy(self, local: Path, folder: str) -> None:
        path, filesystem = resolve_uri(folder, s3_endpoint_url=self.request.s3_endpoint_url)
        filesystem.create_dir(path, recursive=True)
        if isinstance(filesystem, pafs.LocalFileSystem):
            shutil.copyfile(local, f"{path}/{local.name}")
            return
        pafs.copy_files(
            str(local),
            f"{path}/{local.name}",
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=filesystem,
        )

    def _write(self, folder: str, name: str, contents: bytes) -> None:
        path, filesystem = resolve_uri(folder, s3_endpoint_url=self.request.s3_endpoint_url)
        filesystem.create_dir(path, recursive=True)
        with filesystem.open_output_stream(f"{path}/{name}") as stream:
            stream.write(contents)


def _summary(splits: Sequence[Split | None], data: Mapping[str, Any]) -> dict[str, Any]:
    """`summary.json`: the event's figures and every rank's split, with its trace's name."""
    return {
        **data,
        "per_rank": [
            {"rank": rank, "trace": trace_name(rank), **asdict(split), "idle_s": split.idle_s}
            if split is not None
            else {"rank": rank, "trace": None}
            for rank, split in enumerate(splits)
        ],
    }
