"""Capacity arithmetic: resources, nodes, cluster snapshots, gangs and their placement on nodes.

Pure and shared by the policy (`service.scheduling.policy`), the cluster reader (`service.cluster`), the
simulator and the job service. Kueue keeps the same in `pkg/cache`. The glossary of these words
(gang, elastic gang, capacity, foreign use) is the policy's module docstring.

Placement is first-fit, node by node, in the snapshot's node order; a gang that does not fit whole is
not placed at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from service.contract.spec import JobSpec, Placement, SpotUse

EPSILON = 1e-9

# Spot (docs/spot-and-cheaper-hours.md): every node's free capacity carries one of two marks, as a
# resource no bundle can run out of, so that the placement arithmetic keeps a `never` gang off spot
# nodes (its workers ask for the on-demand mark) with no other change; a `preferred` worker carries
# PREFER_SPOT (amount 0: asks for nothing) and `place` tries the spot nodes first for it. The marks
# never reach Ray, the totals people read (`format_resources`), or a share.
SPOT_NODE = "apiary:spot-node"
ON_DEMAND_NODE = "apiary:on-demand-node"
PREFER_SPOT = "apiary:prefer-spot"
MARKS = frozenset({SPOT_NODE, ON_DEMAND_NODE, PREFER_SPOT})
_MARK_AMOUNT = 1e12

Resources = Mapping[str, float]


class SpreadBundle(dict[str, float]):
    """A worker of a gang whose workers each need a node of their own (spec placement strict_spread):
    the copies of one such bundle in a gang are placed on distinct nodes."""


# Every gang shape seen by this process, numbered (Gang.shape): cheap keys for the policy's memos.
_SHAPES: dict[tuple[object, ...], int] = {}


@dataclass(frozen=True, kw_only=True)
class NodeCapacity:
    node_id: str
    resources: Resources
    # What Ray reports in use on the node, by anyone (Apiary's own jobs included); None: not known,
    # and then capacity is the total less Apiary's own gangs (glossary: foreign use).
    used: Resources | None = None
    spot: bool = False  # a spot node: it may be taken back, with a notice (labelled spot=true)

    def free(self) -> dict[str, float]:
        """The node's capacity as the placement arithmetic starts from it: its resources and its mark."""
        return {**self.resources, SPOT_NODE if self.spot else ON_DEMAND_NODE: _MARK_AMOUNT}


@dataclass(frozen=True, kw_only=True)
class ClusterSnapshot:
    nodes: tuple[NodeCapacity, ...]
    # What Ray reports it cannot place yet (tasks, actors, placement groups: anyone's, Apiary's own
    # too, which is why the policy does not count it), as text for the log and for people.
    pending: tuple[str, ...] = ()
    # Nodes Ray reports dead, with its message of why (node id, message): how a spot node left.
    departed: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Gang:
    """A job as the policy sees it. The fields after `max_runtime_s` describe an active job."""

    job_id: int
    queue: str
    priority: int
    num_workers: int  # the workers admission needs: a fixed group's size, an elastic group's min
    per_worker: Resources
    extra: Resources = field(default_factory=dict)
    max_workers: int | None = None  # an elastic group's max; None = fixed at num_workers
    owner: str = ""
    submitted_at: float = 0.0
    max_runtime_s: float | None = None
    started_at: float | None = None  # None: not started (queued, or admitted and not running yet)
    last_checkpoint_at: float | None = None
    expected_end_at: float | None = None  # when it will release its resources; None = unknown
    stopping: bool = False  # told to checkpoint and stop
    stops_at: float | None = None  # a stopping job's known stop time (its next periodic checkpoint)
    # Where its bundles are (a node index of the snapshot per bundle of `bundles()`); None: unknown,
    # the policy places it first-fit. The simulator keeps placements, so nothing is re-placed for free.
    placement: tuple[int, ...] | None = None
    # A queued job's expected duration from history (`service.scheduling.estimates`); None = unknown.
    estimated_runtime_s: float | None = None
    # A deferrable job's deadline (unix seconds): it may wait for cheaper hours (service.scheduling.deferral).
    deadline: float | None = None

    def bundles(self) -> list[Resources]:
        """What admission must place: `num_workers` workers and the extra."""
        bundles = [self.per_worker] * self.num_workers
        return [*bundles, self.extra] if any(self.extra.values()) else bundles

    def growth(self) -> list[Resources]:
        """The workers an elastic gang may add beyond `num_workers` (none for a fixed gang)."""
        return [self.per_worker] * max(0, (self.max_workers or 0) - self.num_workers)

    @cached_property
    def totals(self) -> dict[str, float]:
        """What the gang holds at once (read-only: shared by every caller)."""
        return sum_resources(self.bundles())

    def total(self) -> dict[str, float]:
        return dict(self.totals)

    @cached_property
    def shape(self) -> int:
        """Gangs of one shape fit or not alike: a small number per distinct (workers, sizes)."""
        key = (
            tuple(sorted(self.per_worker.items())),
            self.num_workers,
            tuple(sorted(self.extra.items())),
            isinstance(self.per_worker, SpreadBundle),
        )
        return _SHAPES.setdefault(key, len(_SHAPES))

    def lost_work_s(self, now: float) -> float:
        since = self.last_checkpoint_at if self.last_checkpoint_at is not None else self.started_at
        return max(0.0, now - since) if since is not None else 0.0


