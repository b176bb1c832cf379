"""A job's profiles (`JobSpec.profile`), as its trainers left them in storage (`service.contract.profiles`).

Listed from the storage itself, beside the checkpoints (local folders and S3 alike), so what the job
page and `GET /jobs/{id}/profiles` show is exactly what TensorBoard and Perfetto can open: each
profile's folder, its trace files (one per rank), and the compute/communication split that rank 0
wrote to `summary.json`. The traces themselves never pass through the service.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from service.contract.handoff import job_prefix
from service.contract.profiles import PLUGIN_DIR, PROFILE_DIR, SUMMARY_FILE, TRACE_SUFFIX
from service.contract.storage import resolve_uri

logger = logging.getLogger(__name__)

# Bounds on what one listing reads: a job has one profile window (a few, if it was profiled again
# after a restart from before it), one trace per rank.
MAX_PROFILES = 32
MAX_TRACES = 4096
MAX_SUMMARY_BYTES = 4 << 20
_RUN = re.compile(r"^steps-(\d+)-(\d+)$")
_RANK = re.compile(r"^rank-(\d+)$")


@dataclass(frozen=True)
class TraceFile:
    rank: int | None  # None: a file not named rank-R
    name: str
    uri: str
    size_bytes: int


@dataclass(frozen=True)
class Profile:
    run: str  # TensorBoard's run: steps-A-B
    start_step: int
    end_step: int
    folder: str
    traces: list[TraceFile] = field(default_factory=list)
    summary: dict[str, Any] | None = None  # summary.json: the event's figures and every rank's split


def profile_root(storage_uri: str, job_id: int) -> str:
    """Where a job's profiles are: `tensorboard --logdir` there shows them (the PyTorch Profiler tab)."""
    return f"{job_prefix(storage_uri, job_id)}{PROFILE_DIR}"


def list_profiles(storage_uri: str, job_id: int, *, s3_endpoint_url: str | None = None) -> list[Profile]:
    """The job's profiles in storage, by their first step ([] when there are none, or storage cannot be
    read: a listing is a view, never an error of the job's)."""
    runs_uri = f"{profile_root(storage_uri, job_id)}/{PLUGIN_DIR}"
    try:
        path, filesystem = resolve_uri(runs_uri, s3_endpoint_url=s3_endpoint_url)
        entries = filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except (OSError, ValueError) as err:
        logger.warning("cannot list the profiles of job %d at %s: %s", job_id, runs_uri, err)
        return []
    found: list[Profile] = []
    for entry in sorted(entries, key=lambda entry: entry.base_name)[:MAX_PROFILES]:
        match = _RUN.fullmatch(entry.base_name)
        if entry.type is not pafs.FileType.Directory or match is None:
            continue
        folder = f"{runs_uri}/{entry.base_name}"
        try:
            files = filesystem.get_file_info(pafs.FileSelector(entry.path, allow_not_found=True))
        except OSError as err:
            logger.warning("cannot list profile %s: %s", folder, err)
            continue
        traces = sorted(
            (
                TraceFile(
                    rank=_rank_of(file.base_name),
                    name=file.base_name,
                    uri=f"{folder}/{file.base_name}",
                    size_bytes=file.size or 0,
                )
                for file in files
                if file.type is pafs.FileType.File and file.base_name.endswith(TRACE_SUFFIX)
            ),
            key=lambda trace: (trace.rank is None, trace.rank or 0, trace.name),
        )[:MAX_TRACES]
        found.append(
            Profile(
                run=entry.base_name,
                start_step=int(match[1]),
                end_step=int(match[2]),
                folder=folder,
                traces=traces,
                summary=_read_summary(filesystem, f"{entry.path}/{SUMMARY_FILE}"),
            )
        )
    return sorted(found, key=lambda profile: (profile.start_step, profile.end_step))


def _rank_of(name: str) -> int | None:
    match = _RANK.fullmatch(name.removesuffix(TRACE_SUFFIX))
    return int(match[1]) if match else None


def _read_summary(filesystem: pafs.FileSystem, path: str) -> dict[str, Any] | None:
    try:
        with filesystem.open_input_stream(path) as stream:
            summary = json.loads(stream.read(MAX_SUMMARY_BYTES))
    except (OSError, ValueError):  # not written (yet), or cut short
        return None
    return summary if isinstance(summary, dict) else None
