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


def observed_mtbf(session: Session, *, default_s: float, now: datetime | None = None) -> ObservedMtbf:
    """Job-hours run per failure over recent jobs; `default_s` while no failure has been seen."""
    failures, running_s = repository.failure_history(session, now=now or utcnow())
    hours = running_s / HOUR_S
    if failures == 0 or running_s <= 0:
        return ObservedMtbf(
            mtbf_s=default_s,
            basis=f"default {default_s / HOUR_S:g} h: no failure observed in {hours:.1f} job-hours",
        )
    return ObservedMtbf(
        mtbf_s=running_s / failures, basis=f"observed: {failures} failure(s) in {hours:.1f} job-hours"
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
