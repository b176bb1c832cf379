"""The queues: configuration, use, and the order of their waiting jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import JobsDep
from api.schemas import QueuePublic, QueuesPublic, error_responses

router = APIRouter(prefix="/queues", tags=["queues"])


@router.get("", response_model=QueuesPublic, responses=error_responses(422))
def list_queues(jobs: JobsDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> QueuesPublic:
    """Per queue: its configuration, its share and use of the cluster now (and what it borrows), job
    counts by state, and its first `limit` queued jobs in order with position, reason and ETA."""
    return QueuesPublic(data=[QueuePublic.build(view) for view in jobs.queues(limit=limit)])
