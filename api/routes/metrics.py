"""Prometheus: `GET /metrics`, the service's metrics in Prometheus' text format (service.observability).

Not to be confused with `GET /jobs/{id}/metrics`, a job's training metrics as JSON."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api.deps import RuntimeDep
from service.observability import CONTENT_TYPE

router = APIRouter(tags=["ops"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format."}},
)
def prometheus_metrics(runtime: RuntimeDep) -> Response:
    """Jobs by queue and state, queue depth, running workers, resources in use per queue, each running
    job's step and samples/s (read from the database now); admission waits, scheduler passes, restarts,
    recoveries, preemptions and metric points ingested (counted by this process since it started)."""
    return Response(content=runtime.metrics.render(), media_type=CONTENT_TYPE)
