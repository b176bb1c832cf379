"""The two-queue scheduling policy: a pure function from (cluster, queued, active, now) to decisions.

No I/O here. The scheduler loop (service/scheduling/scheduler.py) reads the database and the cluster, calls
`decide`, and carries the decisions out; the simulator (service/scheduling/simulate.py) calls the same
function
in simulated time. `fifo` and `greedy` are the baselines the simulator compares it with.

Glossary:
- gang: a job's whole worker group (`num_workers` bundles of `per_worker`) plus its `extra` (Ray
  Data's CPUs). It is admitted all at once or not at all.
- elastic gang: a job with `num_workers: {min, max}`. Admission needs only its MIN gang; once active
  it also holds what it may grow into (its extra workers, placed after every fixed part), since Ray
  Train grows the group whenever capacity is free and never shrinks it for another job.
- capacity: each alive node's schedulable resources. Active gangs (admitted, running or stopping)
  are placed first-fit node by node; what is left, less what other Ray users hold, is free. A gang
  that fits the cluster's sum but no node layout does not fit.
- foreign use: what Ray reports in use (`NodeCapacity.used`) that Apiary's active gangs do not
  explain: other users' actors, tasks and placement groups on a shared cluster. Per resource, the
  cluster holds `max(0, used - what the active gangs may hold)` of it (an elastic gang counts with
  its growth; Ray Data's tasks of a job stay within its `extra`); it is laid on the nodes where Ray's
  use exceeds what the active gangs hold there as placed above. A gang admitted but not placed by
  Ray yet only makes the foreign use look smaller for a moment, never larger; a gang that has just
  ended may look foreign until Ray's next report (seconds). A snapshot without `used` has none.
- spot: a node may be a spot node (`NodeCapacity.spot`). A gang of a `spot: never` job is placed on
  on-demand nodes only, one of a `preferred` job on spot nodes first; both through marks in each node's
  capacity (service.capacity.MARKS), so every rule below places them as admission does. The marks
  count in no share.
- share: a queue's guaranteed fraction of each resource of the cluster (`service.contract.queues`). A queue
  whose active gangs together exceed its share on some resource is borrowing.
- head: the first job of a queue, in queue order, that cannot start now.
- reservation: the earliest time a head's gang fits, from the active jobs' expected ends (a
  stopping job ends within `preempt_grace_s`); what is free then beyond the head's gang is its
  leftover.
- lost work: the seconds a job has run since its last checkpoint (since its start without one).

Rules, in the order they apply:
0. Deferral (service.scheduling.deferral): a deferrable job whose cheapest window of the price signal
   has not begun waits outside its queue's line (it neither heads nor reserves); once its window
   begins, or its last start has come, it is in the line like any other job. Without a signal
   (`Deferral.signal` None) nothing is deferred and the reasons say why.
1. Order within a queue: priority (higher first), then submission time delayed by the owner's decayed
   usage (fair share: of two jobs submitted together, the owner who used less goes first; usage is in
   cluster-seconds, so an owner who held the whole cluster for an hour waits an hour longer), then job
   id. A pure "least usage first" order would starve a heavy owner while lighter owners keep
   submitting; as a delay it stays bounded.
2. Guaranteed starts. Queue by queue (full-scale first, then research), jobs start in queue order
   while each fits the free capacity, keeps its queue within its share and respects the
   reservations that bind it (rule 5). The first that does not is the queue's head; the jobs behind
   it wait for rule 5.
3. Reclaim. A head that would be within its queue's share but does not fit, while the other queue
   borrows, and would otherwise wait longer than its queue's `reclaim_after_s` for running jobs to
   end, gets room by preemption: the other queue's running jobs are told to checkpoint and stop
   (running -> preempting -> queued), least lost work first, until the head fits. Never a job that
   has run less than its queue's `min_runtime_s`, never one of higher priority than the head, never
   a job larger than its own queue's share (it can run only on borrowed capacity: preempting it for
   that capacity would thrash), and only while the other queue still borrows. Jobs already stopping
   count as free for this, so a head preempts once, not at every tick. No victim is chosen unless
   the victims together make the head fit.
4. Reservation. Each head reserves the earliest time its gang fits (a head that fits now but waits
   for the other queue's reservation reserves nothing).
5. Backfill and borrowing. Then, queue by queue again, every job not yet started, in queue order,
   starts if it fits the free capacity now and, for every reservation that binds it, either ends
   before it (its `max_runtime_s` runs out first) or fits in that reservation's leftover. A head's
   reservation binds the jobs behind it in its queue and every job that would take its queue past
   its share (borrowing never delays a head). A job within its own queue's share is bound by a head
   of the other queue only when that head is larger than its queue's whole share: such a job can
   only ever run on borrowed capacity, and without this the other queue's steady stream would never
   leave it room (the other queue backfills around it instead). A job that would take its queue
   past its share needs the queue's `may_borrow`.
6. Every job left waiting gets its position in its queue (1 = next), a reason a person understands,
   and an ETA: its reservation for a head; for the others an estimate from a walk through the
   active jobs' expected ends in queue order (capacity summed over nodes; None when nothing known
   ends, or beyond the first `ETA_HORIZON` jobs of a queue).

`Rules` switches off the protections of rules 3 and 4 one by one (all on in production); the
simulator's benchmark shows what each is worth.

Invariants: decisions never over-commit a node (admissions are placed on the free capacity left by
active gangs and by earlier admissions of the same call); a job is admitted at most once; the same
inputs give the same decisions.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from service.capacity import (
    EPSILON,
    MARKS,
    ON_DEMAND_NODE,
    ClusterSnapshot,
    Gang,
    Resources,
    add,
    can_place,
    fits,
    format_resources,
    place,
    place_at,
    release,
    slots,
    subtract,
    sum_resources,
    take_foreign,
)
from service.contract.queues import DEFAULT_QUEUES, QueuesConfig
from service.scheduling.deferral import Deferral, Window, cheapest_window, window_text

QUEUE_ORDER = ("full-scale", "research")
# ETAs are estimated for this many waiting jobs of each queue; the rest get None.
ETA_HORIZON = 200


class Wait(NamedTuple):
    position: int  # in its queue, 1 = next
    reason: str
    eta: float | None  # unix seconds


@dataclass(frozen=True, kw_only=True)
class Preemption:
    job_id: int
    for_job: int
    reason: str
    # True: the victim stops at its next periodic checkpoint (it loses nothing but the restart);
    # False: it checkpoints at its next step boundary and stops.
    at_checkpoint: bool = False


@dataclass(frozen=True, kw_only=True)
class Reservation:
    job_id: int
    at: float | None  # None: no active job is known to end (or the gang does not fit the cluster)


@dataclass(frozen=True, kw_only=True)
class Decisions:
    admit: tuple[int, ...] = ()
    preempt: tuple[Preemption, ...] = ()
    reserve: tuple[Reservation, ...] = ()
    waiting: Mapping[int, Wait] = field(default_factory=dict)
    foreign: Mapping[str, float] = field(default_factory=dict)  # what other Ray users hold (glossary)
    # Where each admitted gang was placed: a node index of the snapshot per bundle of `Gang.bundles()`.
    placements: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    # Why an admitted deferrable job starts now (rule 0), for the event of its admission.
    deferral_notes: Mapping[int, str] = field(default_factory=dict)
    # When each job that waits for its cheaper window (rule 0) sees it begin (the simulator wakes then).
    deferred_until: Mapping[int, float] = field(default_factory=dict)


Policy = Callable[..., Decisions]


@dataclass(frozen=True, kw_only=True)
class Rules:
    """The protections, each of which can be switched off to measure what it is worth."""

    # Rule 3: a job larger than its own queue's share is never a victim.
    protect_larger_than_share: bool = True
    # Rule 3: victims must have run `min_runtime_s` and go least lost work first (else youngest first).
    respect_runtime_and_checkpoints: bool = True
    # Rule 4: heads reserve; without it, jobs behind a head start whenever they fit (greedy backfill).
    reservations: bool = True


RULES = Rules()


# ---------------------------------------------------------------------------------------------------
# The two-queue policy
# ---------------------------------------------------------------------------------------------------


def decide(
    *,
    cluster: ClusterSnapshot,
    queued: Sequence[Gang],
    active: Sequence[Gang],
    now: float,
    queues: QueuesConfig = DEFAULT_QUEUES,
    usage: Mapping[str, float] | None = None,
    rules: Rules = RULES,
    explain: bool = True,
    deferral: Deferral | None = None,
) -> Decisions:
    """The module docstring's rules. `usage` is each owner's decayed usage (fair share); without
    `explain`, rule 6 is skipped (`waiting` stays empty: the simulator needs no reasons); without
    `deferral`, rule 0 is."""
    deferred: dict[int, tuple[Gang, Window]] = {}
    deferral_notes: dict[int, str] = {}
    if deferral is not None:
        queued, deferred, deferral_notes = _defer(queued, deferral, now=now)
    state = _State.build(cluster, active, now=now, queues=queues, rules=rules)
    configs = {queue: queues.of(queue) for queue in QUEUE_ORDER}
    delay = (usage or {}).get
    lines: dict[str, list[Gang]] = {queue: [] for queue in QUEUE_ORDER}
    for gang in queued:
        lines[gang.queue].append(gang)
    for line in lines.values():
        line.sort(key=lambda gang: (-gang.priority, gang.submitted_at + delay(gang.owner, 0.0), gang.job_id))
    admitted: list[int] = []
    started: set[int] = set()
    notes: dict[int, str] = {}
    awaiting_room: set[int] = set()  # heads whose room is being made by preemption
    preemptions: list[Preemption] = []
    reservations: list[_Reserved] = []

    def start(gang: Gang, binding: Sequence[_Reserved]) -> None:
        nonlocal reservations
        for reserved in binding:
            if not _ends_before(gang, reserved.at, now=now):
                reserved.take(gang)
        reservations = [reserved for reserved in reservations if reserved.gang.job_id != gang.job_id]
        state.admit(gang, now=now)
        admitted.append(gang.job_id)
        started.add(gang.job_id)
        notes.pop(gang.job_id, None)

    # 2-4. Queue by queue (full-scale first): guaranteed starts until the head, which reclaims its
    # share and reserves; the next queue's starts respect that reservation.
    for queue, line in lines.items():
        for gang in line:
            within = state.within_share(gang)
            binding = _binding(gang, within_share=within, reservations=reservations)
            blocking = _blocking(gang, binding, now=now)
            if within and blocking is None and state.fits(gang):
                start(gang, binding)
                continue
            # A head that fits now but waits for another queue's reservation reserves nothing itself.
            reserved = None if blocking is not None and state.fits(gang) else state.reserve(gang, now=now)
            natural_wait_s = (
                reserved.at - now if reserved is not None and reserved.at is not None else math.inf
            )
            if within and natural_wait_s > configs[queue].reclaim_after_s:
                victims, note = state.reclaim_for(gang, now=now)
                preemptions += victims
                if note:
                    notes[gang.job_id] = note
                if victims or note.startswith("waiting for"):
                    awaiting_room.add(gang.job_id)
            if rules.reservations and reserved is not None:
                reserved.oversize = state.larger_than_share(gang)
                reservations.append(reserved)
            break

    # 5. Backfill and borrowing, behind the heads.
    shapes = {gang.shape for gang in queued}
    for queue, line in lines.items():
        for gang in line:
            if shapes <= state.failed_shapes:
                break  # no waiting job fits any more (free capacity only shrinks)
            if gang.job_id in started or gang.job_id in awaiting_room or not state.fits(gang):
                continue
            within = state.within_share(gang)
            if not within and not configs[queue].may_borrow:
                notes[gang.job_id] = state.at_share_text(gang)
                continue
            binding = _binding(gang, within_share=within, reservations=reservations)
            blocking = _blocking(gang, binding, now=now)
            if blocking is not None:
                notes[gang.job_id] = (
                    f"would run past job {blocking.gang.job_id}'s reservation at {_clock(blocking.at)} "
                    f"(a max_runtime_s that ends before it lets it start now)"
                )
                continue
            start(gang, binding)

    notes.update(
        (job_id, f"{notes[job_id]}; {note}" if job_id in notes else note)
        for job_id, note in deferral_notes.items()
        if job_id not in started
    )
    waiting = (
        _explain(lines, started=started, notes=notes, reservations=reservations, state=state, now=now)
        if explain
        else {}
    )
    if explain and deferred:
        waiting.update(_explain_deferred(deferred, lines=lines, started=started, now=now))
    return Decisions(
        admit=tuple(admitted),
        preempt=tuple(preemptions),
        reserve=tuple(Reservation(job_id=r.gang.job_id, at=r.at) for r in reservations),
        waiting=waiting,
        foreign=state.foreign_total,
        placements=state.placements,
        deferral_notes={job_id: deferral_notes[job_id] for job_id in admitted if job_id in deferral_notes},
        deferred_until={job_id: window.start_at for job_id, (_, window) in deferred.items()},
    )


@dataclass
class _Reserved:
    gang: Gang
    at: float | None
    leftover: list[dict[str, float]] | None  # free per node at `at` beyond the head's gang
    oversize: bool = False  # the head is larger than its queue's share: it binds the other queue too

    def take(self, gang: Gang) -> None:
        assert self.leftover is not None  # _blocking checked that it fits
        place(self.leftover, gang.bundles(), allow_partial=False)


def _defer(
    queued: Sequence[Gang], deferral: Deferral, *, now: float
) -> tuple[list[Gang], dict[int, tuple[Gang, Window]], dict[int, str]]:
    """Rule 0: the jobs that wait for their window, apart; the rest stay queued, a deferrable one with a
    note (its window or its last start has come, or it is not deferred for want of a signal or a
    duration) that its waiting reason, or the event of its admission, carries."""
    line: list[Gang] = []
    deferred: dict[int, tuple[Gang, Window]] = {}
    notes: dict[int, str] = {}
    for gang in queued:
        if gang.deadline is None:
            line.append(gang)
            continue
        duration_s = gang.max_runtime_s if gang.max_runtime_s is not None else gang.estimated_runtime_s
        window = None
        if deferral.signal is None:
            notes[gang.job_id] = f"not deferred: {deferral.unavailable or 'no price signal'}"
        elif duration_s is None:
            notes[gang.job_id] = "not deferred: its duration is unknown (no max_runtime_s, no history)"
        else:
            window = cheapest_window(
                deferral.signal,
                now=now,
                duration_s=duration_s,
                deadline=gang.deadline,
                margin_s=deferral.margin_s + deferral.expected_wait_s.get(gang.queue, 0.0),
            )
        if window is not None and window.start_at > now:
            deferred[gang.job_id] = (gang, window)
            continue
        line.append(gang)
        if deferral.signal is not None and duration_s is not None:
            notes[gang.job_id] = (
                "deferrable: its last start has come"
                if window is None
                else "deferrable: its cheaper window has come"
            )
    return line, deferred, notes


def _explain_deferred(
    deferred: Mapping[int, tuple[Gang, Window]],
    *,
    lines: Mapping[str, Sequence[Gang]],
    started: set[int],
    now: float,
) -> dict[int, Wait]:
    """Deferred jobs come after their queue's waiting line, soonest window first; their ETA is the
    window's start."""
    behind = {queue: sum(gang.job_id not in started for gang in line) for queue, line in lines.items()}
    result: dict[int, Wait] = {}
    for gang, window in sorted(deferred.values(), key=lambda item: (item[1].start_at, item[0].job_id)):
        behind[gang.queue] = behind.get(gang.queue, 0) + 1
        result[gang.job_id] = Wait(behind[gang.queue], window_text(window, now=now), window.start_at)
    return result


