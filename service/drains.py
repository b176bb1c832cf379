"""Node drains: a node that says it is going away (a spot notice), and what happens to its jobs.

Where drains come from, both seen by the scheduler at every tick (service.scheduling.scheduler):
- Ray's own (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`, the
  call the autoscaler and KubeRay make), read from the cluster's GCS (service.ray_drains);
- `POST /admin/nodes/{id}/drain {"deadline_s": N}`, for a termination handler that calls Apiary
  directly: a `node_drains` row (every replica sees it; the earlier deadline stands), and Ray is asked
  to drain the node too, when it can be.

What a draining node means:
- its capacity no longer counts: the policy sees the cluster without it (and Ray places no new
  placement group there), so no gang is admitted onto it;
- every running job with a rank there is told to checkpoint at its next step boundary and stop (the
  preemption path: running -> preempting -> queued, `StopReason.DRAINED`) when `can_checkpoint_before`
  says it makes the deadline. One that cannot is stopped at once: it loses the steps since its last
  checkpoint, which it would lose at the deadline anyway, and its gang is free sooner;
- a job told to checkpoint that is still running `STOP_MARGIN_S` before the deadline is stopped then;
- each goes back to its queue in its place (not counted as a preemption) and resumes elsewhere from
  its checkpoint; its events say which node, its deadline, the checkpoint's step and the steps lost.

A rank's node is what its telemetry says (`RankStatus.node`: "IP (the first 8 hex digits of the Ray node
id)").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from service.cluster import ClusterBackend
from service.contract.errors import ClusterUnavailable, NodeNotFound
from service.store import repository
from service.store.db import Database

logger = logging.getLogger(__name__)

# A rank hears "stop" in the reply to its next telemetry post (trainers.telemetry posts every second).
NOTICE_S = 1.0
# Step and checkpoint times vary: a job is trusted to make the deadline only with this much slack.
SAFETY_FACTOR = 2.0
# Stopping a Ray job takes a few seconds (SIGTERM, then SIGKILL): a job still running this long before
# its node's deadline is stopped.
STOP_MARGIN_S = 5.0
# What a checkpoint write is taken to cost before a job has measured one (CheckpointRecord.write_s).
UNMEASURED_WRITE_S = 30.0


@dataclass(frozen=True, kw_only=True)
class Drain:
    node_id: str
    deadline_at: float | None  # Unix seconds; None: no deadline was given (Ray's own drains may lack one)
    source: str  # "ray", or who told Apiary


def checkpoint_needs_s(*, step_s: float | None, write_s: float | None) -> float | None:
    """How long before its node's deadline a job must hear of the drain to checkpoint at its next step
    boundary and stop in time; None when it has no step time yet (nothing to weigh)."""
    if step_s is None:
        return None
    write = write_s if write_s is not None else UNMEASURED_WRITE_S
    return NOTICE_S + SAFETY_FACTOR * (step_s + write) + STOP_MARGIN_S


def can_checkpoint_before(
    *, now: float, deadline_at: float | None, step_s: float | None, write_s: float | None
) -> bool:
    """Whether a job on a node that goes at `deadline_at` can still checkpoint there first. A job without
    a step time cannot be judged: it has done no step since it (re)started, so stopping it loses nothing."""
    if deadline_at is None:
        return True
    needs_s = checkpoint_needs_s(step_s=step_s, write_s=write_s)
    return needs_s is not None and deadline_at - now >= needs_s


def merge(ray: Mapping[str, float | None], told: Iterable[Drain]) -> dict[str, Drain]:
    """Ray's drains and those told to Apiary, one per node: the earliest deadline wins (the one told to
    Apiary, which passes it on to Ray, when they are the same)."""
    drains = {node_id: Drain(node_id=node_id, deadline_at=at, source="ray") for node_id, at in ray.items()}
    for drain in told:
        known = drains.get(drain.node_id)
        if known is None or (
            drain.deadline_at is not None
            and (known.deadline_at is None or drain.deadline_at <= known.deadline_at)
        ):
            drains[drain.node_id] = drain
    return drains


def drained_node(ranks: Mapping[str, Any] | None, drains: Mapping[str, Drain]) -> Drain | None:
    """The drain of a node a job has a rank on (the earliest deadline), or None."""
    found = []
    for rank in (ranks or {}).values():
        node = str(rank.get("node", ""))
        prefix = node.rsplit("(", 1)[-1].rstrip(")") if "(" in node else ""
        if prefix:
            found += [drain for node_id, drain in drains.items() if node_id.startswith(prefix)]
    return min(
        found, key=lambda d: d.deadline_at if d.deadline_at is not None else float("inf"), default=None
    )


def clock(timestamp: float | None) -> str:
    return (
        datetime.fromtimestamp(timestamp, UTC).strftime("%H:%M:%S UTC") if timestamp is not None else "none"
    )


class DrainService:
    """What `POST /admin/nodes/{id}/drain` asks of the domain."""

    def __init__(self, *, db: Database, backend: ClusterBackend) -> None:
        self.db = db
        self.backend = backend

    def drain(self, node_id: str, *, deadline_s: float, reason: str, by: str) -> tuple[Drain, str | None]:
        """Record that an alive node goes in `deadline_s` and ask Ray to drain it; returns the drain
        (the earlier deadline, if it was told before) and why Ray was not asked or refused (None: Ray
        drains it too). NodeNotFound for a node the cluster does not list alive."""
        if node_id not in {node.node_id for node in self.backend.snapshot().nodes}:
            raise NodeNotFound(f"the Ray cluster has no alive node {node_id}")
        deadline_at = time.time() + deadline_s
        with self.db.session() as session:
            row = repository.add_node_drain(
                session,
                node_id=node_id,
                deadline_at=datetime.fromtimestamp(deadline_at, UTC),
                reason=reason,
                requested_by=by,
            )
            drain = Drain(node_id=node_id, deadline_at=_time(row.deadline_at), source=row.requested_by)
        try:
            refused = self.backend.drain_node(
                node_id, deadline_at=drain.deadline_at or deadline_at, reason=reason
            )
        except ClusterUnavailable as err:
            refused = str(err)
        logger.warning(
            "node %s drains by %s (told by %s)%s",
            node_id,
            clock(drain.deadline_at),
            by,
            f"; Ray was not asked to drain it: {refused}" if refused else "",
            extra={"action": "node_drain", "node": {"id": node_id, "deadline_at": drain.deadline_at}},
        )
        return drain, refused


def _time(value: datetime) -> float:
    return (value if value.tzinfo is not None else value.replace(tzinfo=UTC)).timestamp()
