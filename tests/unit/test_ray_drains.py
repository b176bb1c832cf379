"""Ray's node-drain API as `service.ray_drains` uses it: fails when Ray moves, renames or reshapes a name.

A test module that may name Ray's private paths (tests/unit/test_layering.py's RAY_DOOR)."""

from __future__ import annotations

import ray
from ray._raylet import GcsClient, InnerGcsClient  # type: ignore[attr-defined]
from ray.core.generated.autoscaler_pb2 import DrainNodeReason  # type: ignore[attr-defined]

from service.ray_drains import CHECKED_RAY_VERSION, PREEMPTION


def test_the_installed_ray_is_the_one_the_drain_door_was_checked_against() -> None:
    assert ray.__version__ == CHECKED_RAY_VERSION, (
        f"ray {ray.__version__} is installed, service/ray_drains.py was checked against "
        f"{CHECKED_RAY_VERSION}: re-read Ray's GcsClient drain calls, then set CHECKED_RAY_VERSION"
    )


def test_the_gcs_client_reads_and_asks_for_drains_with_a_timeout() -> None:
    for name in ("get_draining_nodes", "drain_node"):
        assert hasattr(GcsClient, name) or hasattr(InnerGcsClient, name), name
        signature = str(getattr(InnerGcsClient, name).__doc__ or "")
        assert "timeout" in signature, (name, signature)
    drain_doc = str(InnerGcsClient.drain_node.__doc__)
    # node_id, reason, reason_message, deadline_timestamp_ms: the order service.ray_drains passes them in.
    order = [
        drain_doc.index(word) for word in ("node_id", "reason", "reason_message", "deadline_timestamp_ms")
    ]
    assert order == sorted(order), drain_doc


def test_a_preemption_is_a_drain_reason() -> None:
    assert DrainNodeReason.Value(PREEMPTION) > 0