def expected_runtime_s(gang: Gang) -> float | None:
    """How long a gang is expected to hold its resources once started: history's estimate (never
    beyond its declared `max_runtime_s`), else that limit, else unknown."""
    return gang.estimated_runtime_s if gang.estimated_runtime_s is not None else gang.max_runtime_s


def _ends_before(gang: Gang, at: float | None, *, now: float) -> bool:
    return at is not None and gang.max_runtime_s is not None and now + gang.max_runtime_s <= at + EPSILON


def _binding(gang: Gang, *, within_share: bool, reservations: Sequence[_Reserved]) -> list[_Reserved]:
    """The reservations that `gang` must respect (rule 5)."""
    return [
        reserved
        for reserved in reservations
        if reserved.gang.job_id != gang.job_id
        and (reserved.gang.queue == gang.queue or not within_share or reserved.oversize)
    ]


def _blocking(gang: Gang, reservations: Sequence[_Reserved], *, now: float) -> _Reserved | None:
    """The first reservation that `gang`, started now, would eat into; None if it may start."""
    for reserved in reservations:
        if _ends_before(gang, reserved.at, now=now):
            continue
        if reserved.leftover is None or not can_place(reserved.leftover, gang.bundles()):
            return reserved
    return None


@dataclass
class _Active:
    gang: Gang
    placed: list[tuple[int, Resources]]  # (node index, bundle)
    end_at: float | None


