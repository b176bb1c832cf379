"""Spot nodes on a real Ray 2.60 (issue 31, point 2): the service reads which nodes are spot from their
labels, and a `never` job's placement group (the label selector `build_scaling_config` gives Ray Train)
goes only to a node without a spot label. No job runs: a placement group shows where Ray puts workers."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from service.cluster import RayBackend, free_port
from service.contract.spec import MARKET_TYPE_LABEL, ON_DEMAND_SELECTOR
from tests.support.processes import run_test_in_own_process

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

# This test's driver joins a cluster of its own: it runs in a process of its own, since the package's
# shared local Ray (tests/ray/conftest.py) keeps this pytest process connected to that one.
OWN_PROCESS_VAR = "APIARY_SPOT_PLACEMENT_OWN_PROCESS"
IN_OWN_PROCESS = os.environ.get(OWN_PROCESS_VAR) == "1"


@pytest.mark.skipif(IN_OWN_PROCESS, reason="this is the process the test runs in")
def test_in_a_process_of_its_own() -> None:
    run_test_in_own_process(
        __file__,
        "test_spot_nodes_are_read_and_a_never_placement_group_avoids_them",
        flag=OWN_PROCESS_VAR,
        timeout_s=280,
    )


@pytest.fixture
def labelled_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Cluster, str, dict[str, str]]]:
    """Three 1-CPU nodes: `spot=true` (the head), Ray's market type `spot` (as KubeRay sets it from
    RAY_NODE_MARKET_TYPE), and one with no mark. Yields the cluster, its dashboard and node ids by name."""
    dashboard_port = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "labels": {"spot": "true"},
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard_port,
        },
    )
    try:
        with monkeypatch.context() as env:
            env.setenv("RAY_NODE_MARKET_TYPE", "spot")
            market = cluster.add_node(num_cpus=1)
        plain = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        ids = {"label": cluster.head_node.node_id, "market": market.node_id, "plain": plain.node_id}
        yield cluster, f"http://127.0.0.1:{dashboard_port}", ids
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.skipif(not IN_OWN_PROCESS, reason="run by test_in_a_process_of_its_own, in its own process")
def test_spot_nodes_are_read_and_a_never_placement_group_avoids_them(
    labelled_cluster: tuple[Cluster, str, dict[str, str]],
) -> None:
    _, dashboard_url, ids = labelled_cluster
    labels = {node["NodeID"]: node["Labels"] for node in ray.nodes()}
    assert labels[ids["market"]].get(MARKET_TYPE_LABEL) == "spot"

    snapshot = RayBackend(dashboard_url).wait_for_nodes()
    spot = {node.node_id: node.spot for node in snapshot.nodes}
    assert spot == {ids["label"]: True, ids["market"]: True, ids["plain"]: False}

    first = placement_group([{"CPU": 1}], bundle_label_selector=[dict(ON_DEMAND_SELECTOR)])
    assert first.wait(30)
    assert placement_group_table(first)["bundles_to_node_id"] == {0: ids["plain"]}
    # The on-demand node is full: a second one waits, though both spot nodes have a free CPU.
    second = placement_group([{"CPU": 1}], bundle_label_selector=[dict(ON_DEMAND_SELECTOR)])
    assert not second.wait(3)
    remove_placement_group(first)
    assert second.wait(30)
    assert placement_group_table(second)["bundles_to_node_id"] == {0: ids["plain"]}
