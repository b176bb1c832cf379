"""Routes that trainers call on the cluster: reports of metrics and checkpoints."""

from __future__ import annotations

from fastapi import APIRouter, status

from api.deps import JobsDep
from api.schemas import ReportAccepted
from service.spec import ReportBatch

router = APIRouter(prefix="/internal", tags=["internal"])


@router.post("/jobs/{job_id}/reports", status_code=status.HTTP_202_ACCEPTED, response_model=ReportAccepted)
def post_report(job_id: int, batch: ReportBatch, jobs: JobsDep) -> ReportAccepted:
    """A trainer rank's batch of per-step metrics (and maybe its newest checkpoint). Idempotent."""
    return ReportAccepted(stored=jobs.ingest(job_id, batch))