def fits_empty_cluster(cluster: ClusterSnapshot, gang: Gang) -> bool:
    """Could this gang ever run here, with nothing else running?"""
    return can_place([node.free() for node in cluster.nodes], gang.bundles())


def capacity_text(cluster: ClusterSnapshot) -> str:
    resources = sum_resources([dict(node.resources) for node in cluster.nodes])
    text = f"{len(cluster.nodes)} node(s) with {format_resources(resources)}"
    spot = [node for node in cluster.nodes if node.spot]
    if spot:
        spot_resources = sum_resources([dict(node.resources) for node in spot])
        text += f", of which {len(spot)} spot node(s) with {format_resources(spot_resources)}"
    return text


def spot_capacity(cluster: ClusterSnapshot) -> dict[str, float]:
    """What the spot nodes hold, summed (their total, not what is free)."""
    return sum_resources([dict(node.resources) for node in cluster.nodes if node.spot])


def take_foreign(
    nodes: Sequence[NodeCapacity], free: list[dict[str, float]], active: Sequence[Gang]
) -> dict[str, float]:
    """Take what other Ray users hold off `free` (each node's capacity after Apiary's active gangs were
    placed on it); returns the cluster's sum of it (glossary: foreign use). Without every node's
    `used`, nothing: a gang's own placement on a node that Ray has not reported could look foreign."""
    if not nodes or any(node.used is None for node in nodes):
        return {}
    used = [
        {key: min(max(0.0, node.used.get(key, 0.0)), total) for key, total in node.resources.items()}
        for node in nodes
        if node.used is not None
    ]
    claimed = sum_resources(
        itertools.chain.from_iterable([*gang.bundles(), *gang.growth()] for gang in active)
    )
    foreign = {key: max(0.0, amount - claimed.get(key, 0.0)) for key, amount in sum_resources(used).items()}
    # Ray's use beyond what the gangs hold on each node as placed: where the foreign use can be.
    excess = [
        {
            key: max(0.0, amount - (node.resources[key] - node_free.get(key, 0.0)))
            for key, amount in node_used.items()
        }
        for node, node_free, node_used in zip(nodes, free, used, strict=True)
    ]
    excess_total = sum_resources(excess)
    taken: dict[str, float] = {}
    for node_free, node_excess in zip(free, excess, strict=True):
        for key, amount in node_excess.items():
            if amount <= EPSILON or foreign[key] <= EPSILON:
                continue
            # Never more than Ray's use beyond Apiary's there, so a node's free never goes below zero.
            share = amount * min(1.0, foreign[key] / excess_total[key])
            node_free[key] = node_free.get(key, 0.0) - share
            taken[key] = taken.get(key, 0.0) + share
    return {key: amount for key, amount in taken.items() if amount > EPSILON}


