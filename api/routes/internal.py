"""Routes that trainers call on the cluster: their telemetry (metric points and saved checkpoints), and
the redemption of an attempt's fetch token for the job's S3 credentials."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, status

from api.deps import JobsDep, bearer_of
from api.limits import JobId
from api.schemas import error_responses
from service.contract.protocol import TelemetryBatch, TelemetryReply
from service.contract.spec import MAX_INT
from service.contract.storage import S3Credentials

router = APIRouter(prefix="/internal", tags=["internal"])


@router.post(
    "/jobs/{job_id}/telemetry",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=TelemetryReply,
    responses=error_responses(400, 401, 403, 404, 422),
)
def post_telemetry(
    job_id: JobId,
    batch: TelemetryBatch,
    jobs: JobsDep,
    authorization: Annotated[str | None, Header(max_length=256)] = None,
) -> TelemetryReply:
    """A trainer rank's batch of per-step metrics (and maybe its newest checkpoint), with its attempt's
    report token as `Authorization: Bearer <token>` (401 without it, 403 for an attempt that was given
    up). The token is checked before the body is read (api.gate). Idempotent. The reply says whether
    the job must checkpoint and stop (it was preempted)."""
    return jobs.ingest(job_id, batch, token=bearer_of(authorization))


@router.post(
    "/jobs/{job_id}/attempts/{attempt}/credentials",
    response_model=S3Credentials,
    responses=error_responses(401, 403, 404, 422),
)
def redeem_credentials(
    job_id: JobId,
    attempt: Annotated[int, Path(ge=1, le=MAX_INT)],
    jobs: JobsDep,
    authorization: Annotated[str | None, Header(max_length=256)] = None,
) -> S3Credentials:
    """The job's S3 credentials for the driver of its current attempt, in exchange for that attempt's
    fetch token as `Authorization: Bearer <token>`, once (service.contract.handoff): 401 without it,
    403 once it was redeemed, its attempt given up or the job ended (recorded as an event)."""
    return jobs.redeem_credentials(job_id, attempt=attempt, token=bearer_of(authorization))
