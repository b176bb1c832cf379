"""Server-sent event streams: a job's state, events and metric points as they are stored, and the queues.

The contract (event types, ids, resumption) is docs/jobs.md, "Live streams" and the API table. A
stream lives only as long as its credential: it checks it again before each batch of messages it
sends and at least every AUTH_RECHECK_S, and ends when it was revoked (or its web session ended);
streams with the same credential share those checks (api.feeds.CredentialChecks). The streams of one
job share one poll of the database by row id past a cursor (api.feeds: one feed per watched job,
fanned out to each stream's bounded queue); the queues streams share one read of the queues per
QUEUES_POLL_S (QueuesTracker). Polls run in a worker thread, with a session per poll (none is held
across the sleeps). sse-starlette frames the messages, sends the keep-alive comments and
ends a stream when its client goes away or the server stops (with a plain StreamingResponse, uvicorn
waited on an open stream after SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from api.deps import AuthDep, JobsDep
from api.feeds import (
    CredentialCheck,
    CredentialChecks,
    JobBatch,
    JobCursor,
    JobFeeds,
    metrics_json,
    poll_job,
)
from api.limits import PRINTABLE_PATTERN, JobId
from api.schemas import QueuesPublic, error_responses
from service.auth import Auth
from service.contract.errors import JobNotFound
from service.jobs import JobService

router = APIRouter(tags=["streams"])

QUEUES_POLL_S = 1.0  # how often the queues are read again (shared by every queues stream)
KEEP_ALIVE_S = 15.0  # a comment this often (sse-starlette sends it whatever else was sent)


SEP = "\n"  # sse-starlette's default is CRLF
KEEP_ALIVE = ServerSentEvent(comment="keep-alive", sep=SEP)
HEADERS = {"Cache-Control": "no-cache"}  # sse-starlette adds X-Accel-Buffering: no


def sse(event: str, data: str, *, id: str) -> ServerSentEvent:
    """One message. `data` is one line of JSON (pydantic and json.dumps never write a newline)."""
    return ServerSentEvent(data, event=event, id=id, sep=SEP)


def _resume_from(header: str, query: str) -> str | None:
    return header or query or None


def _bad_cursor(where: str, value: str) -> RequestValidationError:
    return RequestValidationError(
        [
            {
                "loc": (where, "last_event_id" if where == "query" else "last-event-id"),
                "msg": f"{value!r} is not an id this stream sent",
                "type": "value_error",
            }
        ]
    )


# "<event id>.<metric id>", as JobCursor writes it; "<event id>" alone means no metric yet (ids of at
# most 16 digits: within a 64-bit column); "" = from the start.
JOB_CURSOR_PATTERN = r"^([0-9]{1,16}(\.[0-9]{1,16})?)?$"


# Streams being served now (the tests check that a client going away ends its stream).
open_streams = 0


async def _counted(messages: AsyncIterator[ServerSentEvent]) -> AsyncIterator[ServerSentEvent]:
    global open_streams
    open_streams += 1
    try:
        async for message in messages:
            yield message
    finally:
        open_streams -= 1


def _event_stream(messages: AsyncIterator[ServerSentEvent]) -> EventSourceResponse:
    return EventSourceResponse(
        _counted(messages),
        headers=HEADERS,
        sep=SEP,
        ping=KEEP_ALIVE_S,
        ping_message_factory=lambda: KEEP_ALIVE,
    )


@router.get("/jobs/{job_id}/stream", response_class=EventSourceResponse, responses=error_responses(404, 422))
async def stream_job(
    job_id: JobId,
    request: Request,
    jobs: JobsDep,
    auth: AuthDep,
    # Not nullable ("" = not given): a client generating from the schema has no null for a header.
    last_event_id: Annotated[
        str, Query(pattern=JOB_CURSOR_PATTERN, description="Resume after this id (as Last-Event-ID).")
    ] = "",
    last_event_id_header: Annotated[str, Header(alias="Last-Event-ID", pattern=JOB_CURSOR_PATTERN)] = "",
) -> EventSourceResponse:
    """A job's state, events and metric points as server-sent events, until it ends (see docs/jobs.md,
    "Live streams"). 404 for an unknown job."""
    resume = _resume_from(last_event_id_header, last_event_id)
    try:
        cursor = JobCursor.parse(resume) if resume else JobCursor()
    except ValueError:
        assert resume is not None
        raise _bad_cursor("header" if last_event_id_header else "query", resume) from None
    # 404 here, before the stream starts.
    first = await run_in_threadpool(poll_job, jobs, job_id, cursor, by="alone")
    shared = _shared(request, auth, jobs)
    credential = CredentialCheck(shared.checks, request)
    return _event_stream(_job_messages(JobSent(cursor), first, shared.feeds, credential, jobs, job_id))


@dataclass
class JobSent:
    """What a job stream sent: its cursor and the job's last state; what a batch adds to it."""

    cursor: JobCursor
    job: str | None = None
    ended: bool = False

    def news(self, batch: JobBatch) -> bool:
        """Whether the batch holds anything this stream has not sent."""
        return (
            batch.job != self.job
            or batch.terminal
            or any(row > self.cursor.event_id for row, _ in batch.events)
            or any(row > self.cursor.metric_id for row, _ in batch.metrics)
        )

    def messages(self, batch: JobBatch) -> list[ServerSentEvent]:
        """The messages of what the batch adds. Each id covers exactly what was sent up to its message:
        a client that resumes from any of them misses nothing and gets nothing twice."""
        cursor, out = self.cursor, []
        if batch.job != self.job:
            out.append(sse("state", batch.job, id=str(cursor)))
            self.job = batch.job
        for row, event in batch.events:
            if row > cursor.event_id:  # a watcher that caught up alone already sent the older ones
                cursor.event_id = row
                out.append(sse("event", event, id=str(cursor)))
        new = [(row, point) for row, point in batch.metrics if row > cursor.metric_id]
        cursor.metric_id = max(cursor.metric_id, batch.metric_id)
        if new:
            body = batch.metrics_json if len(new) == len(batch.metrics) else metrics_json([p for _, p in new])
            out.append(sse("metrics", body, id=str(cursor)))
        if batch.terminal and not batch.more:
            out.append(sse("end", json.dumps({"state": batch.state}), id=str(cursor)))
            self.ended = True
        return out


