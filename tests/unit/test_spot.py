"""Spot as a property of nodes and jobs (issue 31, point 2): `spot: allowed | never | preferred`, and how
admission and placement (`service.capacity`, the policy) and Ray's placement (`build_scaling_config`)
agree on it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from service.capacity import (
    MARKS,
    ClusterSnapshot,
    NodeCapacity,
    capacity_text,
    fits_empty_cluster,
    format_resources,
    gang_for,
    spot_capacity,
)
from service.contract.queues import QueuesConfig
from service.contract.spec import ON_DEMAND_SELECTOR, JobSpec, Queue, SpotUse, is_spot_node
from service.scheduling.policy import decide
from trainers.launch import build_scaling_config

NOW = 1_000_000.0
QUEUES = QueuesConfig.model_validate(
    {"research": {"share": 0.5, "min_runtime_s": 0}, "full-scale": {"share": 0.5, "min_runtime_s": 0}}
)


def node(name: str, cpus: float, *, spot: bool = False) -> NodeCapacity:
    return NodeCapacity(node_id=name, resources={"CPU": cpus}, spot=spot)


def spec(workers: int, cpu: float = 1, **fields: Any) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "s", "trainer": "pkg.mod:fn", "num_workers": workers, "resources_per_worker": {"CPU": cpu}}
        | fields
    )


def admit(nodes: list[NodeCapacity], *specs: JobSpec) -> Any:
    queued = [gang_for(i, s, data_cpus=0, submitted_at=float(i)) for i, s in enumerate(specs, 1)]
    snapshot = ClusterSnapshot(nodes=tuple(nodes))
    return decide(cluster=snapshot, queued=queued, active=[], now=NOW, queues=QUEUES)


def test_the_field_defaults_by_queue_and_refuses_a_bad_value() -> None:
    assert spec(1).spot is None
    assert spec(1).spot_use is SpotUse.ALLOWED
    assert spec(1, queue="full-scale").spot_use is SpotUse.NEVER
    assert spec(1, queue="full-scale", spot="preferred").spot_use is SpotUse.PREFERRED
    assert SpotUse.default_for(Queue.RESEARCH) is SpotUse.ALLOWED
    with pytest.raises(ValidationError) as caught:
        spec(1, spot="sometimes")
    assert caught.value.errors()[0]["loc"] == ("spot",)


def test_a_never_gang_counts_only_on_demand_capacity() -> None:
    nodes = [node("spot", 8, spot=True), node("od", 2)]
    decisions = admit(nodes, spec(4, queue="full-scale"), spec(4, spot="allowed"))
    assert decisions.admit == (2,)  # the allowed job takes the spot node; the never job cannot fit
    assert decisions.placements[2] == (0, 0, 0, 0)
    assert decisions.waiting[1].reason.startswith(
        "needs 4 worker(s) x 1 CPU on on-demand nodes (spot: never); "
        "free now 2 CPU on on-demand nodes (6 CPU in all);"
    )
    # ...and on a cluster of spot nodes only it never fits; an allowed job does.
    only_spot = ClusterSnapshot(nodes=(node("spot", 8, spot=True),))
    assert not fits_empty_cluster(only_spot, gang_for(1, spec(2, spot="never"), data_cpus=0))
    assert fits_empty_cluster(only_spot, gang_for(1, spec(2, spot="allowed"), data_cpus=0))


def test_a_never_gang_is_placed_on_on_demand_nodes_only() -> None:
    nodes = [node("spot-a", 4, spot=True), node("od-a", 2), node("spot-b", 4, spot=True), node("od-b", 2)]
    decisions = admit(nodes, spec(4, spot="never"))
    assert decisions.admit == (1,)
    assert sorted(decisions.placements[1]) == [1, 1, 3, 3]
    spread = admit(nodes, spec(2, spot="never", placement="strict_spread"))
    assert sorted(spread.placements[1]) == [1, 3]


def test_preferred_takes_spot_nodes_first_and_spills_to_on_demand() -> None:
    nodes = [node("od", 4), node("spot", 2, spot=True)]
    decisions = admit(nodes, spec(2, spot="preferred"), spec(1, spot="allowed"))
    assert decisions.placements[1] == (1, 1)  # both workers on the spot node, though it comes second
    assert decisions.placements[2] == (0,)  # allowed: first fit in node order
    spill = admit(nodes, spec(4, spot="preferred"))
    assert sorted(spill.placements[1]) == [0, 0, 1, 1]  # spot full: the rest on on-demand
    spread = admit([node("od", 4), node("spot-a", 1, spot=True), node("spot-b", 1, spot=True)],
                   spec(3, spot="preferred", placement="strict_spread"))  # fmt: skip
    assert sorted(spread.placements[1]) == [0, 1, 2]


def test_the_marks_never_show_in_what_people_read() -> None:
    gang = gang_for(1, spec(2, spot="never"), data_cpus=1)
    assert set(gang.totals) & MARKS
    assert format_resources(gang.totals) == "3 CPU"
    cluster = ClusterSnapshot(nodes=(node("od", 4), node("spot", 8, spot=True)))
    assert capacity_text(cluster) == "2 node(s) with 12 CPU, of which 1 spot node(s) with 8 CPU"
    assert spot_capacity(cluster) == {"CPU": 8}
    waiting = admit([node("od", 1), node("spot", 8, spot=True)], spec(2, spot="never")).waiting[1]
    assert "apiary:" not in waiting.reason


def test_a_node_is_spot_by_its_label_or_its_resource() -> None:
    assert is_spot_node({"spot": "true"}, {"CPU": 4})
    assert is_spot_node({"ray.io/market-type": "spot"}, {})
    assert is_spot_node({}, {"CPU": 4, "spot": 1})
    assert not is_spot_node({"spot": "false", "ray.io/market-type": "on-demand"}, {"CPU": 4})


def test_ray_holds_a_never_job_off_spot_nodes() -> None:
    never = build_scaling_config(spec(2, queue="full-scale"))
    assert never.label_selector == ON_DEMAND_SELECTOR == {"spot": "!true", "ray.io/market-type": "!spot"}
    assert build_scaling_config(spec(2, spot="allowed")).label_selector is None
    assert build_scaling_config(spec(2, spot="preferred")).label_selector is None
