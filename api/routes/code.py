"""A job's own code: upload a package (PUT /code/{sha256}); a job's package is `GET /jobs/{id}/code`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response, status
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentUser, JobsDep
from api.schemas import CodePublic, error_responses

router = APIRouter(prefix="/code", tags=["code"])

Sha256 = Annotated[str, Path(pattern="^[0-9a-f]{64}$", description="The package's sha256, in hex.")]


@router.put(
    "/{sha256}",
    status_code=status.HTTP_201_CREATED,
    response_model=CodePublic,
    responses={
        200: {"model": CodePublic, "description": "You had uploaded this package already."},
        **error_responses(403, 413, 422),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def upload_code(
    sha256: Sha256, request: Request, jobs: JobsDep, user: CurrentUser, response: Response
) -> CodePublic:
    """Upload a code package (`service.contract.code`: a zip of the folder, as `apiary submit --code DIR`
    packs it; its sha256 names it), for your jobs' specs to name as `code: sha256:<hex>`. Stored once
    per content. 413 above APIARY_CODE_MAX_BYTES, 422 when the body is not that sha256's zip or holds a
    top-level package named like Apiary's own, 403 when the service takes no code
    (APIARY_CODE_UPLOAD=false)."""
    await run_in_threadpool(jobs.require_code_upload)
    with jobs.code.receiving() as incoming:
        async for chunk in request.stream():
            await run_in_threadpool(incoming.write, chunk)
        package, created = await run_in_threadpool(jobs.add_code, incoming, sha256=sha256, by=user)
    if not created:
        response.status_code = status.HTTP_200_OK
    return CodePublic.build(package)
