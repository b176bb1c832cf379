"""Public job routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response, status
from fastapi.responses import StreamingResponse

from api.deps import ADMIN_RESPONSES, OWNER_RESPONSES, CurrentUser, JobsDep, RuntimeDep, SchedulerDep
from api.limits import PRINTABLE_PATTERN, JobId
from api.schemas import (
    CheckpointPublic,
    CheckpointsPublic,
    ErrorPublic,
    EventPublic,
    EventsPublic,
    JobPublic,
    JobsPublic,
    JobUpdate,
    MetricPublic,
    MetricsPublic,
    ProfilePublic,
    ProfilesPublic,
    error_responses,
)
from service.contract.spec import MAX_INT, JobSpec
from service.contract.states import JobState
from service.store.repository import MetricsQuery

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobPublic,
    responses={
        200: {"model": JobPublic, "description": "A repeat of an earlier request's Idempotency-Key."},
        **error_responses(400, 403, 422),
        409: {"model": ErrorPublic, "description": "The Idempotency-Key was used for a different spec."},
    },
)
def submit_job(
    spec: JobSpec,
    runtime: RuntimeDep,  # its jobs and scheduler: one dependency where two cost twice on every submission
    user: CurrentUser,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=255,
            description="Makes a retried submission safe: a repeat of a key (per user, for 24 h) with "
            "the same spec answers 200 with the job the first request created (header "
            "Idempotent-Replayed: true) and creates nothing; with another spec, 409.",
        ),
    ] = None,
) -> JobPublic:
    """Queue a training job (201), owned by the token's user. A job that could never run is refused
    (422 naming the field), unwritten, and so is a priority above the non-admin ceiling unless an admin
    asks (403 naming `priority`). With an `Idempotency-Key`, a retry never creates a second job (200:
    the first one)."""
    submission = runtime.jobs.submit_idempotent(spec, by=user, key=idempotency_key)
    if submission.replayed:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
    else:
        runtime.scheduler.wake()
    return JobPublic.build(submission.job)


@router.get("", response_model=JobsPublic, responses=error_responses(422))
def list_jobs(
    jobs: JobsDep,
    state: Annotated[list[JobState] | None, Query(description="Repeat to match several states.")] = None,
    queue: Annotated[str | None, Query(max_length=255, pattern=PRINTABLE_PATTERN)] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> JobsPublic:
    found, count = jobs.list_jobs(states=state or (), queue=queue, offset=offset, limit=limit)
    return JobsPublic(data=[JobPublic.build(job) for job in found], count=count)


@router.get("/{job_id}", response_model=JobPublic, responses=error_responses(404, 422))
def get_job(job_id: JobId, jobs: JobsDep) -> JobPublic:
    return JobPublic.build(jobs.get_job(job_id))


@router.patch(
    "/{job_id}",
    response_model=JobPublic,
    responses={**ADMIN_RESPONSES, **error_responses(400, 404, 409, 422)},
)
def update_job(
    job_id: JobId, update: JobUpdate, jobs: JobsDep, scheduler: SchedulerDep, user: CurrentUser
) -> JobPublic:
    """Change a job's priority (until it ends) or move a queued job to another queue (admins only).
    The new queue's limits apply as at submission (422 naming the field)."""
    job = jobs.update(job_id, by=user, queue=update.queue, priority=update.priority)
    scheduler.wake()
    return JobPublic.build(job)


@router.post(
    "/{job_id}/cancel",
    response_model=JobPublic,
    responses={**OWNER_RESPONSES, **error_responses(404, 409, 422)},
)
def cancel_job(job_id: JobId, jobs: JobsDep, user: CurrentUser) -> JobPublic:
    """Cancel a queued or running job (a running one's Ray job is stopped): its owner or an admin.
    409 if it already ended."""
    return JobPublic.build(jobs.cancel(job_id, by=user))


@router.post(
    "/{job_id}/preempt",
    response_model=JobPublic,
    responses={**OWNER_RESPONSES, **error_responses(404, 409, 422)},
)
def preempt_job(job_id: JobId, jobs: JobsDep, scheduler: SchedulerDep, user: CurrentUser) -> JobPublic:
    """Checkpoint a running job and put it back in its queue, in its place (it resumes from that
    checkpoint when admitted again): its owner or an admin. 409 unless it is running."""
    job = jobs.preempt(job_id, by=user)
    scheduler.wake()
    return JobPublic.build(job)


@router.get("/{job_id}/events", response_model=EventsPublic, responses=error_responses(404, 422))
def list_events(job_id: JobId, jobs: JobsDep) -> EventsPublic:
    events = jobs.list_events(job_id)
    return EventsPublic(data=[EventPublic.build(event) for event in events], count=len(events))


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=error_responses(404, 422))
def list_metrics(job_id: JobId, jobs: JobsDep, query: Annotated[MetricsQuery, Query()]) -> MetricsPublic:
    """Stored points (step, rank, attempt, segment, time, values), ordered by step then rank;
    downsampled on request (`every` or `points`), so that a million-step run still draws."""
    found = jobs.list_metrics(job_id, query)
    return MetricsPublic(data=[MetricPublic.build(point) for point in found], count=len(found))


@router.get("/{job_id}/checkpoints", response_model=CheckpointsPublic, responses=error_responses(404, 422))
def list_checkpoints(job_id: JobId, jobs: JobsDep) -> CheckpointsPublic:
    """Every checkpoint the job reported, by step, with its retention state (kept, deleting, deleted)
    and rank 0's step metrics; the job's `latest_checkpoint` is always kept."""
    checkpoints = jobs.list_checkpoints(job_id)
    return CheckpointsPublic(data=[CheckpointPublic.build(c) for c in checkpoints], count=len(checkpoints))


@router.get("/{job_id}/profiles", response_model=ProfilesPublic, responses=error_responses(404, 422))
def list_profiles(job_id: JobId, jobs: JobsDep) -> ProfilesPublic:
    """The job's profiles (`profile: {start_step, steps}` in its spec), as its ranks saved them beside
    its checkpoints: one Chrome trace per rank and the window's compute/communication split."""
    found = jobs.list_profiles(job_id)
    return ProfilesPublic(
        data=[ProfilePublic.build(profile) for profile in found],
        count=len(found),
        logdir=jobs.profile_root(job_id),
    )


@router.get(
    "/{job_id}/code",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/zip": {"schema": {"type": "string", "format": "binary"}}},
            "description": "The job's code package (header X-Apiary-Code: its sha256:<hex>).",
        },
        **OWNER_RESPONSES,
        **error_responses(404, 422, 503),
    },
)
def job_code(job_id: JobId, jobs: JobsDep, user: CurrentUser) -> StreamingResponse:
    """The code package the job ran (`apiary submit --code`), so that the run can be reproduced: its
    owner's or an admin's to read. 404 for a job submitted without code."""
    code = jobs.job_code(job_id, by=user)
    sha256 = code.digest.removeprefix("sha256:")
    return StreamingResponse(
        code.chunks,
        media_type="application/zip",
        headers={
            "X-Apiary-Code": code.digest,
            "Content-Disposition": f'attachment; filename="job-{job_id}-code-{sha256[:12]}.zip"',
        },
    )
