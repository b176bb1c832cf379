"""Where researchers already look: every job's metrics in TensorBoard, and in MLflow when configured.

The rule: the service exports, never the trainers, so a step never waits for a tracker. The replica
that holds the scheduler lease runs an `Exporter` thread; every `export_interval_s` it reads, for each
running job and each job that ended in the last `EXPORT_TAIL_S`, the points stored since its cursor,
and hands rank 0's to each sink:

- which points: rank 0's of the run that counted (`repository.metrics_after`: a step that a restart
  trained again is exported again, as its new value); per-rank detail stays in Apiary's own charts;
- tags: `train/<metric>` for the step metrics (`loss`, `lr`, `samples_per_s`...), `eval/<metric>`
  for `eval_*` metrics (already reduced over ranks by the trainers), `system/<figure>` for what rank
  0's process uses (`sys_*`: CPU, memory, GPU, data and network rates, at the status cadence; every
  rank's are on the job page and in Prometheus);
- each sink keeps its own cursor (the last metric row it took) where it writes, so a restarted or
  new leader goes on where the last one stopped, without a table of its own.

Sinks:
- `TensorBoardSink`: event files under `{storage}/job-N/tensorboard/`, beside the job's checkpoints,
  on local folders and S3 alike (`tensorboard --logdir {storage}` shows every run). Each pass writes a
  new event file (object stores cannot append), named so that TensorBoard reads them in order; the
  first holds the job's hyperparameters (its spec's fields and its `config`) for the HParams tab.
- `MlflowSink` (`APIARY_MLFLOW_TRACKING_URI`): one MLflow run per job, in the experiment named by the
  job's name; its spec as params; metrics as they arrive; `apiary.latest_checkpoint` and the final
  state as tags, and the run ended with the job. Restarts and preemptions keep the one run (found
  again by its `apiary.job_id` tag).

A tracker that is down never fails or slows a job: its sink retries on each pass, and a job's points
that could not be exported for `EXPORT_GIVE_UP_S` are dropped, counted in
`apiary_export_dropped_points_total{sink}` and in a job event.
"""

from __future__ import annotations

import functools
import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from service.compare import flatten
from service.contract.handoff import job_prefix
from service.contract.protocol import SYSTEM_PREFIX
from service.contract.states import ACTIVE_STATES, JobState
from service.contract.storage import resolve_uri
from service.observability import Metrics
from service.settings import Settings
from service.store import repository
from service.store.db import Database
from service.store.models import Job, utcnow

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
CURSOR_FILE = "apiary-export.json"
# How long after a job ended its last points are still looked for (then its sinks are finished).
EXPORT_TAIL_S = 3600.0
# Points a sink could not take for this long are dropped (counted), so a dead tracker never piles up.
EXPORT_GIVE_UP_S = 600.0
# Rows read per job and pass.
EXPORT_BATCH = 20_000


@dataclass(frozen=True)
class Point:
    step: int
    time: float
    values: Mapping[str, float]


@dataclass(frozen=True)
class Batch:
    """What a sink gets for one job in one pass: rank 0's new points, and the row id after them."""

    job: Job
    points: Sequence[Point]
    cursor: int
    finished: bool  # the job ended and nothing more is stored: the sink may close its run
    first: bool  # the sink has taken nothing of this job before


class Sink(Protocol):
    name: str

    def cursor(self, job: Job) -> tuple[int, bool]:
        """The last metric row this sink took for `job` (0: none), and whether it finished the job."""
        ...

    def export(self, batch: Batch) -> None:
        """Write `batch` and then its cursor; raise on failure (the exporter retries)."""
        ...


def tag(metric: str) -> str:
    if metric.startswith(SYSTEM_PREFIX):
        return f"system/{metric.removeprefix(SYSTEM_PREFIX)}"
    return f"eval/{metric.removeprefix('eval_')}" if metric.startswith("eval_") else f"train/{metric}"