def place(
    free: list[dict[str, float]],
    bundles: Iterable[Resources],
    *,
    allow_partial: bool,
    hints: dict[tuple[tuple[str, float], ...], int] | None = None,
) -> list[tuple[int, Resources]]:
    """First-fit every bundle onto `free` (which shrinks); returns where each went.

    Without `allow_partial`, a gang that does not fit whole leaves `free` as it was and returns [].
    `hints` remembers, per bundle shape, the first node that took one: no node before it can take
    another while `free` only shrinks (pass the same dict only across such placements).
    """
    taken: list[tuple[int, Resources]] = []
    first: dict[int, int] = {}  # id of a bundle object -> where the last of its copies went
    spot_first: list[int] | None = None  # node indices, spot nodes first (for PREFER_SPOT bundles)
    for bundle in bundles:
        shape = tuple(bundle.items()) if hints is not None else ()
        after = first.get(id(bundle))
        # The next copy of a bundle goes on the node of the last one or later; a spread one, later.
        start = 0 if after is None else after + isinstance(bundle, SpreadBundle)
        if PREFER_SPOT in bundle:
            # The same rule in the order spot nodes first; `first` then holds positions in that order.
            if spot_first is None:
                spot_first = sorted(range(len(free)), key=lambda i: free[i].get(SPOT_NODE, 0.0) <= 0)
            order = spot_first
            position = next((p for p in range(start, len(free)) if fits(free[order[p]], bundle)), None)
            node_index = order[position] if position is not None else None
        else:  # the hot path: node order
            if hints is not None:
                start = max(start, hints.get(shape, 0))
            position = node_index = next((i for i in range(start, len(free)) if fits(free[i], bundle)), None)
        if position is None or node_index is None:
            if allow_partial:
                continue
            release(free, taken)
            return []
        for key, amount in bundle.items():
            free[node_index][key] = free[node_index].get(key, 0.0) - amount
        taken.append((node_index, bundle))
        first[id(bundle)] = position
        if hints is not None and PREFER_SPOT not in bundle:
            hints[shape] = node_index
    return taken


def place_at(
    free: list[dict[str, float]], bundles: Sequence[Resources], nodes: Sequence[int]
) -> list[tuple[int, Resources]]:
    """Take `bundles` off `free` where they are known to be (`nodes`, one index per bundle)."""
    taken = list(zip(nodes, bundles, strict=True))
    for index, bundle in taken:
        for key, amount in bundle.items():
            free[index][key] = free[index].get(key, 0.0) - amount
    return taken


def can_place(free: list[dict[str, float]], bundles: Sequence[Resources]) -> bool:
    placed = place(free, bundles, allow_partial=False)
    release(free, placed)
    return bool(placed) or not bundles


def release(free: list[dict[str, float]], placed: Iterable[tuple[int, Resources]]) -> None:
    for index, bundle in placed:
        for key, amount in bundle.items():
            free[index][key] = free[index].get(key, 0.0) + amount


def fits(node: Resources, bundle: Resources) -> bool:
    for key, amount in bundle.items():  # a loop, not all(): the policy's hottest line  # noqa: SIM110
        if amount > 0 and node.get(key, 0.0) + EPSILON < amount:
            return False
    return True


def slots(node: Resources, bundle: Resources) -> int:
    """How many copies of `bundle` fit on `node`."""
    counts = [int((node.get(key, 0.0) + EPSILON) // amount) for key, amount in bundle.items() if amount > 0]
    return min(counts) if counts else 0


def sum_resources(nodes: Iterable[Resources]) -> dict[str, float]:
    total: dict[str, float] = {}
    for node in nodes:
        add(total, node)
    return total


def add(into: dict[str, float], amounts: Resources) -> None:
    for key, amount in amounts.items():
        into[key] = into.get(key, 0.0) + amount


def subtract(into: dict[str, float], amounts: Resources) -> None:
    for key, amount in amounts.items():
        into[key] = into.get(key, 0.0) - amount


def format_resources(resources: Resources) -> str:
    parts = [
        f"{amount:g} {key}"
        for key, amount in sorted(resources.items())
        if abs(amount) > EPSILON and key not in MARKS
    ]
    return ", ".join(parts) or "nothing"


# What a worker of each kind of job asks of a node's marks (the extra, Ray Data's tasks, goes anywhere:
# Ray's label selector holds the placement group, not the tasks).
_SPOT_MARKS: dict[SpotUse, dict[str, float]] = {
    SpotUse.ALLOWED: {},
    SpotUse.NEVER: {ON_DEMAND_NODE: 1.0},
    SpotUse.PREFERRED: {PREFER_SPOT: 0.0},
}


def gang_for(
    job_id: int, spec: JobSpec, *, data_cpus: float, owner: str = "", submitted_at: float = 0.0
) -> Gang:
    return Gang(
        job_id=job_id,
        queue=spec.queue.value,
        priority=spec.priority,
        # Admission needs the min gang of an elastic job (service.scheduling.policy glossary: elastic gang).
        num_workers=spec.min_workers,
        max_workers=spec.max_workers if spec.is_elastic else None,
        per_worker=(SpreadBundle if spec.placement is Placement.STRICT_SPREAD else dict)(
            {**spec.resources_per_worker, **_SPOT_MARKS[spec.spot_use]}
        ),
        extra={"CPU": data_cpus},
        owner=owner,
        submitted_at=submitted_at,
        max_runtime_s=spec.max_runtime_s,
        deadline=spec.deferrable.deadline(submitted_at) if spec.deferrable is not None else None,
    )
