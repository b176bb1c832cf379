"""The share-first policy: research first within its guaranteed share, greedy for everything else.

What held on every trace of the suite (benchmarks/traces, issue 27) with one configuration:

1. Research first, within its share. Research jobs, in queue order (priority, then submission), start
   whenever they fit and keep research within its guaranteed share (`QueuesConfig.research.share`).
2. Reclaim at the victim's next checkpoint. A research job within the share that does not fit,
   while full-scale borrows research's share, gets room from full-scale jobs that have run their
   `min_runtime_s` (a young job is protected) and are not larger than full-scale's share: they are
   told to stop at their next periodic checkpoint (`Preemption.at_checkpoint`), so they lose only
   their restart. The fewest GPUs that make the head fit are chosen (on one node for a one-worker
   job), and jobs already stopping count as room: a head preempts once.
3. Greedy for everything else. Then every other waiting job starts as soon as it fits (no head of
   line blocks): research beyond its share first, then full-scale, each in submission order.
4. Best-fit placement: each worker goes to the fullest node it fits on, keeping whole nodes free
   for large gangs.
5. A full-scale job larger than full-scale's share that has waited `reserve_after_s` (4 h) gets a
   reservation: the earliest time it fits from the running jobs' expected ends; nothing that would
   eat into it starts (a job that fits the leftover or is expected to end before it may), and no
   further preemption is made while it waits.

No I/O here; the simulator calls it in simulated time (`apiary simulate --policy share-first`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.capacity import EPSILON, ClusterSnapshot, Gang, Resources, fits, place_at, release, sum_resources
from service.contract.queues import DEFAULT_QUEUES, QueuesConfig
from service.scheduling.policy import Decisions, Preemption, Wait, expected_runtime_s


@dataclass(frozen=True, kw_only=True)
class ShareFirst:
    """The one configuration (the queues file gives the share and the minimum run)."""

    reserve_after_s: float = 4 * 3600.0
    # The greedy pass takes research jobs (beyond the share) before full-scale ones.
    research_first: bool = True


SHARE_FIRST = ShareFirst()


def best_fit(free: list[dict[str, float]], bundles: Sequence[Resources]) -> list[tuple[int, Resources]]:
    """Place every bundle on the fullest node it fits on (`free` shrinks); [] and `free` untouched
    when the gang does not fit whole."""
    taken: list[tuple[int, Resources]] = []
    for bundle in bundles:
        best, best_key = None, None
        for index, node in enumerate(free):
            if fits(node, bundle):
                rank = (node.get("GPU", 0.0), node.get("CPU", 0.0))
                if best_key is None or rank < best_key:
                    best, best_key = index, rank
        if best is None:
            release(free, taken)
            return []
        for key, amount in bundle.items():
            free[best][key] = free[best].get(key, 0.0) - amount
        taken.append((best, bundle))
    return taken


def _fits_whole(free: list[dict[str, float]], bundles: Sequence[Resources]) -> bool:
    placed = best_fit(free, bundles)
    release(free, placed)
    return bool(placed) or not bundles


def decide_share_first(
    *,
    cluster: ClusterSnapshot,
    queued: Sequence[Gang],
    active: Sequence[Gang],
    now: float,
    queues: QueuesConfig = DEFAULT_QUEUES,
    config: ShareFirst = SHARE_FIRST,
    **_: object,
) -> Decisions:
    """The module docstring's rules."""
    free = [node.free() for node in cluster.nodes]
    totals = sum_resources(free)
    share = {
        q: {k: v * queues.of(q).share_of(k) for k, v in totals.items()} for q in ("research", "full-scale")
    }
    used: dict[str, dict[str, float]] = {"research": {}, "full-scale": {}}
    placed_active: dict[int, list[tuple[int, Resources]]] = {}
    for gang in active:
        if gang.placement is not None:
            placed_active[gang.job_id] = place_at(free, gang.bundles(), gang.placement)
        else:
            placed_active[gang.job_id] = best_fit(free, gang.bundles()) or []
        for key, amount in gang.totals.items():
            used[gang.queue][key] = used[gang.queue].get(key, 0.0) + amount

    def within(queue: str, gang: Gang) -> bool:
        return all(
            used[queue].get(key, 0.0) + amount <= share[queue].get(key, 0.0) + EPSILON
            for key, amount in gang.totals.items()
            if amount > 0
        )

    def larger_than_share(gang: Gang) -> bool:
        return any(amount > share[gang.queue].get(key, 0.0) + EPSILON for key, amount in gang.totals.items())

    admitted: list[int] = []
    placements: dict[int, tuple[int, ...]] = {}
    preempt: list[Preemption] = []
    order = sorted(queued, key=lambda gang: (-gang.priority, gang.submitted_at, gang.job_id))

    # 5. The reservation of an oversize full-scale job that has waited long enough (the oldest).
    reserved: tuple[Gang, float | None, list[dict[str, float]] | None] | None = None
    for gang in order:
        if (
            gang.queue == "full-scale"
            and now - gang.submitted_at >= config.reserve_after_s
            and larger_than_share(gang)
        ):
            reserved = (gang, *_reserve(gang, free, active, placed_active, now=now))
            break

    def start(gang: Gang) -> bool:
        if reserved is not None and reserved[0].job_id != gang.job_id:
            _, at, leftover = reserved
            runtime = expected_runtime_s(gang)
            ends_before = at is not None and runtime is not None and now + runtime <= at
            if not ends_before:
                if leftover is None or not _fits_whole(leftover, gang.bundles()):
                    return False
                best_fit(leftover, gang.bundles())
        placed = best_fit(free, gang.bundles())
        if not placed:
            return False
        admitted.append(gang.job_id)
        placements[gang.job_id] = tuple(index for index, _ in placed)
        for key, amount in gang.totals.items():
            used[gang.queue][key] = used[gang.queue].get(key, 0.0) + amount
        return True

    # The oversize job itself goes first once it fits.
    if reserved is not None and _fits_whole(free, reserved[0].bundles()):
        start(reserved[0])
        reserved = None

    # 1-2. Research within its share, reclaiming at the victims' next checkpoints.
    reclaimed = False
    for gang in order:
        if gang.queue != "research" or gang.job_id in placements or not within("research", gang):
            continue
        if start(gang) or reclaimed or reserved is not None:
            continue
        victims = _victims(gang, free, active, placed_active, used, share, queues, now=now)
        reclaimed = True  # one head at a time: the next decision sees the stopping jobs as room
        preempt += [
            Preemption(
                job_id=victim.job_id,
                for_job=gang.job_id,
                reason=f"preempted for job {gang.job_id}: research takes back its share (next checkpoint)",
                at_checkpoint=True,
            )
            for victim in victims
        ]

    # 3. Greedy for everything else, in submission order.
    failed: set[int] = set()
    free_total = sum_resources(free)
    rank = (lambda gang: gang.queue != "research") if config.research_first else (lambda gang: False)
    for gang in sorted(order, key=lambda gang: (rank(gang), gang.submitted_at, gang.job_id)):
        if gang.job_id in placements or gang.shape in failed:
            continue
        if fits(free_total, gang.totals) and start(gang):
            free_total = sum_resources(free)
        elif reserved is None:
            failed.add(gang.shape)  # free capacity only shrinks: this shape will not fit again
    waiting = {
        gang.job_id: Wait(position, "waiting for room (share-first)", None)
        for position, gang in enumerate((g for g in order if g.job_id not in placements), start=1)
    }
    return Decisions(admit=tuple(admitted), preempt=tuple(preempt), waiting=waiting, placements=placements)


