"""Jobs side by side: `GET /compare?jobs=12,13,14` (a browser gets the page, api.web.views)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import JobsDep
from api.schemas import ComparePublic, error_responses
from service.compare import MAX_COMPARED_JOBS
from service.contract.errors import InvalidSpec
from service.contract.spec import MAX_INT

router = APIRouter(tags=["jobs"])

JOB_LIST_PATTERN = r"^[0-9]{1,16}(,[0-9]{1,16})*$"
JobList = Annotated[
    str,
    Query(
        pattern=JOB_LIST_PATTERN,
        max_length=20 * MAX_COMPARED_JOBS,
        description=f"Comma-separated job ids, 2 to {MAX_COMPARED_JOBS}, e.g. 12,13,14.",
    ),
]


def parse_job_list(jobs: str) -> list[int]:
    """The ids of `jobs` in order, each once; InvalidSpec (field `jobs`) unless 2 to MAX_COMPARED_JOBS."""
    ids = list(dict.fromkeys(int(part) for part in jobs.split(",")))
    if not 2 <= len(ids) <= MAX_COMPARED_JOBS:
        raise InvalidSpec(f"jobs: name 2 to {MAX_COMPARED_JOBS} different jobs, got {len(ids)}", field="jobs")
    if any(not 1 <= job_id <= MAX_INT for job_id in ids):
        raise InvalidSpec("jobs: job ids start at 1", field="jobs")
    return ids


@router.get("/compare", response_model=ComparePublic, responses=error_responses(404, 422))
def compare_jobs(jobs: JobList, service: JobsDep) -> ComparePublic:
    """Each job's final and best metrics (rank 0, the run that counted; best: lowest for a `*loss`
    metric, highest for the others) and the spec keys in which the jobs differ (dotted, with each
    job's value)."""
    return ComparePublic.build(service.compare(parse_job_list(jobs)))