def hyperparameters(spec: Mapping[str, Any]) -> dict[str, str | float | bool]:
    """The spec as flat hyperparameters: `config.*` and the fields that shape a run (numbers, text and
    flags as they are, anything else as JSON)."""
    flat = flatten({key: value for key, value in spec.items() if key not in ("name", "dataset")})
    params: dict[str, str | float | bool] = {}
    for key, value in flat.items():
        if value is None:
            continue
        if isinstance(value, bool | str):
            params[key] = value
        elif isinstance(value, int | float):
            params[key] = float(value)
        else:
            params[key] = json.dumps(value)
    return params


# -- TensorBoard ------------------------------------------------------------------------------------


def tfrecord(data: bytes) -> bytes:
    """One record of a TFRecord file (what TensorBoard's event files are), framed as tensorboardX's
    own writer frames it (which writes only to a file it opens itself, not to an object store)."""
    from tensorboardX.record_writer import masked_crc32c as _masked_crc

    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data))


@functools.lru_cache(maxsize=4096)
def _tensorboard_tag(metric: str) -> str:
    """`tag(metric)` as TensorBoard takes it (tensorboardX's own cleaning), worked out once per name."""
    from tensorboardX.summary import scalar

    return str(scalar(tag(metric), 0.0).value[0].tag)


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, settings: Settings) -> None:
        self.storage_uri = settings.resolved_storage_uri
        self.s3_endpoint_url = settings.s3_endpoint_url
        self._files = 0

    def logdir(self, job_id: int) -> str:
        return f"{job_prefix(self.storage_uri, job_id)}{TENSORBOARD_DIR}"

    def _folder(self, job_id: int) -> tuple[str, Any]:
        return resolve_uri(self.logdir(job_id), s3_endpoint_url=self.s3_endpoint_url)

    def cursor(self, job: Job) -> tuple[int, bool]:
        path, filesystem = self._folder(job.id)
        try:
            with filesystem.open_input_stream(f"{path}/{CURSOR_FILE}") as stream:
                saved = json.loads(stream.read())
        except (FileNotFoundError, OSError, ValueError):
            return 0, False
        return int(saved.get("cursor", 0)), bool(saved.get("finished", False))

    def export(self, batch: Batch) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import hparams

        path, filesystem = self._folder(batch.job.id)
        filesystem.create_dir(path, recursive=True)
        records = [Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()]
        if batch.first:
            metrics = sorted({tag(name) for point in batch.points for name in point.values})
            for summary in hparams(hyperparameters(batch.job.spec), {name: 0.0 for name in metrics}):
                records.append(Event(wall_time=time.time(), summary=summary).SerializeToString())
        for point in batch.points:
            if not point.values:
                continue
            # One event per point with all of its values (what tf.summary writes for one step): an
            # eighth of the records, checksums and protobufs of one event per value.
            values = [
                Summary.Value(tag=_tensorboard_tag(name), simple_value=v) for name, v in point.values.items()
            ]
            event = Event(wall_time=point.time, step=point.step, summary=Summary(value=values))
            records.append(event.SerializeToString())
        if batch.points or batch.first:
            # Named so that TensorBoard, which reads a folder's event files in name order, reads them
            # in the order they were written.
            self._files += 1
            name = f"events.out.tfevents.{time.time():017.6f}.apiary.{batch.cursor:012d}.{self._files}"
            with filesystem.open_output_stream(f"{path}/{name}") as stream:
                stream.write(b"".join(tfrecord(record) for record in records))
        with filesystem.open_output_stream(f"{path}/{CURSOR_FILE}") as stream:
            stream.write(json.dumps({"cursor": batch.cursor, "finished": batch.finished}).encode())


# -- MLflow -----------------------------------------------------------------------------------------

_MLFLOW_STATUS = {
    JobState.SUCCEEDED: "FINISHED",
    JobState.FAILED: "FAILED",
    JobState.CANCELLED: "KILLED",
}
# MLflow's bounds: a param value's length; metrics per log_batch call (it takes 1000 entities in all:
# the last call of a pass carries its few tags too).
_MLFLOW_PARAM_CHARS = 6000
_MLFLOW_BATCH = 990


