"""Admission policy: a pure function from (cluster, queued, active, now) to decisions.

No I/O here. The scheduler loop (service/scheduler.py) reads the database and
the cluster, calls `decide`, and carries the decisions out; a simulator can call
the same function on a trace.

Glossary:
- gang: a job's whole worker group (`num_workers` bundles of
  `resources_per_worker`) plus its `extra` (Ray Data's CPUs). It is admitted all
  at once or not at all.
- elastic gang: a job with `num_workers: {min, max}` (Ray Train's elastic
  training). Admission needs only its MIN gang to fit: waiting for max would
  hold a job back that can already train. Once active it is counted at its MAX
  (as many of its extra workers as still fit, placed after every fixed
  part): Ray Train grows the group whenever capacity is free and never shrinks
  it for another job, so capacity an elastic job may take is not promised to a
  queued one. An elastic job therefore never makes an admitted job wait in Ray,
  at the price of leaving capacity idle while the elastic job has not grown.
- capacity: each alive node's total schedulable resources. Free capacity is
  capacity minus the gangs of active (admitted or running) jobs, placed
  first-fit node by node, so a gang that fits the cluster's sum but no node
  layout is not admitted.

The policy is strict priority order (priority, then age) over one line: when
the head of the line does not fit, everything behind it waits, so a big job is
never starved by a stream of small ones. It reads neither the queue nor the
time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

EPSILON = 1e-9


@dataclass(frozen=True, kw_only=True)
class NodeCapacity:
    node_id: str
    resources: Mapping[str, float]


@dataclass(frozen=True, kw_only=True)
class ClusterSnapshot:
    nodes: tuple[NodeCapacity, ...]


@dataclass(frozen=True, kw_only=True)
class Gang:
    job_id: int
    queue: str
    priority: int
    num_workers: int  # the workers admission needs: a fixed group's size, an elastic group's min
    per_worker: Mapping[str, float]
    extra: Mapping[str, float] = field(default_factory=dict)
    max_workers: int | None = None  # an elastic group's max; None = fixed at num_workers

    def bundles(self) -> list[Mapping[str, float]]:
        """What admission must place: `num_workers` workers and the extra."""
        bundles = [self.per_worker] * self.num_workers
        return [*bundles, self.extra] if any(self.extra.values()) else bundles

    def growth(self) -> list[Mapping[str, float]]:
        """The workers an elastic gang may add beyond `num_workers` (none for a fixed gang)."""
        return [self.per_worker] * max(0, (self.max_workers or 0) - self.num_workers)

    def total(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for bundle in self.bundles():
            for key, amount in bundle.items():
                total[key] = total.get(key, 0.0) + amount
        return total


@dataclass(frozen=True, kw_only=True)
class Decisions:
    admit: tuple[int, ...]
    waiting: Mapping[int, str]  # job id -> why it waits


def decide(
    *,
    cluster: ClusterSnapshot,
    queued: Sequence[Gang],
    active: Sequence[Gang],
    now: float,
) -> Decisions:
    """Admit queued gangs, in the given order, while each fits the free capacity."""
    del now  # the order does not depend on time; the loop and a simulator pass it all the same
    free = [dict(node.resources) for node in cluster.nodes]
    for gang in active:
        # Active gangs were admitted when they fitted; place them as Ray would have (best effort).
        _place(free, gang.bundles(), allow_partial=True)
    for gang in active:
        # What elastic gangs may grow into is not free for queued gangs (glossary: elastic gang).
        _place(free, gang.growth(), allow_partial=True)
    admitted: list[int] = []
    waiting: dict[int, str] = {}
    blocked_by: Gang | None = None
    for position, gang in enumerate(queued):
        if blocked_by is not None:
            waiting[gang.job_id] = (
                f"waiting behind job {blocked_by.job_id} (higher priority or older); {position} job(s) ahead"
            )
            continue
        if _place(free, gang.bundles(), allow_partial=False):
            admitted.append(gang.job_id)
            continue
        blocked_by = gang
        waiting[gang.job_id] = f"needs {_fmt(gang.total())}; free now {_fmt(_sum(free))}"
    return Decisions(admit=tuple(admitted), waiting=waiting)


def fits_empty_cluster(cluster: ClusterSnapshot, gang: Gang) -> bool:
    """Could this gang ever run here, with nothing else running?"""
    return _place([dict(node.resources) for node in cluster.nodes], gang.bundles(), allow_partial=False)


def capacity_text(cluster: ClusterSnapshot) -> str:
    return f"{len(cluster.nodes)} node(s) with {_fmt(_sum([dict(n.resources) for n in cluster.nodes]))}"


def _place(
    free: list[dict[str, float]], bundles: Sequence[Mapping[str, float]], *, allow_partial: bool
) -> bool:
    """First-fit every bundle; on failure undo (unless partial placement is allowed)."""
    taken: list[tuple[int, Mapping[str, float]]] = []
    for bundle in bundles:
        node_index = next((i for i, node in enumerate(free) if _fits(node, bundle)), None)
        if node_index is None:
            if allow_partial:
                continue
            for index, undo in taken:
                for key, amount in undo.items():
                    free[index][key] += amount
            return False
        for key, amount in bundle.items():
            free[node_index][key] = free[node_index].get(key, 0.0) - amount
        taken.append((node_index, bundle))
    return True


def _fits(node: Mapping[str, float], bundle: Mapping[str, float]) -> bool:
    return all(node.get(key, 0.0) + EPSILON >= amount for key, amount in bundle.items() if amount > 0)


def _sum(nodes: Sequence[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for node in nodes:
        for key, amount in node.items():
            total[key] = total.get(key, 0.0) + amount
    return total


def _fmt(resources: Mapping[str, float]) -> str:
    parts = [f"{amount:g} {key}" for key, amount in sorted(resources.items()) if abs(amount) > EPSILON]
    return ", ".join(parts) or "nothing"
