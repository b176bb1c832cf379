"""One database poll per watched job, fanned out to every stream that watches it.

A job stream (api.routes.streams) is a *watcher*. While a job has watchers on this replica, one
`JobFeed` task polls the database for the job's new events, metric points and state every POLL_S
(at once again while a batch comes back full), and hands each batch to every watcher's queue.
Without it, each stream polled on its own: a thousand browsers on one job were two thousand polls a
second. The feed reads the database, never this process's memory, so what another replica stored
reaches these watchers too, within POLL_S.

Joining. A watcher first catches up alone from its own cursor (its Last-Event-ID, or the start)
until a poll comes back not full. With no feed for the job, it then starts one at its cursor. With
one, it subscribes first; if the feed is past its cursor (or handed out a newer state of the job),
it catches up alone once more, while the batches the feed hands out meanwhile queue up. Either way
the feed's next batch starts at or before the watcher's cursor, and the watcher skips the rows it
already sent (by row id), so it misses nothing and sends nothing twice.

A slow watcher. Its queue holds at most QUEUE_BATCHES batches. The feed never waits for a watcher:
one whose queue is full is dropped (`lagged`). It sends what it holds, then catches up alone from
its cursor (its own polls, at the pace its client reads) and joins again. Memory stays bounded:
batches are shared by all watchers, and each queue holds at most QUEUE_BATCHES references.

The feed stops when its last watcher leaves, and after it handed out the batch that says the job
ended. Credentials are re-checked per stream, but through `CredentialChecks`: streams that present
the same credential share one database read (started after the batch they are about to send was
read), so the checks grow with distinct credentials, not with watchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from api.deps import SESSION_COOKIE, authenticate_request
from api.schemas import EventPublic, JobPublic, MetricPublic
from service.auth import Auth
from service.contract.errors import JobNotFound, Unauthenticated
from service.jobs import JobService

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often a job's feed looks for new rows
EVENTS_PER_POLL = 500
METRICS_PER_POLL = 5_000
HAND_SLICE = 64  # watchers handed a batch between two looks of the event loop at other sockets
QUEUE_BATCHES = 16  # a watcher this many batches behind is dropped from the feed (it catches up alone)
AUTH_RECHECK_S = 5.0  # at most this long between a credential's revocation and its streams' end

# Polls of jobs' stored changes in this process: by feeds, and by watchers catching up alone (the tests
# and the benchmark read them: the first grows with watched jobs, never with watchers).
polls = {"feed": 0, "alone": 0}
watching = 0  # watchers in the feeds of this process now
credential_reads = 0  # database reads of CredentialChecks (shared by the streams of one credential)


@dataclass
class JobCursor:
    """Where a client of a job stream is: the last event row and metric row it was sent."""

    event_id: int = 0
    metric_id: int = 0

    def __str__(self) -> str:
        return f"{self.event_id}.{self.metric_id}"

    @classmethod
    def parse(cls, value: str) -> JobCursor:
        event_id, _, metric_id = value.partition(".")
        cursor = cls(int(event_id), int(metric_id or 0))
        if cursor.event_id < 0 or cursor.metric_id < 0:
            raise ValueError(value)
        return cursor


@dataclass(frozen=True)
class JobBatch:
    """One poll's result, serialized once for every watcher (in the poll's worker thread)."""

    read_at: float  # monotonic, before the read: a credential checked after this covers the batch
    job: str  # JobPublic JSON
    state: str  # the job's state
    terminal: bool
    events: list[tuple[int, str]]  # (row id, EventPublic JSON)
    metrics: list[tuple[int, str]]  # (row id, MetricPublic JSON): only the points that count
    metrics_json: str  # MetricsPublic of all of `metrics` ("" without any)
    metric_id: int  # the last metric row read (past rows left out: a newer segment replaced them)
    more: bool  # a batch was full: poll again without sleeping


def poll_job(jobs: JobService, job_id: int, cursor: JobCursor, *, by: str) -> JobBatch:
    """What the job stored after `cursor` (JobNotFound for an unknown job); blocking."""
    polls[by] += 1
    read_at = time.monotonic()
    changes = jobs.changes_after(
        job_id,
        event_id=cursor.event_id,
        metric_id=cursor.metric_id,
        max_events=EVENTS_PER_POLL,
        max_metrics=METRICS_PER_POLL,
    )
    job = JobPublic.build(changes.job)
    metrics = [(point.id, MetricPublic.build(point).model_dump_json()) for point in changes.metrics]
    return JobBatch(
        read_at=read_at,
        job=job.model_dump_json(),
        state=job.state.value,
        terminal=job.state.is_terminal,
        events=[(event.id, EventPublic.build(event).model_dump_json()) for event in changes.events],
        metrics=metrics,
        metrics_json=metrics_json([point for _, point in metrics]) if metrics else "",
        metric_id=changes.metric_id,
        more=len(changes.events) == EVENTS_PER_POLL
        or changes.metric_id - cursor.metric_id >= METRICS_PER_POLL,
    )


def metrics_json(points: list[str]) -> str:
    """MetricsPublic's JSON, from its points' (what MetricsPublic.model_dump_json writes, without
    building the points again: a stream that joins gets up to METRICS_PER_POLL of them)."""
    return f'{{"data":[{",".join(points)}],"count":{len(points)}}}'


@dataclass(eq=False)
class Watcher:
    """One stream's place in a feed: the batches handed to it and not yet sent."""

    feed: JobFeed
    queue: asyncio.Queue[JobBatch | None] = field(default_factory=lambda: asyncio.Queue(QUEUE_BATCHES))
    lagged: bool = False  # dropped for a full queue: catch up alone, then join again
    closed: bool = False  # the feed ended (the job ended, or is gone)

    async def next(self, *, timeout_s: float) -> JobBatch | None:
        """The next batch; None when there is none for now (`timeout_s`) or there will be no more from
        this feed (`lagged` or `closed`, once the queue is drained)."""
        if self.queue.empty() and (self.lagged or self.closed):
            return None
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self.queue.get(), timeout_s)
        return None

    def leave(self) -> None:
        self.feed.leave(self)

    def hand(self, batch: JobBatch | None) -> None:
        try:
            self.queue.put_nowait(batch)
        except asyncio.QueueFull:
            self.lagged = True  # it finds out once it has drained the queue
            self.feed.leave(self)