@dataclass
class _State:
    """The cluster as the policy fills it: free capacity per node, and each queue's usage."""

    free: list[dict[str, float]]
    free_total: dict[str, float]
    totals: dict[str, float]
    shares: dict[str, dict[str, float]]
    active: list[_Active]
    used: dict[str, dict[str, float]]
    queues: QueuesConfig
    rules: Rules = RULES
    failed_shapes: set[int] = field(default_factory=set)
    foreign_total: dict[str, float] = field(default_factory=dict)  # held by other Ray users
    placements: dict[int, tuple[int, ...]] = field(default_factory=dict)  # of the gangs admitted
    # (queue, shape) -> within the queue's share; a queue's entries go when its usage changes.
    within: dict[tuple[str, int], bool] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        cluster: ClusterSnapshot,
        active: Sequence[Gang],
        *,
        now: float,
        queues: QueuesConfig,
        rules: Rules = RULES,
    ) -> _State:
        free = [node.free() for node in cluster.nodes]
        totals = sum_resources(free)
        shares = {
            # The spot marks (service.capacity.MARKS) are where a gang may go, not an amount to share.
            queue: {
                key: total * (1.0 if key in MARKS else queues.of(queue).share_of(key))
                for key, total in totals.items()
            }
            for queue in QUEUE_ORDER
        }
        state = cls(
            free=free,
            free_total={},
            totals=totals,
            shares=shares,
            active=[],
            used={queue: {} for queue in QUEUE_ORDER},
            queues=queues,
            rules=rules,
        )
        hints: dict[tuple[tuple[str, float], ...], int] = {}
        for gang in active:
            if gang.placement is not None:
                placed = place_at(state.free, gang.bundles(), gang.placement)
            else:
                # Admitted when it fitted; placed as Ray would have (best effort).
                placed = place(state.free, gang.bundles(), allow_partial=True, hints=hints)
            end_at = gang.expected_end_at
            if gang.stopping and gang.stops_at is not None:
                end_at = gang.stops_at
            elif gang.stopping:
                end_at = (
                    min(end_at, now + queues.preempt_grace_s)
                    if end_at is not None
                    else now + queues.preempt_grace_s
                )
            state.active.append(_Active(gang=gang, placed=placed, end_at=end_at))
            add(state.used.setdefault(gang.queue, {}), gang.totals)
        for entry in state.active:
            # What elastic gangs may grow into is not free for queued gangs (glossary: elastic gang).
            entry.placed += place(state.free, entry.gang.growth(), allow_partial=True, hints=hints)
        state.foreign_total = take_foreign(cluster.nodes, state.free, active)
        state.free_total = sum_resources(state.free)
        return state

    # -- capacity ----------------------------------------------------------------------------------

    def fits(self, gang: Gang) -> bool:
        if gang.shape in self.failed_shapes:
            return False
        if not fits(self.free_total, gang.totals) or not can_place(self.free, gang.bundles()):
            # Free capacity only shrinks within one call: this shape will not fit again.
            self.failed_shapes.add(gang.shape)
            return False
        return True

    def admit(self, gang: Gang, *, now: float) -> None:
        placed = place(self.free, gang.bundles(), allow_partial=False)
        self.placements[gang.job_id] = tuple(index for index, _ in placed)
        runtime_s = expected_runtime_s(gang)
        end_at = now + runtime_s if runtime_s is not None else None
        self.active.append(_Active(gang=replace(gang, started_at=now), placed=placed, end_at=end_at))
        add(self.used.setdefault(gang.queue, {}), gang.totals)
        subtract(self.free_total, gang.totals)
        self.within = {key: value for key, value in self.within.items() if key[0] != gang.queue}

    # -- shares ------------------------------------------------------------------------------------

    def share(self, queue: str) -> dict[str, float]:
        return self.shares.get(queue, {})

    def within_share(self, gang: Gang) -> bool:
        cached = self.within.get((gang.queue, gang.shape))
        if cached is not None:
            return cached
        share, used = self.share(gang.queue), self.used.get(gang.queue, {})
        result = all(
            used.get(key, 0.0) + amount <= share.get(key, 0.0) + EPSILON
            for key, amount in gang.totals.items()
            if amount > 0
        )
        self.within[(gang.queue, gang.shape)] = result
        return result

    def borrowing(self, queue: str) -> bool:
        share, used = self.share(queue), self.used.get(queue, {})
        return any(amount > share.get(key, 0.0) + EPSILON for key, amount in used.items())

    def larger_than_share(self, gang: Gang) -> bool:
        share = self.share(gang.queue)
        return any(
            amount > share.get(key, 0.0) + EPSILON for key, amount in gang.totals.items() if amount > 0
        )

    def at_share_text(self, gang: Gang) -> str:
        share, used = self.share(gang.queue), self.used.get(gang.queue, {})
        return (
            f"queue {gang.queue} uses {format_resources(used)} of its share {format_resources(share)}; "
            f"this job needs {format_resources(gang.total())} more and the queue may not borrow"
        )

    # -- 3. reclaim --------------------------------------------------------------------------------

    def reclaim_for(self, head: Gang, *, now: float) -> tuple[list[Preemption], str]:
        """Preemptions that make `head` fit (rule 3), and a note for its waiting reason."""
        other = next(queue for queue in QUEUE_ORDER if queue != head.queue)
        if self.fits(head) or not self.borrowing(other):
            return [], ""
        room = _Room(self.free, self.free_total, head)
        stopping = [entry for entry in self.active if entry.gang.stopping]
        for entry in stopping:
            room.release(entry.placed)
        if stopping and room.fits():
            ids = ", ".join(str(entry.gang.job_id) for entry in stopping)
            return [], f"waiting for job(s) {ids} to checkpoint and stop (preempted to make room)"
        careful = self.rules.respect_runtime_and_checkpoints
        min_runtime_s = self.queues.of(other).min_runtime_s if careful else 0.0
        candidates = sorted(
            (
                entry
                for entry in self.active
                if entry.gang.queue == other
                and not entry.gang.stopping
                and entry.gang.started_at is not None
                # A job that started in this very pass has lost nothing yet and gained nothing either:
                # preempting it could only ping-pong.
                and now - entry.gang.started_at >= max(min_runtime_s, EPSILON)
                and entry.gang.priority <= head.priority
                and not (self.rules.protect_larger_than_share and self.larger_than_share(entry.gang))
            ),
            key=lambda entry: (
                entry.gang.lost_work_s(now) if careful else 0.0,
                -(entry.gang.started_at or 0.0),
                entry.gang.job_id,
            ),
        )
        used = dict(self.used.get(other, {}))
        share = self.share(other)
        chosen: list[_Active] = []
        for entry in candidates:
            if not any(used.get(key, 0.0) > share.get(key, 0.0) + EPSILON for key in used):
                break  # the other queue is back within its share: what it holds now is its own
            chosen.append(entry)
            room.release(entry.placed)
            subtract(used, entry.gang.totals)
            if room.fits():
                reason = f"preempted for job {head.job_id}: queue {head.queue} takes back its share"
                victims = [
                    Preemption(job_id=e.gang.job_id, for_job=head.job_id, reason=reason) for e in chosen
                ]
                ids = ", ".join(str(e.gang.job_id) for e in chosen)
                return victims, f"preempting job(s) {ids} to make room; it starts when they have stopped"
        return [], self._unreclaimable_text(head, other, now=now)

    def _unreclaimable_text(self, head: Gang, other: str, *, now: float) -> str:
        protected = [
            entry.gang.job_id
            for entry in self.active
            if entry.gang.queue == other
            and entry.gang.started_at is not None
            and self.larger_than_share(entry.gang)
        ]
        young = [
            entry.gang.job_id
            for entry in self.active
            if entry.gang.queue == other
            and (
                entry.gang.started_at is None
                or now - entry.gang.started_at < self.queues.of(other).min_runtime_s
            )
        ]
        parts = [f"queue {other} borrows capacity of queue {head.queue}, but preempting cannot make room now"]
        if protected:
            parts.append(
                f"job(s) {_ids(protected)} are larger than their queue's share and are not preempted"
            )
        if young:
            parts.append(f"job(s) {_ids(young)} have not run their minimum runtime")
        return "; ".join(parts)

    # -- 4. reservations ---------------------------------------------------------------------------

    def reserve(self, head: Gang, *, now: float) -> _Reserved:
        """The earliest time `head` fits, walking through the active jobs' expected ends."""
        room = _Room(self.free, self.free_total, head)
        at: float | None = now if room.fits() else None
        if at is None:
            for entry in sorted(
                (entry for entry in self.active if entry.end_at is not None), key=lambda e: e.end_at or 0.0
            ):
                room.release(entry.placed)
                if room.fits():
                    at = max(now, entry.end_at or now)
                    break
        if at is None:
            return _Reserved(gang=head, at=None, leftover=None)
        place(room.free, head.bundles(), allow_partial=False)
        return _Reserved(gang=head, at=at, leftover=room.free)