async def _job_messages(
    sent: JobSent,
    batch: JobBatch,
    feeds: JobFeeds,
    credential: CredentialCheck,
    jobs: JobService,
    job_id: int,
) -> AsyncIterator[ServerSentEvent]:
    """Catch up alone, join the job's feed, send what it hands out; alone again when dropped (the
    protocol is api.feeds')."""

    async def alone() -> JobBatch | None:
        try:
            return await run_in_threadpool(poll_job, jobs, job_id, sent.cursor, by="alone")
        except JobNotFound:  # deleted while watched
            return None

    async def send(batch: JobBatch) -> AsyncIterator[ServerSentEvent]:
        news = sent.news(batch)
        if not await credential.still_valid(read_at=batch.read_at if news else None):
            sent.ended = True
            return
        if news:
            for message in sent.messages(batch):
                yield message

    first: JobBatch | None = batch
    while True:
        while first is not None:  # alone, until a poll comes back not full
            async for message in send(first):
                yield message
            if sent.ended:
                return
            if not first.more:
                break
            first = await alone()
        if first is None:
            return
        watcher, catch_up = feeds.watch(job_id, sent.cursor, job=sent.job)
        try:
            while catch_up:
                caught = await alone()
                if caught is None:
                    return
                async for message in send(caught):
                    yield message
                if sent.ended:
                    return
                catch_up = caught.more
            while not sent.ended:
                batch_or_none = await watcher.next(timeout_s=credential.wait_s())
                if batch_or_none is None:
                    if watcher.lagged or watcher.closed:
                        break
                    if not await credential.still_valid(read_at=None):
                        return
                    continue
                async for message in send(batch_or_none):
                    yield message
        finally:
            watcher.leave()
        if sent.ended:
            return
        first = await alone()  # dropped (a slow client) or the feed ended: alone again from the cursor


@dataclass
class Shared:
    """What the streams of one app share: the job feeds and the credential re-checks."""

    feeds: JobFeeds
    checks: CredentialChecks


def _shared(request: Request, auth: Auth, jobs: JobService) -> Shared:
    shared: Shared | None = getattr(request.app.state, "stream_shared", None)
    if shared is None:
        shared = request.app.state.stream_shared = Shared(JobFeeds(jobs), CredentialChecks(auth))
    return shared


def close_feeds(app_state: object) -> None:
    """Stop the job feeds of an app that stops (its streams end with it)."""
    shared: Shared | None = getattr(app_state, "stream_shared", None)
    if shared is not None:
        shared.feeds.close()


@dataclass
class QueuesTracker:
    """The queues as last read, shared by every queues stream of the app: read at most once per
    QUEUES_POLL_S however many clients watch, and numbered, so that a reconnecting client that saw
    the current one is not sent it again. The counter starts at the app's start time in seconds, so
    an id from before a restart does not match by chance."""

    version: int = field(default_factory=lambda: int(time.time()))
    body: str | None = None
    read_at: float = -1e9  # monotonic, when the last read started
    reads: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def latest(self, jobs: JobService) -> tuple[int, str, float]:
        """The current version, its body, and when it was read."""
        async with self.lock:
            if time.monotonic() - self.read_at >= QUEUES_POLL_S:
                started = time.monotonic()
                self.reads += 1
                overview = await run_in_threadpool(jobs.overview)
                body = QueuesPublic.build(overview).model_dump_json()
                self.read_at = started
                if body != self.body:
                    self.body = body
                    self.version += 1
            assert self.body is not None
            return self.version, self.body, self.read_at


def _tracker(request: Request) -> QueuesTracker:
    tracker: QueuesTracker | None = getattr(request.app.state, "queues_tracker", None)
    if tracker is None:
        tracker = request.app.state.queues_tracker = QueuesTracker()
    return tracker


@router.get("/queues/stream", response_class=EventSourceResponse)
async def stream_queues(
    request: Request,
    jobs: JobsDep,
    auth: AuthDep,
    last_event_id: Annotated[
        str,
        Query(max_length=32, pattern=PRINTABLE_PATTERN, description="Resume after this id (Last-Event-ID)."),
    ] = "",
    last_event_id_header: Annotated[str, Header(alias="Last-Event-ID", max_length=32)] = "",
) -> EventSourceResponse:
    """GET /queues' body as a server-sent event at connect and whenever it changes."""
    tracker = _tracker(request)
    resume = _resume_from(last_event_id_header, last_event_id)
    credential = CredentialCheck(_shared(request, auth, jobs).checks, request)

    async def messages() -> AsyncIterator[ServerSentEvent]:
        sent = resume
        while True:
            version, body, read_at = await tracker.latest(jobs)
            if not await credential.still_valid(read_at=read_at if str(version) != sent else None):
                return
            if str(version) != sent:
                yield sse("queues", body, id=str(version))
                sent = str(version)
            await asyncio.sleep(QUEUES_POLL_S)

    return _event_stream(messages())