class JobFeed:
    """The one poller of a job (see the module docstring)."""

    def __init__(self, feeds: JobFeeds, job_id: int, cursor: JobCursor) -> None:
        self.feeds = feeds
        self.job_id = job_id
        self.cursor = JobCursor(cursor.event_id, cursor.metric_id)
        self.job: str | None = None  # the job's JSON as last handed out
        self.watchers: set[Watcher] = set()
        self.task = asyncio.create_task(self._run(), name=f"job-feed-{job_id}")

    def join(self) -> Watcher:
        global watching
        watcher = Watcher(self)
        self.watchers.add(watcher)
        watching += 1
        return watcher

    def leave(self, watcher: Watcher) -> None:
        global watching
        if watcher in self.watchers:
            self.watchers.remove(watcher)
            watching -= 1
            if not self.watchers:
                self.stop()

    def stop(self) -> None:
        if self.feeds.feeds.get(self.job_id) is self:
            del self.feeds.feeds[self.job_id]
        global watching
        for watcher in list(self.watchers):
            watcher.closed = True
            with contextlib.suppress(asyncio.QueueFull):  # a full one finds `closed` once drained
                watcher.queue.put_nowait(None)  # wakes one that waits
        watching -= len(self.watchers)
        self.watchers.clear()
        if asyncio.current_task() is not self.task:
            self.task.cancel()

    async def _run(self) -> None:
        while self.watchers:
            try:
                batch = await run_in_threadpool(
                    poll_job, self.feeds.jobs, self.job_id, self.cursor, by="feed"
                )
            except JobNotFound:  # deleted (retention): its streams end
                self.stop()
                return
            except Exception:  # the database away for a moment: the watchers wait, the feed tries again
                logger.warning("job feed poll failed", exc_info=True, extra={"job": {"id": self.job_id}})
                await asyncio.sleep(POLL_S)
                continue
            event_id = batch.events[-1][0] if batch.events else self.cursor.event_id
            moved = (event_id, batch.metric_id) != (self.cursor.event_id, self.cursor.metric_id)
            news = moved or batch.job != self.job or batch.terminal
            self.cursor, self.job = JobCursor(event_id, batch.metric_id), batch.job
            # The cursor and state above are the feed's before its watchers have the batch: one that
            # joins meanwhile is behind it and catches up alone (JobFeeds.watch).
            for index, watcher in enumerate(list(self.watchers) if news else ()):  # empty: wakes nobody
                watcher.hand(batch)
                if index % HAND_SLICE == HAND_SLICE - 1:
                    await asyncio.sleep(0)  # let other requests in between (a thousand watchers wake)
            if batch.terminal and not batch.more:
                self.stop()  # each watcher ends on this batch
                return
            if not batch.more:
                await asyncio.sleep(POLL_S)


