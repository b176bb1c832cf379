"""Where a job's metrics are outside Apiary: its TensorBoard folder (service.tracking)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from api.deps import JobsDep
from api.schemas import error_responses
from service.contract.spec import MAX_INT

router = APIRouter(tags=["jobs"])


class TensorBoardPublic(BaseModel):
    logdirs: list[str] = Field(
        description="The jobs' TensorBoard folders ({storage}/job-N/tensorboard), or the storage root, "
        "under which `tensorboard --logdir` finds every job."
    )
    enabled: bool = Field(description="Whether this service writes TensorBoard files (APIARY_TENSORBOARD).")


@router.get("/tensorboard", response_model=TensorBoardPublic, responses=error_responses(404, 422))
def tensorboard_logdirs(
    jobs: JobsDep,
    job: Annotated[
        list[Annotated[int, Field(ge=1, le=MAX_INT)]] | None,
        Query(max_length=100, description="Job ids; none: every job (the storage root)."),
    ] = None,
) -> TensorBoardPublic:
    return TensorBoardPublic(logdirs=jobs.tensorboard_logdirs(job or []), enabled=jobs.settings.tensorboard)
