"""POST /plan: the cluster math of a run (service.planning.formulas) from facts, a spec and what Apiary
measured."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from api.deps import RuntimeDep
from api.schemas import error_responses
from service.contract.errors import InvalidSpec
from service.contract.spec import MAX_INT, Int, JobSpec
from service.planning.formulas import PlanFacts

router = APIRouter(tags=["plan"])


class PlanRequest(BaseModel):
    facts: PlanFacts = Field(
        default_factory=PlanFacts, description="Facts given outright; they win over everything measured."
    )
    spec: JobSpec | None = Field(default=None, description="A job spec to take facts from.")
    job_id: Int | None = Field(
        default=None,
        le=MAX_INT,
        ge=1,
        description="A job whose spec and measured step time to use (its spec unless `spec`).",
    )


class PlanRow(BaseModel):
    name: str
    value: bool | int | float | None = Field(description="None: absent (see needs).")
    unit: str
    formula: str
    meaning: str
    needs: list[str] = Field(description="The facts an absent quantity lacks ('a | b': either).")


class PlanPublic(BaseModel):
    plan: dict[str, bool | int | float | None] = Field(
        description="Every quantity by name (SI units in keys); None where absent."
    )
    rows: list[PlanRow]
    facts: dict[str, Any] = Field(description="The facts the plan used.")
    sources: dict[str, str] = Field(description="Where each fact came from.")


@router.post("/plan", response_model=PlanPublic, responses=error_responses(400, 404, 422))
def create_plan(request: PlanRequest, runtime: RuntimeDep) -> PlanPublic:
    """Throughput, communication ceiling, checkpoint cost, cadence, failure waste and price."""
    try:
        result, sources = runtime.jobs.plan(
            facts=request.facts.model_dump(exclude_unset=True), spec=request.spec, job_id=request.job_id
        )
    except ValueError as err:  # a spec's fact that does not fit the others
        raise InvalidSpec(str(err), field="facts") from None
    return PlanPublic(
        plan=result.as_dict(),
        rows=[PlanRow(**row.as_dict()) for row in result.rows],
        facts=result.facts.model_dump(exclude_none=True),
        sources=sources,
    )
