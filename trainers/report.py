"""Metric and checkpoint reporting from every rank to the control plane.

Each rank owns one `Reporter`. The train loop calls `record()` once per step (cheap: an append under
a lock); a background thread posts the buffered points as a `ReportBatch` JSON to `report_url`
about once a second, or sooner when 200 points are waiting, and `close()` posts the rest. Rank 0
also calls `report_checkpoint()` right after a checkpoint is persisted, which wakes the thread.

A NaN or infinite value is left out of its point (with a warning): the JSON of a ReportBatch
cannot carry it, and the control plane would refuse the whole batch.

The control plane being down must never stop or slow training: a failed post keeps its points for
the next flush, the buffer is bounded (the oldest points are dropped, with a warning, beyond
`max_buffered_points`), and posting happens off the training thread with a short timeout. A
response in the 4xx range (other than 408/429) means the batch itself was refused; resending it
cannot succeed, so it is dropped with a warning instead of blocking everything behind it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from types import TracebackType

import httpx

from service.spec import CheckpointReport, MetricPoint, ReportBatch

logger = logging.getLogger(__name__)

# ReportBatch refuses more points than this in one post (read from the schema so the two cannot drift).
MAX_POINTS_PER_POST: int = next(
    rule.max_length for rule in ReportBatch.model_fields["points"].metadata if hasattr(rule, "max_length")
)


class Reporter:
    def __init__(
        self,
        *,
        report_url: str | None,
        attempt: int,
        rank: int,
        flush_interval_s: float = 1.0,
        flush_points: int = 200,
        max_buffered_points: int = 50_000,
        timeout_s: float = 5.0,
        background: bool = True,
    ) -> None:
        """`background=False` posts only on explicit `flush()`/`close()` (tests, single-shot tools)."""
        self.report_url = report_url
        self.attempt = attempt
        self.rank = rank
        self.flush_interval_s = flush_interval_s
        self.flush_points = flush_points
        self.max_buffered_points = max_buffered_points
        self._points: deque[MetricPoint] = deque()
        self._checkpoints: deque[CheckpointReport] = deque()
        self._lock = threading.Lock()  # guards the two buffers
        self._send_lock = threading.Lock()  # one flush at a time (thread vs close)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._failing = False
        self._non_finite_seen: set[str] = set()
        self.dropped_points = 0
        self._client = httpx.Client(timeout=timeout_s) if report_url else None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name=f"apiary-reporter-{rank}", daemon=True)
            self._thread.start()

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
        # ReportBatch JSON turns NaN/inf into null, which the control plane refuses along with the
        # whole batch; leave the value out of the point instead, and say so once per metric.
        for name, value in values.items():
            if not math.isfinite(value) and name not in self._non_finite_seen:
                self._non_finite_seen.add(name)
                logger.warning(
                    "rank %d step %d: %s is %s; not reported while non-finite", self.rank, step, name, value
                )

    def report_checkpoint(self, step: int, uri: str) -> None:
        logger.info("checkpoint at step %d persisted: %s", step, uri, extra={"step": step, "uri": uri})
        with self._lock:
            self._checkpoints.append(CheckpointReport(step=step, uri=uri))
        self._wake.set()

    @property
    def pending_points(self) -> int:
        with self._lock:
            return len(self._points)

    def close(self) -> None:
        """Stop the thread and post what is left (one try); idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        if not self.flush():
            left = self.pending_points
            if left:
                logger.warning("closing with %d metric points the control plane never received", left)
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> Reporter:
        return self

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
                if not points and checkpoint is None:
                    return True
                batch = ReportBatch(attempt=self.attempt, points=points, checkpoint=checkpoint)
                if not self._post(batch):
                    self._requeue(points, checkpoint)
                    return False

    def _post(self, batch: ReportBatch) -> bool:
        """True when the batch is done with: delivered, or refused for good (and dropped)."""
        if self._client is None or self.report_url is None:
            logger.debug("no report_url: %d points not sent", len(batch.points))
            return True
        try:
            response = self._client.post(
                self.report_url,
                content=batch.model_dump_json(),
                headers={"content-type": "application/json"},
            )
        except httpx.HTTPError as err:
            self._note_failure(f"{type(err).__name__}: {err}", batch)
            return False
        if response.is_success:
            if self._failing:
                logger.info("control plane reachable again at %s", self.report_url)
                self._failing = False
            return True
        if response.status_code >= 500 or response.status_code in (408, 429):
            self._note_failure(f"HTTP {response.status_code}", batch)
            return False
        logger.warning(
            "control plane refused a report batch (HTTP %d: %s); dropping its %d points",
            response.status_code,
            response.text[:200],
            len(batch.points),
        )
        self.dropped_points += len(batch.points)
        return True

    def _note_failure(self, reason: str, batch: ReportBatch) -> None:
        # Warn once per outage, not once a second for as long as it lasts.
        level = logging.DEBUG if self._failing else logging.WARNING
        logger.log(
            level,
            "report to %s failed (%s); keeping %d points for retry",
            self.report_url,
            reason,
            len(batch.points),
        )
        self._failing = True

    def _requeue(self, points: list[MetricPoint], checkpoint: CheckpointReport | None) -> None:
        with self._lock:
            self._points.extendleft(reversed(points))
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
                "report buffer full (%d points): dropped the oldest; %d dropped so far",
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
                # A reporting bug must not kill the thread silently and leave points piling up unseen.
                logger.exception("report flush failed")
