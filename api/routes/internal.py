"""Routes that trainers call on the cluster: their telemetry (metric points and saved checkpoints)."""

from __future__ import annotations

from fastapi import APIRouter, status

from api.deps import JobsDep
from api.limits import JobId
from api.schemas import error_responses
from service.protocol import TelemetryBatch, TelemetryReply

router = APIRouter(prefix="/internal", tags=["internal"])


@router.post(
    "/jobs/{job_id}/telemetry",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=TelemetryReply,
    responses=error_responses(400, 404, 422),
)
def post_telemetry(job_id: JobId, batch: TelemetryBatch, jobs: JobsDep) -> TelemetryReply:
    """A trainer rank's batch of per-step metrics (and maybe its newest checkpoint). Idempotent. The
    reply says whether the job must checkpoint and stop (it was preempted)."""
    return jobs.ingest(job_id, batch)