class MlflowSink:
    name = "mlflow"

    def __init__(self, tracking_uri: str, *, timeout_s: float = 30.0) -> None:
        import os

        # One try per call: the exporter retries on its next pass, never inside a pass.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(timeout_s)))
        # MLflow 3's client reports its own usage to MLflow's servers unless told not to: a control
        # plane talks to the tracker it was given and nothing else (an operator may set it to false).
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self._runs: dict[int, str] = {}

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        return str(self.client.create_experiment(name))

    def _find_run(self, job: Job) -> Any | None:
        if job.id in self._runs:
            return self.client.get_run(self._runs[job.id])
        experiment = self._experiment(job.name)
        runs = self.client.search_runs(
            [experiment], filter_string=f"tags.`apiary.job_id` = '{job.id}'", max_results=1
        )
        if runs:
            self._runs[job.id] = runs[0].info.run_id
            return runs[0]
        return None

    def cursor(self, job: Job) -> tuple[int, bool]:
        run = self._find_run(job)
        if run is None:
            return 0, False
        tags = run.data.tags
        return int(tags.get("apiary.metric_cursor", 0)), tags.get("apiary.finished") == "true"

    def _start(self, job: Job) -> str:
        from mlflow.entities import Param

        experiment = self._experiment(job.name)
        run = self.client.create_run(
            experiment,
            run_name=f"job-{job.id}",
            tags={"apiary.job_id": str(job.id), "apiary.owner": job.owner, "apiary.queue": job.queue},
        )
        run_id = str(run.info.run_id)
        params = [
            Param(key[:250], str(value)[:_MLFLOW_PARAM_CHARS])
            for key, value in sorted(hyperparameters(job.spec).items())
        ]
        for start in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[start : start + 100])
        self._runs[job.id] = run_id
        return run_id

    def export(self, batch: Batch) -> None:
        from mlflow.entities import Metric, RunTag

        job = batch.job
        # The run id once known (no request per pass); else the run, found again or started.
        run_id = self._runs.get(job.id)
        if run_id is None:
            run = self._find_run(job)
            run_id = str(run.info.run_id) if run is not None else self._start(job)
        metrics = [
            Metric(tag(name), value, int(point.time * 1000), point.step)
            for point in batch.points
            for name, value in point.values.items()
        ]
        chunks = [metrics[start : start + _MLFLOW_BATCH] for start in range(0, len(metrics), _MLFLOW_BATCH)]
        tags = [
            RunTag("apiary.metric_cursor", str(batch.cursor)),
            RunTag("apiary.state", job.state.value),
        ]
        if job.latest_checkpoint:
            tags.append(RunTag("apiary.latest_checkpoint", job.latest_checkpoint))
        if batch.finished:
            tags.append(RunTag("apiary.finished", "true"))
            if job.message:
                tags.append(RunTag("apiary.message", job.message[:5000]))
        for chunk in chunks[:-1]:
            self.client.log_batch(run_id, metrics=chunk)
        # The cursor goes with the pass's last metrics, in one request: the server stores a batch's metrics
        # before its tags, and no tag when they fail, so the cursor never runs ahead of them.
        self.client.log_batch(run_id, metrics=chunks[-1] if chunks else [], tags=tags)
        if batch.finished:
            self.client.set_terminated(run_id, status=_MLFLOW_STATUS.get(job.state, "FINISHED"))


# -- the exporter -----------------------------------------------------------------------------------


@dataclass
class _Progress:
    cursor: int = 0
    finished: bool = False
    known: bool = False  # the cursor was read from the sink (else: not yet, the sink did not answer)
    failing_since: float | None = None


