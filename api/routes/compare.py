"""Jobs side by side: `GET /compare?jobs=12,13,14` (a browser gets the page, api.web.views)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import JobsDep
from api.schemas import ComparePublic, error_responses
from service.compare import MAX_COMPARED_JOBS
from service.contract.errors import InvalidSpec

router = APIRouter(tags=["jobs"])

JOB_LIST_PATTERN = rf"^[0-9]{{1,16}}(,[0-9]{{1,16}}){{0,{MAX_COMPARED_JOBS - 1}}}$"
JobList = Annotated[
    str,
    Query(
        pattern=JOB_LIST_PATTERN,
        max_length=20 * MAX_COMPARED_JOBS,
        description=f"Comma-separated job ids, at most {MAX_COMPARED_JOBS}, e.g. 12,13,14 (each once).",
    ),
]


def parse_job_list(jobs: str) -> list[int]:
    """The ids of `jobs` in order, each once (an id no job has is the service's 404)."""
    ids = list(dict.fromkeys(int(part) for part in jobs.split(",")))
    if len(ids) > MAX_COMPARED_JOBS:
        raise InvalidSpec(f"jobs: at most {MAX_COMPARED_JOBS} jobs, got {len(ids)}", field="jobs")
    return ids


@router.get("/compare", response_model=ComparePublic, responses=error_responses(404, 422))
def compare_jobs(jobs: JobList, service: JobsDep) -> ComparePublic:
    """Each job's final and best metrics (rank 0, the run that counted; best: lowest for a `*loss`
    metric, highest for the others) and the spec keys in which the jobs differ (dotted, with each
    job's value)."""
    return ComparePublic.build(service.compare(parse_job_list(jobs)))
