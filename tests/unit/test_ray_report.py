"""Ray's load report as the service reads it (`service.cluster`), on reports shaped as Ray 2.60's
dashboard returns them (`/api/cluster_status`, its keys camelCased)."""

from __future__ import annotations

from ray.util.state.common import NodeState

from service.cluster import _node_used, _pending_demand, _report_keys


def node(node_id: str, ip: str) -> NodeState:
    return NodeState(
        node_id=node_id,
        node_ip=ip,
        is_head_node=False,
        state="ALIVE",
        state_message=None,
        node_name=ip,
        resources_total={},
        labels={},
    )


def test_a_report_keyed_by_ip_is_read_where_the_ip_is_one_nodes() -> None:
    nodes = [node("a", "10.0.0.1"), node("b", "10.0.0.2"), node("c", "10.0.0.2")]
    report = {"usageByNode": {"10.0.0.1": {"CPU": [3.0, 8.0]}, "10.0.0.2": {"CPU": [1.0, 8.0]}}}
    assert _report_keys(nodes, report) == {"a": {"CPU": [3.0, 8.0]}}  # b and c share an IP: unknown
    by_id = {"usageByNode": {"b": {"CPU": [1.0, 8.0]}}}
    assert _report_keys(nodes, by_id) == {"b": {"CPU": [1.0, 8.0]}}
    assert _report_keys(nodes, {}) == {}


def test_resource_names_are_matched_through_the_dashboards_camel_case() -> None:
    entry = {"CPU": [2.0, 8.0], "tpu_v4": [9.0, 9.0], "shardSlots": [1.0, 4.0], "CPUGroupAbc": [1.0, 2.0]}
    total = {"CPU": 8.0, "shard_slots": 4.0, "GPU": 1.0}
    assert _node_used(total, entry) == {"CPU": 2.0, "shard_slots": 1.0, "GPU": 0.0}
    assert _node_used(total, None) is None


def test_pending_demand_is_text_for_people() -> None:
    report = {
        "resourceDemand": [[{"CPU": 50.0}, 2]],
        "pgDemand": [[{"bundles": [[{"CPU": 100.0}, 1]], "strategy": "STRICT_SPREAD"}, 1]],
        "requestDemand": [[{"GPU": 1.0}, 3]],
        "usage": {},
    }
    assert _pending_demand(report) == (
        "2 task(s)/actor(s) of 50 CPU",
        "1 placement group(s) STRICT_SPREAD of [1 x 100 CPU]",
        "3 request(s) (request_resources) of 1 GPU",
    )
    assert _pending_demand({}) == ()
