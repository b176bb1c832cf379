"""Server-sent event streams: a job's state, events and metric points as they are stored, and the queues.

The contract (event types, ids, resumption) is docs/jobs.md, "Live streams" and the API table. A
stream lives only as long as its credential: it checks it again before each batch of messages it
sends and at least every AUTH_RECHECK_S, and ends when it was revoked (or its web session ended).
Each stream polls the database by row id past its cursor, in a worker thread, with a session per poll
(none is held across the sleeps). sse-starlette frames the messages, sends the keep-alive comments and
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

from api.deps import AuthDep, JobsDep, authenticate_request
from api.limits import PRINTABLE_PATTERN, JobId
from api.schemas import (
    EventPublic,
    JobPublic,
    MetricPublic,
    MetricsPublic,
    QueuePublic,
    QueuesPublic,
    error_responses,
)
from service.auth import Auth
from service.contract.errors import Unauthenticated
from service.jobs import JobService

router = APIRouter(tags=["streams"])

POLL_S = 0.5  # how often a job stream looks for new rows
QUEUES_POLL_S = 1.0  # how often the queues are read again (shared by every queues stream)
KEEP_ALIVE_S = 15.0  # a comment this often (sse-starlette sends it whatever else was sent)
AUTH_RECHECK_S = 5.0  # at most this long between two checks of a stream's credential
EVENTS_PER_POLL = 500
METRICS_PER_POLL = 5_000


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


@dataclass
class JobPoll:
    job: JobPublic
    events: list[EventPublic]
    metrics: list[MetricPublic]
    metric_id: int
    more: bool  # a batch was full: poll again without sleeping


def _poll_job(jobs: JobService, job_id: int, cursor: JobCursor) -> JobPoll:
    changes = jobs.changes_after(
        job_id,
        event_id=cursor.event_id,
        metric_id=cursor.metric_id,
        max_events=EVENTS_PER_POLL,
        max_metrics=METRICS_PER_POLL,
    )
    events, metrics, metric_id = changes.events, changes.metrics, changes.metric_id
    job = JobPublic.build(changes.job)
    return JobPoll(
        job=job,
        events=[EventPublic.build(event) for event in events],
        metrics=[MetricPublic.build(point) for point in metrics],
        metric_id=metric_id,
        more=len(events) == EVENTS_PER_POLL or metric_id - cursor.metric_id >= METRICS_PER_POLL,
    )


class CredentialCheck:
    """A stream's credential, checked again (see the module docstring)."""

    def __init__(self, auth: Auth, request: Request) -> None:
        self.auth = auth
        self.request = request
        self.checked_at = time.monotonic()  # the route's own dependency checked it just now

    async def still_valid(self, *, sending: bool) -> bool:
        """Whether the stream may go on: checked now if it is about to send, or if it is time."""
        if not sending and time.monotonic() - self.checked_at < AUTH_RECHECK_S:
            return True
        try:
            await run_in_threadpool(authenticate_request, self.auth, self.request)
        except Unauthenticated:
            return False
        self.checked_at = time.monotonic()
        return True


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
    first = await run_in_threadpool(_poll_job, jobs, job_id, cursor)  # 404 here, before the stream starts
    credential = CredentialCheck(auth, request)

    async def messages() -> AsyncIterator[ServerSentEvent]:
        poll: JobPoll | None = first
        sent_state: str | None = None
        while True:
            if poll is None:
                poll = await run_in_threadpool(_poll_job, jobs, job_id, cursor)
            # Each id covers exactly what was sent up to its message: a client that resumes from any
            # of them misses nothing and gets nothing twice.
            state = poll.job.model_dump_json()
            sending = state != sent_state or bool(poll.events or poll.metrics) or poll.job.state.is_terminal
            if not await credential.still_valid(sending=sending):
                return
            if state != sent_state:
                yield sse("state", state, id=str(cursor))
                sent_state = state
            for event in poll.events:
                cursor.event_id = event.id
                yield sse("event", event.model_dump_json(), id=str(cursor))
            cursor.metric_id = poll.metric_id  # also past rows left out (a newer segment replaced them)
            if poll.metrics:
                batch = MetricsPublic(data=poll.metrics, count=len(poll.metrics))
                yield sse("metrics", batch.model_dump_json(), id=str(cursor))
            if poll.job.state.is_terminal and not poll.more:
                yield sse("end", json.dumps({"state": poll.job.state.value}), id=str(cursor))
                return
            if not poll.more:
                await asyncio.sleep(POLL_S)
            poll = None

    return _event_stream(messages())


@dataclass
class QueuesTracker:
    """The queues as last read, shared by every queues stream of the app: read at most once per
    QUEUES_POLL_S however many clients watch, and numbered, so that a reconnecting client that saw
    the current one is not sent it again. The counter starts at the app's start time in seconds, so
    an id from before a restart does not match by chance."""

    version: int = field(default_factory=lambda: int(time.time()))
    body: str | None = None
    read_at: float = -1e9
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def latest(self, jobs: JobService) -> tuple[int, str]:
        async with self.lock:
            if time.monotonic() - self.read_at >= QUEUES_POLL_S:
                views = await run_in_threadpool(jobs.queues)
                body = QueuesPublic(data=[QueuePublic.build(view) for view in views]).model_dump_json()
                self.read_at = time.monotonic()
                if body != self.body:
                    self.body = body
                    self.version += 1
            assert self.body is not None
            return self.version, self.body


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
    credential = CredentialCheck(auth, request)

    async def messages() -> AsyncIterator[ServerSentEvent]:
        sent = resume
        while True:
            version, body = await tracker.latest(jobs)
            if not await credential.still_valid(sending=str(version) != sent):
                return
            if str(version) != sent:
                yield sse("queues", body, id=str(version))
                sent = str(version)
            await asyncio.sleep(QUEUES_POLL_S)

    return _event_stream(messages())