class _Room:
    """A copy of the free capacity, to ask whether one gang fits as capacity is released.

    It keeps the capacity summed over nodes and how many of the gang's workers each node could take,
    so that most "does it fit yet?" questions are answered without trying a placement.
    """

    def __init__(self, free: Sequence[Resources], free_total: Resources, gang: Gang) -> None:
        self.free = [dict(node) for node in free]
        self.total = dict(free_total)
        self.gang = gang
        self.bundles = gang.bundles()
        self.slots = [slots(node, gang.per_worker) for node in self.free]
        self.total_slots = sum(self.slots)

    def release(self, placed: Sequence[tuple[int, Resources]]) -> None:
        release(self.free, placed)
        for _, bundle in placed:
            add(self.total, bundle)
        for index in {index for index, _ in placed}:
            self.total_slots -= self.slots[index]
            self.slots[index] = slots(self.free[index], self.gang.per_worker)
            self.total_slots += self.slots[index]

    def fits(self) -> bool:
        return (
            self.total_slots >= self.gang.num_workers
            and fits(self.total, self.gang.totals)
            and can_place(self.free, self.bundles)
        )


# ---------------------------------------------------------------------------------------------------
# 6. Positions, reasons and ETAs
# ---------------------------------------------------------------------------------------------------


def _explain(
    lines: Mapping[str, Sequence[Gang]],
    *,
    started: set[int],
    notes: Mapping[int, str],
    reservations: Sequence[_Reserved],
    state: _State,
    now: float,
) -> dict[int, Wait]:
    """Position, reason and ETA of every job left waiting (rule 6)."""
    reserved_at = {reserved.gang.job_id: reserved.at for reserved in reservations}
    etas = _estimate_etas(lines, started=started, state=state, now=now)
    free_text = format_resources(state.free_total)
    if state.foreign_total:
        free_text += f" (other Ray users hold {format_resources(state.foreign_total)})"
    waiting: dict[int, Wait] = {}
    for queue, line in lines.items():
        waiting_line = [gang for gang in line if gang.job_id not in started]
        if not waiting_line:
            continue
        # The first job still waiting is the queue's head now (the rule-2 head may have started).
        head = waiting_line[0]
        at = reserved_at[head.job_id] if head.job_id in reserved_at else state.reserve(head, now=now).at
        reason = f"needs {_gang_text(head)}; free now {_free_for(head, state, free_text)}; " + (
            f"reserved from {_clock(at)}" if at is not None else "no running job is known to end"
        )
        behind = f"waiting behind job {head.job_id} (head of queue {queue})"
        eta, make = etas.get, tuple.__new__  # Wait(...) without its Python-level __new__: 10,000 of them
        waiting.update(
            (gang.job_id, make(Wait, (position, behind, eta(gang.job_id))))
            for position, gang in enumerate(waiting_line[1:], start=2)
        )
        waiting[head.job_id] = Wait(1, reason, at)
    for job_id, note in notes.items():
        if job_id in waiting:
            position, reason, at = waiting[job_id]
            waiting[job_id] = Wait(position, f"{reason}; {note}", at)
    return waiting


