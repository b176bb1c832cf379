"""The cluster's nodes as admins tell Apiary about them: `POST /admin/nodes/{id}/drain`, the call a
termination handler (a spot notice) makes (service.drains)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, status

from api.deps import ADMIN_RESPONSES, CurrentUser, get_runtime
from api.limits import NodeId
from api.schemas import NodeDrainCreate, NodeDrainPublic, error_responses
from service import auth as access
from service.drains import DrainService
from service.runtime import Runtime

router = APIRouter(tags=["nodes"])


async def get_drains(runtime: Annotated[Runtime, Depends(get_runtime)]) -> DrainService:
    return runtime.drains


@router.post(
    "/admin/nodes/{node_id}/drain",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=NodeDrainPublic,
    responses={**ADMIN_RESPONSES, **error_responses(400, 404, 422)},
)
def drain_node(
    node_id: NodeId,
    request: NodeDrainCreate,
    drains: Annotated[DrainService, Depends(get_drains)],
    user: CurrentUser,
) -> NodeDrainPublic:
    """The node goes away in `deadline_s`: no gang is placed there any more, and every job with a worker
    there checkpoints at its next step boundary and is requeued (or, when it cannot make the deadline,
    is stopped before it), within a scheduler tick. Ray is asked to drain the node too."""
    access.require_admin(user, action="drain nodes")
    drain, refused = drains.drain(node_id, deadline_s=request.deadline_s, reason=request.reason, by=user.name)
    assert drain.deadline_at is not None
    return NodeDrainPublic(
        node_id=node_id,
        deadline_at=datetime.fromtimestamp(drain.deadline_at, UTC),
        requested_by=drain.source,
        ray_drain=refused or "accepted",
    )
