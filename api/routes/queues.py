"""The queues: configuration, use, and the order of their waiting jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import JobsDep
from api.schemas import QueuesPublic, error_responses

router = APIRouter(prefix="/queues", tags=["queues"])


@router.get("", response_model=QueuesPublic, responses=error_responses(422))
def list_queues(jobs: JobsDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> QueuesPublic:
    """Per queue: its configuration, its share and use of the cluster now (and what it borrows), job
    counts by state, and its first `limit` queued jobs in order with position, reason and ETA; and the
    cluster's spot nodes: their capacity now and the interruptions seen."""
    return QueuesPublic.build(jobs.overview(limit=limit))