def _estimate_etas(
    lines: Mapping[str, Sequence[Gang]], *, started: set[int], state: _State, now: float
) -> dict[int, float | None]:
    """Start times in queue order against capacity summed over nodes, releasing as jobs end."""
    free = sum_resources(state.free)
    ends: list[tuple[float, int, dict[str, float]]] = [
        (entry.end_at, index, entry.gang.total())
        for index, entry in enumerate(state.active)
        if entry.end_at is not None
    ]
    heapq.heapify(ends)
    counter = itertools.count(len(state.active))  # after every index above: ties never compare dicts
    etas: dict[int, float | None] = {}
    clock = now
    waiting = [[gang for gang in line if gang.job_id not in started][:ETA_HORIZON] for line in lines.values()]
    for gang in itertools.chain.from_iterable(waiting):
        need = gang.total()
        while not fits(free, need) and ends:
            at, _, releases = heapq.heappop(ends)
            clock = max(clock, at)
            add(free, releases)
        if not fits(free, need):
            etas[gang.job_id] = None
            continue
        etas[gang.job_id] = clock
        subtract(free, need)
        runtime_s = expected_runtime_s(gang)
        if runtime_s is not None:
            heapq.heappush(ends, (clock + runtime_s, next(counter), need))
    return etas


# ---------------------------------------------------------------------------------------------------
# Baselines for the simulator: one line in submission order
# ---------------------------------------------------------------------------------------------------


