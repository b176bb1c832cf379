"""The protocol between the control plane and a job on the cluster: everything that crosses it.

Service → job. The scheduler submits each attempt of a job as a Ray job whose entrypoint is
`entrypoint()` (`python -P -m trainers.launch`, with the interpreter of Apiary's environment or
`APIARY_JOB_PYTHON`) and whose environment is `launch_env(pointer)`: a small `LaunchPointer` as JSON
in `APIARY_LAUNCH`, plus the settings every process of the job needs. The pointer names the
attempt's handoff folder in storage, which holds the `LaunchRequest` and the attempt's report token
(`service.contract.handoff`): neither the spec (exec caps one variable at 128 KiB) nor the token is in what
Ray stores of the job. Apiary's own code travels with the job (`code_modules()`, Ray's runtime_env
`py_modules`), so a node needs only the same torch and ray.

Job → service, two channels:
- telemetry: every rank posts `TelemetryBatch`es (its per-step metric points, its `RankStatus` with
  what its process uses, `SystemStats`, and rank 0 the checkpoint it just saved) to
  `LaunchRequest.telemetry_url` (`trainers.telemetry`), with the attempt's report token as
  `Authorization: Bearer <token>`; a post without it is refused (401), and one of an attempt that
  was given up gets 403 (`AttemptSuperseded`): its rank exits. The `TelemetryReply` carries the
  control plane's one request back: `stop` (the job was preempted or ran out of runtime), on which
  the ranks checkpoint at their next common step and exit;
- the end: the Ray job's exit status, and for a failure the last line of its log that starts with
  `ERROR_PREFIX` (the job failed for good: its own code, its data, or its failure budget spent) or
  `RETRY_PREFIX` (something outside the job failed: the cluster, storage), which carries a one-line
  reason of at most `MAX_REASON_CHARS` that a user can act on (`error_line` writes it,
  `failure_from_logs` finds it). A job that died without either line (its driver was killed, its
  node lost) failed outside its own code too: the service recovers it.

Like `service.contract.spec`, this module needs no SQLAlchemy, FastAPI or Ray: both sides import it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from service.contract.spec import MAX_INT, MAX_URI_CHARS, NO_NUL, Bool, Float, Int, JobSpec, Strict
from service.contract.system import SYSTEM_FIGURES

LAUNCH_ENV_VAR = "APIARY_LAUNCH"
LAUNCH_MODULE = "trainers.launch"
ERROR_PREFIX = "apiary-error:"
RETRY_PREFIX = "apiary-retry:"
# A reason is one line in a log and in the job's API record, not a traceback.
MAX_REASON_CHARS = 500
# Bounds of one telemetry post (trainers.telemetry reads them from the schema, and flushes sooner).
MAX_POINTS_PER_POST = 1000
MAX_VALUES_PER_POINT = 256
MAX_METRIC_NAME_CHARS = 128
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_.]*(Error|Exception)\b.*:")


class LaunchRequest(Strict):
    """What the service tells `python -m trainers.launch` about one attempt of a job."""

    job_id: Int = Field(le=MAX_INT)
    attempt: Int = Field(le=MAX_INT, ge=1)
    submission_id: str | None = Field(default=None, description="This attempt's Ray job.")
    spec: JobSpec
    storage_uri: str = Field(description="Root for checkpoints; the run lives at {storage_uri}/{run_name}.")
    run_name: str
    telemetry_url: str | None = Field(description="POST target for TelemetryBatch; None = log only.")
    data_cpus: Float = Field(default=1.0, gt=0, description="CPU budget of the job's Ray Data tasks.")
    failures_left: Int | None = Field(
        default=None,
        le=MAX_INT,
        ge=0,
        description="Worker-group restarts this attempt may take (Ray Train's max_failures): what is "
        "left of the spec's max_failures after the job's earlier failures; None = all of it.",
    )
    s3_endpoint_url: str | None = None
    mtbf_s: Float | None = Field(
        default=None,
        gt=0,
        description="checkpoint.auto: the job's mean time between failures (service.planning.measured); "
        "None = the trainers' own default.",
    )
    mtbf_basis: str | None = Field(default=None, description="Why that MTBF, for the cadence's event.")
    data_trace_dir: str | None = Field(
        default=None,
        description="Debugging aid: every rank appends the sample ids of each step to "
        "{data_trace_dir}/{run_name}/rank-{rank}.jsonl (datasets with an `id` column).",
    )


class LaunchPointer(Strict):
    """What a job's environment carries (`LAUNCH_ENV_VAR`): where its attempt's handoff is."""

    job_id: int
    attempt: int = Field(ge=1)
    handoff_uri: str = Field(description="The attempt's handoff folder (file:// or s3://).")
    s3_endpoint_url: str | None = None
    # Where the driver redeems `credentials_token`, once, for the job's S3 credentials
    # (service.contract.storage.S3Credentials) before it reads anything: the token is the one
    # secret-like value in the runtime_env, dead once redeemed, and none on a pointer passed on.
    credentials_url: str | None = None
    credentials_token: str | None = Field(default=None, repr=False)


def entrypoint(python: str | None = None) -> str:
    """The launch command, with `python` (Settings.job_python; default: the interpreter of Apiary's
    own environment, not the raylet's PATH). `-P`: the driver's working folder (a Ray job's is its
    working_dir) goes not first on sys.path, so it cannot shadow the packages `code_modules` ships."""
    return f"{python or sys.executable} -P -m {LAUNCH_MODULE}"


def code_modules() -> list[str]:
    """The folders of the packages a job runs (`service`, for its spec and protocol, `trainers`, and
    `apiary` with the `api` it re-exports from, for user code that imports `apiary.Recipe` or
    `apiary.TrainContext`), for Ray's runtime_env `py_modules`: shipped with the job, a node needs no
    copy of Apiary."""
    folders = [str(Path(__file__).parents[1])]
    # Found, not imported: the service never imports the trainers (and they import torch).
    for package in (LAUNCH_MODULE.split(".", 1)[0], "apiary", "api"):
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise RuntimeError(f"the {package} package is not installed beside the service")
        folders.append(str(next(iter(found.submodule_search_locations))))
    return folders


def find_module(name: str) -> ModuleSpec | None:
    """The spec of module `name` as the path finders see it, found without importing any package (the
    API checks a custom trainer with it, and so does the job's driver: neither runs the trainer's code)."""
    found: ModuleSpec | None = None
    path: list[str] | None = None  # where the next part is looked for (None: sys.path)
    parts = name.split(".")
    for depth, part in enumerate(parts, start=1):
        full = ".".join(parts[:depth])
        try:
            found = PathFinder.find_spec(full, path)
        except KeyError:
            # A namespace package (no __init__.py) below the top level: the path finder asks for its
            # parent in sys.modules, which nothing imported. Its folders are what follows.
            found = ModuleSpec(full, None, is_package=True)
        except (ImportError, ValueError):
            return None
        if found is None:
            return None
        if depth < len(parts):
            if found.submodule_search_locations is None:
                return None  # a plain module has no submodules
            if found.origin is None:  # a namespace package: its folders of that name on the path
                path = [str(Path(entry, part)) for entry in path or sys.path if Path(entry, part).is_dir()]
            else:
                path = list(found.submodule_search_locations)
    return found


def launch_env(pointer: LaunchPointer) -> dict[str, str]:
    """The environment variables of a job's Ray `runtime_env` that carry the protocol."""
    return {
        LAUNCH_ENV_VAR: pointer.model_dump_json(),
        "PYTHONUNBUFFERED": "1",
        # Ray Train would chdir every worker into a trial folder; dataset and storage paths are absolute.
        "RAY_CHDIR_TO_TRIAL_DIR": "0",
    }


class MetricPoint(Strict):
    step: Int = Field(le=MAX_INT, ge=0)
    rank: Int = Field(le=MAX_INT, ge=0)
    time: Float = Field(description="Unix time in seconds.")
    values: dict[str, Float] = Field(
        max_length=MAX_VALUES_PER_POINT,
        json_schema_extra={"propertyNames": {"maxLength": MAX_METRIC_NAME_CHARS}},
    )

    @field_validator("values")
    @classmethod
    def _names(cls, values: dict[str, float]) -> dict[str, float]:
        long = next((name for name in values if len(name) > MAX_METRIC_NAME_CHARS), None)
        if long is not None:
            raise ValueError(f"a metric name is at most {MAX_METRIC_NAME_CHARS} characters: {long[:80]!r}...")
        return values


class CheckpointRecord(Strict):
    """A checkpoint that is complete in storage: its step and its URI (file:// or s3://)."""

    step: Int = Field(le=MAX_INT, ge=0)
    uri: str = Field(max_length=MAX_URI_CHARS, pattern=NO_NUL)
    write_s: Float | None = Field(
        default=None,
        ge=0,
        le=MAX_INT,
        description="How long its slowest rank took to write it (its copy included); None: not measured "
        "(a resumed checkpoint, an older trainer). A node drain's deadline is weighed against it.",
    )


# The event a worker group's rank 0 posts when it starts (its step: the step it resumed from).
GROUP_STARTED = "group_started"
# The event Ray Train's failure policy posts (trainers.launch) when it restarts a failed worker group.
WORKER_FAILED = "worker_failed"


class TrainerEvent(Strict):
    """A fact a rank saw that belongs in the job's timeline; the service writes it as a job event.

    `kind` names it for programs (e.g. `group_started`, `worker_failed`, `anomaly`, `rollback`);
    `message` is the line a person reads; `data` carries its numbers (e.g. `resumed_from`).
    """

    kind: str = Field(pattern=r"^[a-z][a-z_]{0,31}$")
    step: Int = Field(
        le=MAX_INT, ge=0, description="The step it happened at (for group_started: resumed from)."
    )
    rank: Int = Field(le=MAX_INT, ge=0)
    time: Float = Field(description="Unix time in seconds.")
    message: str = Field(max_length=MAX_REASON_CHARS, pattern=NO_NUL)
    data: dict[str, Int | Float | Annotated[str, Field(max_length=MAX_REASON_CHARS, pattern=NO_NUL)]] = Field(
        default_factory=dict, max_length=32
    )


# The error name of a 403 reply to telemetry: the attempt was given up (api.errors, trainers.telemetry).
SUPERSEDED_ERROR = "AttemptSuperseded"

# A rank posts at least this often, with its `RankStatus`, even when it has no new point: the service
# tells a rank that stopped reporting (a frozen process, a lost node) from one that waits.
HEARTBEAT_S = 5.0


# The figures of `SystemStats` that a rank's metric points also carry (`SYSTEM_FIGURES`, for the
# exporters), as `SYSTEM_PREFIX + name`; the exporters tag them `system/<name>`.
SYSTEM_PREFIX = "sys_"


class SystemStats(Strict):
    """What one rank's process uses, sampled at the status cadence (`trainers.system`).

    Rates are over the interval since the rank's previous sample (None on its first). A figure the
    rank cannot read is None (no GPU in use, no /proc). `cpu_percent` counts every thread of the
    process, so it exceeds 100 on more than one core, as `top` shows it. The network counters are the
    node's (its network namespace, loopback left out), not the process's: ranks on one node share them.
    `data_read_bytes` is the Arrow data the rank's data streams received from Ray Data (decoded, in
    memory), counted since the process started.
    """

    sampled_at: Float = Field(description="Unix seconds.")
    cpu_percent: Float | None = Field(default=None, ge=0)
    rss_bytes: Int | None = Field(default=None, ge=0, le=MAX_INT)
    gpu_utilization_percent: Float | None = Field(default=None, ge=0, le=100)
    gpu_memory_bytes: Int | None = Field(
        default=None, ge=0, le=MAX_INT, description="Held by the process's CUDA caching allocator."
    )
    data_read_bytes: Int = Field(default=0, ge=0, le=MAX_INT)
    data_read_bytes_per_s: Float | None = Field(default=None, ge=0)
    net_sent_bytes: Int | None = Field(default=None, ge=0, le=MAX_INT)
    net_recv_bytes: Int | None = Field(default=None, ge=0, le=MAX_INT)
    net_sent_bytes_per_s: Float | None = Field(default=None, ge=0)
    net_recv_bytes_per_s: Float | None = Field(default=None, ge=0)

    def point_values(self) -> dict[str, float]:
        """The figures a metric point carries (`SYSTEM_FIGURES`, those known)."""
        values = {name: getattr(self, name) for name in SYSTEM_FIGURES}
        return {SYSTEM_PREFIX + name: float(value) for name, value in values.items() if value is not None}


class RankStatus(Strict):
    """What one rank is doing, sent with every post: how the service finds hangs and stragglers.

    Fields added later have defaults, so a status of an older trainer still parses (a job's trainers
    ship with the service that submits it: `code_modules`)."""

    rank: Int = Field(le=MAX_INT, ge=0)
    step: Int = Field(le=MAX_INT, ge=0, description="The last step this rank completed.")
    step_at: Float | None = Field(description="When it completed it (Unix seconds); None before step 1.")
    phase: str = Field(
        pattern=r"^[a-z_]{1,16}$",
        description="starting | data (waiting for its next batch) | compute (forward and backward, "
        "which includes DDP's gradient all-reduce) | sync (the step's collective) | checkpoint | eval "
        "(the held-out evaluation after the step) | done",
    )
    phase_since: Float = Field(description="When it entered `phase` (Unix seconds).")
    node: str = Field(max_length=128, pattern=NO_NUL, description="The node it runs on (IP and Ray node id).")
    pid: Int = Field(le=MAX_INT)
    system: SystemStats | None = Field(default=None, description="What its process uses (None: not sampled).")


class TelemetryBatch(Strict):
    """One post from a trainer rank to the control plane."""

    attempt: Int = Field(le=MAX_INT, ge=1)
    segment: Int = Field(
        default=0,
        le=MAX_INT,
        ge=0,
        description="Which start of the worker group within the attempt sent it: rank 0's start time "
        "in milliseconds, shared by every rank, so a later restart has a larger one; 0 = not known "
        "(a custom trainer). Ray Train restarts a group from its latest checkpoint, so steps repeat: "
        "(attempt, segment) tells the replayed points from the abandoned ones.",
    )
    points: list[MetricPoint] = Field(default_factory=list, max_length=MAX_POINTS_PER_POST)
    checkpoint: CheckpointRecord | None = None
    events: list[TrainerEvent] = Field(default_factory=list, max_length=100)
    status: RankStatus | None = None


class TelemetryReply(Strict):
    stored: Int = Field(le=MAX_INT, description="Metric points taken (a re-posted point is stored once).")
    stop: Bool = Field(default=False, description="Checkpoint at the next step and exit: preempted.")
    superseded: Bool = Field(
        default=False,
        description="This attempt was given up (the job was recovered as a newer one): exit at once, "
        "without a checkpoint, so that it never writes beside the new attempt.",
    )


def clip_reason(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def error_line(reason: str, *, retryable: bool = False) -> str:
    """The last line a failing job writes to its log."""
    return f"{RETRY_PREFIX if retryable else ERROR_PREFIX} {clip_reason(reason)}"


@dataclass(frozen=True)
class JobFailure:
    reason: str
    retryable: bool  # the failure was not the job's own: a new attempt from its checkpoint may succeed


def failure_from_logs(logs: str, fallback: str) -> JobFailure:
    """Why a job failed: its last `error_line`, else the last exception line, else Ray's message.

    Only an `ERROR_PREFIX` line makes it the job's own failure; a job that died without saying why
    (a killed driver, a lost node) is retryable.
    """
    lines = [line.strip() for line in logs.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(ERROR_PREFIX):
            return JobFailure(line.removeprefix(ERROR_PREFIX).strip(), retryable=False)
        if line.startswith(RETRY_PREFIX):
            return JobFailure(line.removeprefix(RETRY_PREFIX).strip(), retryable=True)
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return JobFailure(clip_reason(line), retryable=True)
    return JobFailure(
        clip_reason(fallback) if fallback else "the Ray job failed without a message", retryable=True
    )