def _reserve(
    gang: Gang,
    free: list[dict[str, float]],
    active: Sequence[Gang],
    placed: Mapping[int, list[tuple[int, Resources]]],
    *,
    now: float,
) -> tuple[float | None, list[dict[str, float]] | None]:
    """The earliest expected time `gang` fits, and what is free then beyond it."""
    room = [dict(node) for node in free]
    if _fits_whole(room, gang.bundles()):
        best_fit(room, gang.bundles())
        return now, room
    ends = sorted(
        (g.stops_at if g.stopping and g.stops_at is not None else g.expected_end_at, g.job_id)
        for g in active
        if (g.stops_at if g.stopping and g.stops_at is not None else g.expected_end_at) is not None
    )
    for at, job_id in ends:
        release(room, placed[job_id])
        if _fits_whole(room, gang.bundles()):
            best_fit(room, gang.bundles())
            return max(now, at or now), room
    return None, None


def _victims(
    head: Gang,
    free: list[dict[str, float]],
    active: Sequence[Gang],
    placed: Mapping[int, list[tuple[int, Resources]]],
    used: Mapping[str, Mapping[str, float]],
    share: Mapping[str, Mapping[str, float]],
    queues: QueuesConfig,
    *,
    now: float,
) -> list[Gang]:
    """The full-scale jobs to stop at their next checkpoint so that `head` fits; [] if none can."""
    room = [dict(node) for node in free]
    stopping = [gang for gang in active if gang.stopping]
    for gang in stopping:
        release(room, placed[gang.job_id])
    if _fits_whole(room, head.bundles()):
        return []  # room is already being made
    fs_share = share["full-scale"]
    if not any(amount > fs_share.get(key, 0.0) + EPSILON for key, amount in used["full-scale"].items()):
        return []  # full-scale holds only its own share
    min_run_s = queues.of("full-scale").min_runtime_s
    candidates = sorted(
        (
            gang
            for gang in active
            if gang.queue == "full-scale"
            and not gang.stopping
            and gang.started_at is not None
            and now - gang.started_at >= max(min_run_s, EPSILON)
            and gang.priority <= head.priority
            and not any(amount > fs_share.get(key, 0.0) + EPSILON for key, amount in gang.totals.items())
        ),
        key=lambda gang: (
            gang.totals.get("GPU", 0.0),
            gang.totals.get("CPU", 0.0),
            -(gang.started_at or 0.0),
        ),
    )
    chosen: list[Gang] = []
    left = dict(used["full-scale"])
    for gang in candidates:
        if not any(amount > fs_share.get(key, 0.0) + EPSILON for key, amount in left.items()):
            break
        chosen.append(gang)
        release(room, placed[gang.job_id])
        for key, amount in gang.totals.items():
            left[key] = left.get(key, 0.0) - amount
        if _fits_whole(room, head.bundles()):
            return _fewest(head, chosen, free, stopping, placed)
    return []


def _fewest(
    head: Gang,
    chosen: list[Gang],
    free: list[dict[str, float]],
    stopping: Sequence[Gang],
    placed: Mapping[int, list[tuple[int, Resources]]],
) -> list[Gang]:
    """Drop from `chosen` (smallest first) every victim the head does not need."""
    needed = list(chosen)
    for gang in sorted(chosen, key=lambda g: -g.totals.get("GPU", 0.0)):
        trial = [g for g in needed if g.job_id != gang.job_id]
        room = [dict(node) for node in free]
        for other in [*stopping, *trial]:
            release(room, placed[other.job_id])
        if _fits_whole(room, head.bundles()):
            needed = trial
    return needed