def decide_fifo(
    *, cluster: ClusterSnapshot, queued: Sequence[Gang], active: Sequence[Gang], now: float, **_: object
) -> Decisions:
    """One line in submission order; the head blocks everything behind it."""
    return _one_line(cluster, queued, active, strict=True)


def decide_greedy(
    *, cluster: ClusterSnapshot, queued: Sequence[Gang], active: Sequence[Gang], now: float, **_: object
) -> Decisions:
    """One line in submission order; any job that fits starts (first-fit)."""
    return _one_line(cluster, queued, active, strict=False)


def _one_line(
    cluster: ClusterSnapshot, queued: Sequence[Gang], active: Sequence[Gang], *, strict: bool
) -> Decisions:
    free = [node.free() for node in cluster.nodes]
    for gang in active:
        if gang.placement is not None:
            place_at(free, gang.bundles(), gang.placement)
        else:
            place(free, gang.bundles(), allow_partial=True)
    take_foreign(cluster.nodes, free, active)
    free_total = sum_resources(free)
    admitted: list[int] = []
    placements: dict[int, tuple[int, ...]] = {}
    waiting: dict[int, Wait] = {}
    failed: set[int] = set()
    blocked = False
    for gang in sorted(queued, key=lambda gang: (gang.submitted_at, gang.job_id)):
        fits_now = not blocked and gang.shape not in failed and fits(free_total, gang.totals)
        placed = place(free, gang.bundles(), allow_partial=False) if fits_now else []
        if placed:
            subtract(free_total, gang.totals)
            admitted.append(gang.job_id)
            placements[gang.job_id] = tuple(index for index, _ in placed)
            continue
        failed.add(gang.shape)
        blocked = strict
        waiting[gang.job_id] = Wait(position=len(waiting) + 1, reason="does not fit now", eta=None)
    return Decisions(admit=tuple(admitted), waiting=waiting, placements=placements)