@dataclass
class JobFeeds:
    """The feeds of this app, by job id."""

    jobs: JobService
    feeds: dict[int, JobFeed] = field(default_factory=dict)

    def watch(self, job_id: int, cursor: JobCursor, *, job: str | None) -> tuple[Watcher, bool]:
        """A watcher of the job's feed, started at `cursor` when there is none; and whether it must
        catch up alone once more: the feed was there before it and is past `cursor` (its next batch
        starts after it), or handed out a state of the job other than `job`, the last one the
        watcher sent. At or ahead of the feed, it skips by row id what it already sent."""
        feed = self.feeds.get(job_id)
        if feed is None:
            feed = self.feeds[job_id] = JobFeed(self, job_id, cursor)
            return feed.join(), False
        behind = cursor.event_id < feed.cursor.event_id or cursor.metric_id < feed.cursor.metric_id
        return feed.join(), behind or job != feed.job

    def close(self) -> None:
        for feed in list(self.feeds.values()):
            feed.stop()
            feed.task.cancel()


class CredentialChecks:
    """Re-checks of streams' credentials, shared by the streams that present the same one: a check
    started at or after `since` answers every stream that asks with that `since` (see the module
    docstring)."""

    MAX_KEPT = 10_000  # distinct credentials remembered before the old ones are forgotten

    def __init__(self, auth: Auth) -> None:
        self.auth = auth
        self._checks: dict[tuple[str | None, str | None], tuple[float, asyncio.Future[bool]]] = {}

    async def valid(self, request: Request, *, since: float) -> tuple[bool, float]:
        """Whether the request's credential is still good, and when that check started."""
        key = (request.headers.get("authorization"), request.cookies.get(SESSION_COOKIE))
        entry = self._checks.get(key)
        if entry is None or entry[0] < since:
            if len(self._checks) >= self.MAX_KEPT:
                self._checks.clear()
            entry = (time.monotonic(), asyncio.ensure_future(self._check(request)))
            self._checks[key] = entry
        # Shielded: a stream that goes away while it waits does not cancel the others' answer.
        return await asyncio.shield(entry[1]), entry[0]

    async def _check(self, request: Request) -> bool:
        global credential_reads
        credential_reads += 1
        try:
            await run_in_threadpool(authenticate_request, self.auth, request)
        except Unauthenticated:
            return False
        return True


class CredentialCheck:
    """One stream's credential, checked again before each batch it sends and at least every
    AUTH_RECHECK_S."""

    def __init__(self, checks: CredentialChecks, request: Request) -> None:
        self.checks = checks
        self.request = request
        self.checked_at = time.monotonic()  # the route's own dependency checked it just now

    async def still_valid(self, *, read_at: float | None) -> bool:
        """Whether the stream may go on: `read_at` is when what it is about to send was read (None:
        nothing to send; checked when half the re-check period has passed, so that a check shared
        from another stream is never older than AUTH_RECHECK_S)."""
        now = time.monotonic()
        if read_at is None:
            if now - self.checked_at < AUTH_RECHECK_S / 2:
                return True
            since = now - AUTH_RECHECK_S / 2
        else:
            since = read_at
        valid, started = await self.checks.valid(self.request, since=since)
        self.checked_at = max(self.checked_at, started)
        return valid

    def wait_s(self) -> float:
        """How long the stream may wait for something to send before it must check again."""
        return max(0.0, self.checked_at + AUTH_RECHECK_S / 2 - time.monotonic()) + 0.01
