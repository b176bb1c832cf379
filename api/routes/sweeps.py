"""Sweeps (service.sweeps): search a job's config with trials that are ordinary jobs, stop the losers
early, keep the winner."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status

from api.deps import OWNER_RESPONSES, CurrentUser, JobsDep, SchedulerDep, SweepsDep
from api.limits import JobId
from api.schemas import JobPublic, SweepPublic, SweepsPublic, error_responses
from service.contract.spec import MAX_INT, JobSpec, Queue
from service.contract.sweep import SweepSpec

router = APIRouter(tags=["sweeps"])

SweepId = Annotated[int, Path(ge=1, le=MAX_INT, description="The sweep's id.")]


@router.post(
    "/sweeps",
    status_code=status.HTTP_201_CREATED,
    response_model=SweepPublic,
    responses=error_responses(400, 403, 422),
)
def create_sweep(
    spec: SweepSpec, sweeps: SweepsDep, user: CurrentUser, scheduler: SchedulerDep
) -> SweepPublic:
    """Start a sweep: its base spec is checked as any job's (422 naming `base.<field>`); its trials
    are queued on the scheduler's next passes, at most `parallel` at once."""
    sweep = sweeps.create(spec, by=user)
    scheduler.wake()
    return SweepPublic.build(sweeps.view(sweep.id))


@router.get("/sweeps", response_model=SweepsPublic, responses=error_responses(422))
def list_sweeps(sweeps: SweepsDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> SweepsPublic:
    """The newest sweeps, with their trials."""
    views = [sweeps.view(sweep.id) for sweep in sweeps.list(limit=limit)]
    return SweepsPublic(data=[SweepPublic.build(view) for view in views], count=len(views))


@router.get("/sweeps/{sweep_id}", response_model=SweepPublic, responses=error_responses(404, 422))
def get_sweep(sweep_id: SweepId, sweeps: SweepsDep) -> SweepPublic:
    """A sweep: its state, its trials (state, point, objective, steps) and its best trial."""
    return SweepPublic.build(sweeps.view(sweep_id))


@router.post(
    "/sweeps/{sweep_id}/cancel",
    response_model=SweepPublic,
    responses={**OWNER_RESPONSES, **error_responses(404, 409, 422)},
)
def cancel_sweep(sweep_id: SweepId, sweeps: SweepsDep, user: CurrentUser) -> SweepPublic:
    """Cancel the sweep and its unfinished trials: its owner or an admin. 409 if it already ended."""
    sweeps.cancel(sweep_id, by=user)
    return SweepPublic.build(sweeps.view(sweep_id))


@router.get("/sweeps/{sweep_id}/best", response_model=JobSpec, responses=error_responses(404, 409, 422))
def best_spec(sweep_id: SweepId, sweeps: SweepsDep, queue: Queue | None = None) -> JobSpec:
    """The best trial's spec, ready to submit (`queue=full-scale` moves it there). 409 while no trial
    has reported the objective."""
    return sweeps.best_spec(sweep_id, queue=queue)


@router.post(
    "/jobs/{job_id}/resume",
    response_model=JobPublic,
    responses={**OWNER_RESPONSES, **error_responses(404, 409, 422)},
    tags=["jobs"],
)
def resume_job(job_id: JobId, jobs: JobsDep, user: CurrentUser, scheduler: SchedulerDep) -> JobPublic:
    """Queue a pruned trial again: it resumes from its checkpoint. 409 unless it is pruned."""
    job = jobs.resume(job_id, by=user)
    scheduler.wake()
    return JobPublic.build(job)
