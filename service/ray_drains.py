"""The door to Ray's node drains, which Ray offers only through its GCS client (a private name).

Checked against ray 2.60.0 (`CHECKED_RAY_VERSION`, the pin in pyproject.toml);
`tests/unit/test_ray_drains.py` fails when Ray is upgraded or one of these names moves:

- `ray._raylet.GcsClient(address=...)`: a plain gRPC client of the cluster's GCS (not a Ray driver:
  nothing runs on the cluster for it), authenticated by the `RAY_AUTH_*` variables that
  `service.cluster.RayBackend` sets;
- `GcsClient.get_draining_nodes(timeout=...)`: `{node id (hex): deadline in Unix ms}` of the nodes that
  are draining (0: no deadline), what Ray Train's preemption watcher polls;
- `GcsClient.drain_node(node_id, reason, reason_message, deadline_timestamp_ms, timeout=...)`: the
  `DrainNode` RPC that `ray drain-node` and the autoscaler send; `(accepted, rejection message)`. A
  `DRAIN_NODE_REASON_PREEMPTION` drain is never refused. Ray then places nothing new there
  (placement groups included) and stops the node by itself once it is idle; killing it at the
  deadline is the caller's business (a cloud does).

Neither the State API nor the dashboard shows a drain (checked on 2.60: the node stays `ALIVE`, its
`stateSnapshot` `ACTIVE`), hence this client.
"""

from __future__ import annotations

import threading
from typing import Any

from service.contract.errors import ClusterUnavailable

CHECKED_RAY_VERSION = "2.60.0"
# Every GCS call is bounded: a GCS that does not answer must not hold up a scheduler tick.
GCS_TIMEOUT_S = 5.0
PREEMPTION = "DRAIN_NODE_REASON_PREEMPTION"


class GcsDrains:
    """Ray's drains of the cluster whose GCS is at `gcs_address` (host:port)."""

    def __init__(self, gcs_address: str) -> None:
        self.gcs_address = gcs_address
        self._client: Any = None
        self._lock = threading.Lock()

    def _gcs(self) -> Any:
        with self._lock:
            if self._client is None:
                from ray._raylet import GcsClient  # type: ignore[attr-defined]

                self._client = GcsClient(address=self.gcs_address)
            return self._client

    def draining(self) -> dict[str, float | None]:
        """Node id -> the Unix time by which it goes (None: Ray was given no deadline)."""
        try:
            found = self._gcs().get_draining_nodes(timeout=GCS_TIMEOUT_S)
        except Exception as err:  # Ray raises its own RpcError, or plain exceptions
            raise ClusterUnavailable(f"cannot read Ray's node drains at {self.gcs_address}: {err}") from err
        return {str(node_id): (ms / 1000 if ms else None) for node_id, ms in dict(found).items()}

    def drain(self, node_id: str, *, deadline_at: float, reason: str) -> str | None:
        """Ask Ray to drain the node (reason: preemption) by `deadline_at`; None when Ray accepted,
        else why not."""
        from ray.core.generated.autoscaler_pb2 import DrainNodeReason  # type: ignore[attr-defined]

        try:
            accepted, rejection = self._gcs().drain_node(
                node_id,
                DrainNodeReason.Value(PREEMPTION),
                reason,
                int(deadline_at * 1000),
                timeout=GCS_TIMEOUT_S,
            )
        except Exception as err:
            raise ClusterUnavailable(
                f"cannot ask Ray at {self.gcs_address} to drain node {node_id}: {err}"
            ) from err
        return None if accepted else str(rejection or "refused")