POLICIES: dict[str, Policy] = {"two-queue": decide, "fifo": decide_fifo, "greedy": decide_greedy}


# ---------------------------------------------------------------------------------------------------
# Fair share and messages
# ---------------------------------------------------------------------------------------------------


def decayed_usage(usage: float, *, rate: float, elapsed_s: float, half_life_s: float) -> float:
    """An owner's fair-share usage `elapsed_s` later: what it had halves every `half_life_s`, and it
    adds its rate (the dominant share of the cluster it holds, `dominant_share`) times the time."""
    return usage * math.pow(0.5, elapsed_s / half_life_s) + rate * elapsed_s


def dominant_share(gang: Gang, totals: Resources) -> float:
    """The largest fraction of any one resource of the cluster that the gang holds."""
    return max((amount / totals[key] for key, amount in gang.totals.items() if totals.get(key)), default=0.0)


def _gang_text(gang: Gang) -> str:
    text = f"{gang.num_workers} worker(s) x {format_resources(gang.per_worker)}"
    if ON_DEMAND_NODE in gang.per_worker:
        text += " on on-demand nodes (spot: never)"
    return f"{text} + {format_resources(gang.extra)}" if any(gang.extra.values()) else text


def _free_for(gang: Gang, state: _State, free_text: str) -> str:
    """What is free for `gang`: a `never` gang sees the on-demand nodes only."""
    if ON_DEMAND_NODE not in gang.per_worker:
        return free_text
    on_demand = sum_resources(free for free in state.free if free.get(ON_DEMAND_NODE, 0.0) > 0)
    return f"{format_resources(on_demand)} on on-demand nodes ({free_text} in all)"


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(str(job_id) for job_id in ids)


def _clock(at: float | None) -> str:
    if at is None:
        return "an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
