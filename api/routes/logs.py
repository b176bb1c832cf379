"""A job's logs: the driver's and every rank's output, from its Ray job (service.logs)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.responses import Response

from api.deps import JobsDep
from api.limits import JobId
from api.schemas import error_responses
from service.contract.spec import MAX_INT

router = APIRouter(prefix="/jobs", tags=["jobs"])

FOLLOW_POLL_S = 1.0


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {}}, "description": "The log (X-Apiary-Attempt: its attempt)."},
        **error_responses(404, 409, 422),
    },
)
def job_logs(
    job_id: JobId,
    jobs: JobsDep,
    attempt: Annotated[
        int | None, Query(ge=1, le=MAX_INT, description="Which attempt (1 = the first); default the latest.")
    ] = None,
    tail: Annotated[int | None, Query(ge=0, le=MAX_INT, description="Only the last N lines.")] = None,
    follow: Annotated[
        bool, Query(description="Stream the log as it grows (text/plain) until the Ray job ends.")
    ] = False,
    raw: Annotated[
        bool, Query(description="Keep terminal escape sequences (colours); by default they are stripped.")
    ] = False,
) -> Response:
    """The output of the job's Ray job: the driver's lines and every rank's (Ray prefixes those with
    the worker's pid and address). A job resubmitted after a recovery or a preemption has one log
    per attempt."""
    source = jobs.log_source(job_id, attempt=attempt)
    headers = {"X-Apiary-Attempt": str(source.attempt)}
    if not follow:
        return PlainTextResponse(jobs.read_logs(source, tail=tail, raw=raw), headers=headers)
    jobs.read_logs(source, tail=0)  # a 404 while one can still be sent, not a broken stream
    return StreamingResponse(
        jobs.follow_logs(source, tail=tail, poll_s=FOLLOW_POLL_S, raw=raw),
        media_type="text/plain; charset=utf-8",
        headers=headers,
    )
