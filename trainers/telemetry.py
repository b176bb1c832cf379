"""Telemetry: every rank's metric points, and rank 0's saved checkpoints, posted to the control plane.

Each rank owns one `Telemetry` (`service.contract.protocol`'s telemetry channel). The train loop calls
`record()` once per step (cheap: an append under a lock); once started, a background thread posts
the buffered points as a `TelemetryBatch` JSON to the job's telemetry URL about once a second, or
sooner when 200 points are waiting, and `close()` posts the rest. Rank 0 also calls
`checkpoint_saved()` right after a checkpoint is persisted, which wakes the thread, and any rank
`event()` for a fact that belongs in the job's timeline (a group start, an anomaly). Before a
checkpoint becomes the one to resume from, every rank posts its buffer on the training thread
(`deliver_before_checkpoint()`): a rank killed after it is resumed there, and points left in its
buffer would be lost for good. Every post
carries the attempt and the worker group's `segment` (`service.contract.protocol.TelemetryBatch`), set once
the ranks agreed on it. Until `start()` (or `with`), nothing is posted but by an explicit
`flush()`. Every post also carries what this rank's process uses (`trainers.system`: CPU, memory,
GPU, data and network bytes), sampled then, at most once a second; the newest point of a post that
took a new sample carries its figures too (`sys_*` values), for the exporters. A reply that says
`stop` (the job was preempted or ran out of runtime) sets `stop_requested`, which the train loop
reads every step. Every post carries the attempt's report token (`service.contract.handoff`) as
`Authorization: Bearer`; a 403 `AttemptSuperseded` reply (the attempt was given up for a newer one)
makes the rank exit at once, like a reply that says `superseded`.

A NaN or infinite value is left out of its point (with a warning): the JSON of a TelemetryBatch
cannot carry it, and the control plane would refuse the whole batch.

The control plane being down must never stop or slow training: a failed post keeps its points for
the next flush, the buffer is bounded (the oldest points are dropped, with a warning, beyond
`max_buffered_points`), and posting happens off the training thread with a short timeout. At the
end, `close()` keeps retrying for up to `close_retry_s` (the service may be restarting), so the last
points and the last checkpoint of a job that ends during an outage still arrive. A
response in the 4xx range (other than 408/429) means the batch itself was refused; resending it
cannot succeed, so it is dropped with a warning instead of blocking everything behind it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from types import TracebackType

import httpx
from pydantic import ValidationError

from service.contract.protocol import (
    HEARTBEAT_S,
    MAX_VALUES_PER_POINT,
    SUPERSEDED_ERROR,
    CheckpointRecord,
    MetricPoint,
    RankStatus,
    SystemStats,
    TelemetryBatch,
    TelemetryReply,
    TrainerEvent,
    clip_reason,
)
from trainers.system import SystemSampler

logger = logging.getLogger(__name__)


# TelemetryBatch refuses more points than this in one post (read from the schema so the two cannot drift).
def _max_length(field: str) -> int:
    return int(
        next(
            rule.max_length
            for rule in TelemetryBatch.model_fields[field].metadata
            if hasattr(rule, "max_length")
        )
    )


MAX_POINTS_PER_POST: int = _max_length("points")
# The exit status of a rank whose attempt the control plane gave up (TelemetryReply.superseded).
EXIT_SUPERSEDED = 75
MAX_EVENTS_PER_POST: int = _max_length("events")


class Telemetry:
    def __init__(
        self,
        *,
        url: str | None,
        attempt: int,
        rank: int,
        token: str | None = None,
        flush_interval_s: float = 1.0,
        flush_points: int = 200,
        max_buffered_points: int = 50_000,
        timeout_s: float = 5.0,
        close_retry_s: float = 120.0,
    ) -> None:
        self.url = url
        self.attempt = attempt
        self.rank = rank
        self.segment = 0  # set by the train loop once the ranks agreed on it
        # What this rank is doing (`progress`), sent with every post; `node` is set by the train loop.
        self.node = ""
        self._step, self._step_at = 0, None  # type: tuple[int, float | None]
        self._phase, self._phase_since = "starting", time.time()
        self._last_post = 0.0
        # What this process uses, sampled with the posts (`trainers.system`).
        self.system = SystemSampler()
        self._system_failed = False
        self.close_retry_s = close_retry_s
        self.flush_interval_s = flush_interval_s
        self.flush_points = flush_points
        self.max_buffered_points = max_buffered_points
        self._points: deque[MetricPoint] = deque()
        self._checkpoints: deque[CheckpointRecord] = deque()
        self._events: deque[TrainerEvent] = deque()
        self._lock = threading.Lock()  # guards the two buffers
        self._send_lock = threading.Lock()  # one flush at a time (thread vs close)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self.stop_requested = threading.Event()
        self._failing = False
        self._non_finite_seen: set[str] = set()
        self.dropped_points = 0
        headers = {"content-type": "application/json"}
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(timeout=timeout_s, headers=headers) if url else None
        self._thread: threading.Thread | None = None

    def start(self) -> Telemetry:
        """Post in the background from now on (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"apiary-telemetry-{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    # -- the training thread's side -------------------------------------------------------------------

    def record(self, step: int, values: dict[str, float]) -> None:
        finite = {name: value for name, value in values.items() if math.isfinite(value)}
        if len(finite) < len(values):
            self._warn_non_finite(step, values)
        point = MetricPoint(step=step, rank=self.rank, time=time.time(), values=finite)
        with self._lock:
            self._points.append(point)
            self._enforce_bound()
            # While the control plane is down, retry on the interval, not on every step.
            wake = len(self._points) >= self.flush_points and not self._failing
        if wake:
            self._wake.set()

    def _warn_non_finite(self, step: int, values: dict[str, float]) -> None:
        # TelemetryBatch JSON turns NaN/inf into null, which the control plane refuses along with the
        # whole batch; leave the value out of the point instead, and say so once per metric.
        for name, value in values.items():
            if not math.isfinite(value) and name not in self._non_finite_seen:
                self._non_finite_seen.add(name)
                logger.warning(
                    "rank %d step %d: %s is %s; left out of telemetry while non-finite",
                    self.rank,
                    step,
                    name,
                    value,
                )

    def checkpoint_saved(
        self, step: int, uri: str, *, resumed: bool = False, write_s: float | None = None
    ) -> None:
        """Report a complete checkpoint: one just persisted, or (`resumed`) the one this worker group
        resumed from, which the control plane may not have heard of (the attempt that wrote it may have
        died before its report left)."""
        logger.info(
            "resuming from checkpoint at step %d: %s" if resumed else "checkpoint at step %d persisted: %s",
            step,
            uri,
            extra={"step": step, "uri": uri},
        )
        with self._lock:
            self._checkpoints.append(CheckpointRecord(step=step, uri=uri, write_s=write_s))
        self._wake.set()

    def progress(self, phase: str, *, step: int | None = None) -> None:
        """This rank enters `phase` (service.contract.protocol.RankStatus), having completed `step` if given.

        Two attribute writes from the training thread: cheap enough for every step."""
        now = time.time()
        if step is not None:
            self._step, self._step_at = step, now
        self._phase, self._phase_since = phase, now

    def status(self, system: SystemStats | None = None) -> RankStatus:
        return RankStatus(
            rank=self.rank,
            step=self._step,
            step_at=self._step_at,
            phase=self._phase,
            phase_since=self._phase_since,
            node=self.node,
            pid=os.getpid(),
            system=system,
        )

    def _sample_system(self) -> tuple[SystemStats | None, bool]:
        """This process's figures (`trainers.system`), and whether they are new since the last post."""
        try:
            return self.system.latest()
        except Exception:
            # What a process uses is worth less than its metrics: never let reading it stop a post.
            if not self._system_failed:
                self._system_failed = True
                logger.exception("cannot sample this rank's system figures; posting without them")
            return None, False

    def event(self, kind: str, *, step: int, message: str, **data: float | int | str) -> None:
        """Tell the control plane a fact for the job's timeline (posted with the next batch)."""
        logger.info("%s at step %d: %s", kind, step, message)
        record = TrainerEvent(
            kind=kind, step=step, rank=self.rank, time=time.time(), message=clip_reason(message), data=data
        )
        with self._lock:
            self._events.append(record)
        self._wake.set()

    def deliver_before_checkpoint(self) -> None:
        """Post what is buffered now, on the calling thread, before a checkpoint becomes the one to resume
        from: a worker that dies after it is resumed there, the steps up to it are never taken again,
        and points still in its buffer would be lost for good. Skipped while posts are failing (the
        control plane is down: the background thread retries, and training must not wait on it)."""
        if self._failing or self.url is None:
            return
        self.flush()

    @property
    def pending_points(self) -> int:
        with self._lock:
            return len(self._points)

    def close(self) -> None:
        """Stop the thread and post what is left, retrying for up to `close_retry_s`; idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        deadline = time.monotonic() + self.close_retry_s
        delivered = self.flush()
        while not delivered and self.url is not None and time.monotonic() < deadline:
            time.sleep(min(self.flush_interval_s, max(0.0, deadline - time.monotonic())))
            delivered = self.flush()
        if not delivered:
            with self._lock:
                left = len(self._points), len(self._checkpoints), len(self._events)
            logger.warning(
                "closing after %g s of retries with %d metric points, %d checkpoint record(s) and %d "
                "event(s) the control plane never received",
                self.close_retry_s,
                *left,
            )
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> Telemetry:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- posting ------------------------------------------------------------------------------------------

    def flush(self) -> bool:
        """Post everything buffered; True when nothing is left. Never raises for network trouble."""
        with self._send_lock:
            while True:
                with self._lock:
                    points = [
                        self._points.popleft() for _ in range(min(len(self._points), MAX_POINTS_PER_POST))
                    ]
                    checkpoint = self._checkpoints.popleft() if self._checkpoints else None
                    events = [
                        self._events.popleft() for _ in range(min(len(self._events), MAX_EVENTS_PER_POST))
                    ]
                heartbeat = time.monotonic() - self._last_post >= HEARTBEAT_S and self._thread is not None
                if not points and checkpoint is None and not events and not heartbeat:
                    return True
                system, fresh = self._sample_system()
                if system is not None and fresh and points:
                    points[-1] = _with_system(points[-1], system)
                batch = TelemetryBatch(
                    attempt=self.attempt,
                    segment=self.segment,
                    points=points,
                    checkpoint=checkpoint,
                    events=events,
                    status=self.status(system),
                )
                if not self._post(batch):
                    self._requeue(points, checkpoint, events)
                    return False

    def _post(self, batch: TelemetryBatch) -> bool:
        """True when the batch is done with: delivered, or refused for good (and dropped)."""
        self._last_post = time.monotonic()  # an attempt counts: a heartbeat is not retried at once
        if self._client is None or self.url is None:
            logger.debug("no telemetry URL: %d points not sent", len(batch.points))
            return True
        try:
            response = self._client.post(self.url, content=batch.model_dump_json())
        except httpx.HTTPError as err:
            self._note_failure(f"{type(err).__name__}: {err}", batch)
            return False
        if response.is_success:
            if self._failing:
                logger.info("control plane reachable again at %s", self.url)
                self._failing = False
            self._read_reply(response)
            return True
        if response.status_code == 403 and _error_name(response) == SUPERSEDED_ERROR:
            self._exit_superseded()
        if response.status_code >= 500 or response.status_code in (408, 429):
            self._note_failure(f"HTTP {response.status_code}", batch)
            return False
        logger.warning(
            "control plane refused a telemetry batch (HTTP %d: %s); dropping its %d points",
            response.status_code,
            response.text[:200],
            len(batch.points),
        )
        self.dropped_points += len(batch.points)
        return True

    def _read_reply(self, response: httpx.Response) -> None:
        try:
            reply = TelemetryReply.model_validate_json(response.content)
        except ValidationError:
            return  # an older control plane, or a bare test server: nothing asked
        if reply.superseded:
            self._exit_superseded()
        if reply.stop and not self.stop_requested.is_set():
            logger.warning("the control plane asks this job to checkpoint and stop (preempted)")
            self.stop_requested.set()

    def _exit_superseded(self) -> None:
        # The control plane gave this attempt up (its driver died and the job was resubmitted, or the
        # job ended): this process must not write another checkpoint. Nothing of it is needed any more.
        logger.error("this attempt (%d) was superseded or its job ended: exiting", self.attempt)
        for handler in (*logging.getLogger().handlers, *logging.getLogger("trainers").handlers):
            handler.flush()
        os._exit(EXIT_SUPERSEDED)

    def _note_failure(self, reason: str, batch: TelemetryBatch) -> None:
        # Warn once per outage, not once a second for as long as it lasts.
        level = logging.DEBUG if self._failing else logging.WARNING
        logger.log(
            level,
            "telemetry post to %s failed (%s); keeping %d points for retry",
            self.url,
            reason,
            len(batch.points),
        )
        self._failing = True

    def _requeue(
        self, points: list[MetricPoint], checkpoint: CheckpointRecord | None, events: list[TrainerEvent]
    ) -> None:
        with self._lock:
            self._points.extendleft(reversed(points))
            self._events.extendleft(reversed(events))
            if checkpoint is not None:
                self._checkpoints.appendleft(checkpoint)
            self._enforce_bound()

    def _enforce_bound(self) -> None:
        """Drop the oldest points beyond the bound (call with `_lock` held)."""
        excess = len(self._points) - self.max_buffered_points
        if excess <= 0:
            return
        for _ in range(excess):
            self._points.popleft()
        if (
            self.dropped_points == 0
            or (self.dropped_points + excess) // 10_000 > self.dropped_points // 10_000
        ):
            logger.warning(
                "telemetry buffer full (%d points): dropped the oldest; %d dropped so far",
                self.max_buffered_points,
                self.dropped_points + excess,
            )
        self.dropped_points += excess

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.flush()
            except Exception:
                # A telemetry bug must not kill the thread silently and leave points piling up unseen.
                logger.exception("telemetry flush failed")


def _with_system(point: MetricPoint, system: SystemStats) -> MetricPoint:
    """`point` with the figures of a new system sample (for the exporters: `SYSTEM_PREFIX`), unless that
    would take it past the values a point may carry, or it has values of those names of its own."""
    figures = system.point_values()
    if len(point.values) + len(figures) > MAX_VALUES_PER_POINT or figures.keys() & point.values.keys():
        return point
    return point.model_copy(update={"values": {**point.values, **figures}})


def _error_name(response: httpx.Response) -> str | None:
    """The `error` of an API error reply (api.errors), or None for any other body."""
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("error") if isinstance(body, dict) else None