@dataclass
class Exporter:
    """Feeds each sink every job's new rank-0 points, on the replica that holds the scheduler lease."""

    db: Database
    sinks: Sequence[Sink]
    metrics: Metrics
    is_leader: Callable[[], bool]
    interval_s: float = 2.0
    _progress: dict[tuple[str, int], _Progress] = field(default_factory=dict)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def from_settings(
        cls, settings: Settings, *, db: Database, metrics: Metrics, is_leader: Callable[[], bool]
    ) -> Exporter | None:
        sinks: list[Sink] = []
        if settings.tensorboard:
            sinks.append(TensorBoardSink(settings))
        if settings.mlflow_tracking_uri:
            sinks.append(MlflowSink(settings.mlflow_tracking_uri))
        if not sinks:
            return None
        return cls(
            db=db, sinks=sinks, metrics=metrics, is_leader=is_leader, interval_s=settings.export_interval_s
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="apiary-export", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            if not self.is_leader():
                self._progress.clear()  # another replica exports: read the cursors again on a takeover
                continue
            try:
                self.export_once()
            except Exception:
                logger.exception("export pass failed", extra={"action": "export_failed"})

    def export_once(self, *, now: float | None = None) -> int:
        """One pass over the jobs worth looking at; returns the points handed to the sinks."""
        now = time.time() if now is None else now
        with self.db.session() as session:
            jobs = repository.jobs_to_export(session, ended_after=utcnow() - timedelta(seconds=EXPORT_TAIL_S))
        handed = 0
        for job in jobs:
            for sink in self.sinks:
                handed += self._export_job(sink, job, now=now)
        return handed

    def _export_job(self, sink: Sink, job: Job, *, now: float) -> int:
        progress = self._progress.setdefault((sink.name, job.id), _Progress())
        try:
            if not progress.known:
                cursor, finished = sink.cursor(job)
                # Never below what was dropped while the sink did not answer.
                progress.cursor, progress.finished = max(cursor, progress.cursor), finished
                progress.known = True
            if progress.finished:
                return 0
            with self.db.session() as session:
                rows, cursor = repository.metrics_after(
                    session, job.id, after_id=progress.cursor, limit=EXPORT_BATCH, rank=0
                )
            points = [Point(step=row.step, time=row.time, values=_numbers(row.values)) for row in rows]
            ended = job.state not in ACTIVE_STATES
            finished = ended and len(rows) < EXPORT_BATCH and cursor == progress.cursor
            if not points and not finished:
                return 0
            first = progress.cursor == 0
            sink.export(Batch(job=job, points=points, cursor=cursor, finished=finished, first=first))
        except Exception as err:  # any tracker error: retried, then dropped
            return self._failed(sink, job, progress, err, now=now)
        progress.cursor, progress.finished, progress.failing_since = cursor, finished, None
        return len(points)

    def _failed(self, sink: Sink, job: Job, progress: _Progress, err: Exception, *, now: float) -> int:
        if progress.failing_since is None:
            progress.failing_since = now
            logger.warning(
                "%s export of job %d failed (retried on the next pass): %s",
                sink.name,
                job.id,
                err,
                extra={"action": "export_retry"},
            )
            return 0
        if now - progress.failing_since < EXPORT_GIVE_UP_S:
            return 0
        with self.db.session() as session:
            dropped, cursor = repository.count_metrics_after(
                session, job.id, after_id=progress.cursor, rank=0
            )
            stored = repository.get_job(session, job.id)
            repository.record_event(
                session,
                stored,
                actor="service",
                reason=f"{sink.name} export dropped {dropped} points after failing for "
                f"{EXPORT_GIVE_UP_S:.0f} s: {str(err)[:300]}",
            )
        self.metrics.export_dropped(sink.name, dropped)
        progress.cursor, progress.failing_since = cursor, None
        return 0


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def logdirs(settings: Settings, job_ids: Iterable[int]) -> list[str]:
    """The TensorBoard folders of these jobs (all of them: the storage root, for none)."""
    sink = TensorBoardSink(settings)
    ids = list(job_ids)
    return [sink.logdir(job_id) for job_id in ids] if ids else [settings.resolved_storage_uri]
