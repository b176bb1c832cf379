"""What Apiary measured, as facts for the planner (service.planning.formulas): a job's spec and step time, the
cluster's node count, and the mean time between failures observed over recent jobs.

The planner stays pure; this module reads the database and the cluster for it (`POST /plan`, and the
scheduler's launch of a job with `checkpoint: {auto: true}`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from service.cluster import ClusterBackend
from service.contract.errors import ClusterUnavailable
from service.contract.spec import JobSpec
from service.planning.formulas import HOUR_S, Plan, facts_from_spec, merge_facts, plan
from service.store import repository
from service.store.models import utcnow


@dataclass(frozen=True, kw_only=True)
class ObservedMtbf:
    """A job's mean time between failures as the cluster has shown it, and why that value."""

    mtbf_s: float
    basis: str  # one line a person reads, e.g. "observed: 3 failures in 72.0 job-hours"


def observed_mtbf(
    session: Session,
    *,
    default_s: float,
    now: datetime | None = None,
    spot_nodes: int = 0,
    spot_prior_per_node_h: float = 0.0,
) -> ObservedMtbf:
    """Job-hours run per failure over recent jobs; `default_s` while no failure has been seen. A job on
    `spot_nodes` spot nodes also fails when one of them is taken back: their interruption rate
    (`observed_spot_rate`) adds to its failure rate, so its MTBF is 1 / (1 / base + n x rate)."""
    failures, running_s = repository.failure_history(session, now=now or utcnow())
    hours = running_s / HOUR_S
    if failures == 0 or running_s <= 0:
        base = ObservedMtbf(
            mtbf_s=default_s,
            basis=f"default {default_s / HOUR_S:g} h: no failure observed in {hours:.1f} job-hours",
        )
    else:
        base = ObservedMtbf(
            mtbf_s=running_s / failures, basis=f"observed: {failures} failure(s) in {hours:.1f} job-hours"
        )
    if spot_nodes <= 0:
        return base
    spot = observed_spot_rate(session, prior_per_node_h=spot_prior_per_node_h)
    per_s = 1 / base.mtbf_s + spot_nodes * spot.per_node_h / HOUR_S
    return ObservedMtbf(
        mtbf_s=1 / per_s,
        basis=f"{base.basis}; on {spot_nodes} spot node(s) at {spot.per_node_h:.3g} interruptions per "
        f"node-hour ({spot.basis})",
    )


@dataclass(frozen=True, kw_only=True)
class SpotRate:
    """How often a spot node is taken back, as observed (or the stated prior until one is)."""

    per_node_h: float
    interruptions: int
    node_hours: float
    basis: str  # e.g. "observed: 2 interruption(s) in 40.0 spot node-hours"


def observed_spot_rate(session: Session, *, prior_per_node_h: float) -> SpotRate:
    """Interruptions per spot node-hour that the scheduler has seen (`repository.spot_history`); the
    prior (APIARY_SPOT_PRIOR_INTERRUPTIONS_PER_NODE_H) until an interruption is observed."""
    interruptions, seen_s = repository.spot_history(session)
    hours = seen_s / HOUR_S
    if interruptions == 0 or hours <= 0:
        return SpotRate(
            per_node_h=prior_per_node_h,
            interruptions=interruptions,
            node_hours=hours,
            basis=f"prior: no interruption observed in {hours:.1f} spot node-hours",
        )
    return SpotRate(
        per_node_h=interruptions / hours,
        interruptions=interruptions,
        node_hours=hours,
        basis=f"observed: {interruptions} interruption(s) in {hours:.1f} spot node-hours",
    )


def measured_plan(
    session: Session,
    *,
    backend: ClusterBackend,
    default_mtbf_s: float,
    facts: dict[str, Any],
    spec: JobSpec | None = None,
    job_id: int | None = None,
) -> tuple[Plan, dict[str, str]]:
    """The plan of `facts` over what Apiary knows: the cluster (nodes, observed MTBF), then the spec
    (or the job's spec), then the job's measured step time, then `facts` (which win). ValueError for a
    bad fact; JobNotFound for an unknown job."""
    layers: list[tuple[str, dict[str, Any]]] = []
    with contextlib.suppress(ClusterUnavailable):  # the plan goes on without the node count
        layers.append(("cluster", {"nodes": len(backend.snapshot().nodes)}))
    mtbf = observed_mtbf(session, default_s=default_mtbf_s)
    layers.append((f"cluster ({mtbf.basis})", {"mtbf_s": mtbf.mtbf_s}))
    measured: dict[str, Any] = {}
    if job_id is not None:
        job = repository.get_job(session, job_id)
        spec = spec or JobSpec.model_validate(job.spec)
        measured = {"step_time_s": job.seconds_per_step}
    if spec is not None:
        layers.append(("spec" if job_id is None else f"job {job_id} spec", facts_from_spec(spec)))
    layers += [(f"job {job_id} measured", measured), ("request", facts)]
    merged, sources = merge_facts(*layers)
    return plan(merged), sources
