"""Routes that trainers call on the cluster: their telemetry (metric points and saved checkpoints)."""

from __future__ import annotations

from fastapi import APIRouter, status

from api.deps import JobsDep
from api.schemas import TelemetryAccepted
from service.protocol import TelemetryBatch

router = APIRouter(prefix="/internal", tags=["internal"])


@router.post(
    "/jobs/{job_id}/telemetry", status_code=status.HTTP_202_ACCEPTED, response_model=TelemetryAccepted
)
def post_telemetry(job_id: int, batch: TelemetryBatch, jobs: JobsDep) -> TelemetryAccepted:
    """A trainer rank's batch of per-step metrics (and maybe its newest checkpoint). Idempotent."""
    return TelemetryAccepted(stored=jobs.ingest(job_id, batch))
