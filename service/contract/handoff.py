"""The handoff of one attempt: what the service leaves in storage for the attempt's processes to read.

Ray stores a job's `runtime_env` (its dashboard shows it) and exec caps one environment variable at
128 KiB, so neither the spec nor a secret travels in the environment. Before submitting attempt K of
job N, the service writes, under the job's own storage prefix:

    {storage_uri}/job-N/_apiary/attempt-K/launch.json    the LaunchRequest (spec included)
    {storage_uri}/job-N/_apiary/attempt-K/report-token   the attempt's report token

and the job's environment carries only a `LaunchPointer` (`service.contract.protocol.LAUNCH_ENV_VAR`): job,
attempt, that folder, the S3 endpoint to read it with, and the attempt's fetch token with the control
plane's URL to redeem it at. The driver (`trainers.launch`) first redeems the fetch token for the
job's S3 credentials (`POST /internal/jobs/{id}/attempts/{k}/credentials`, once: the database keeps
only the token's sha256 and when it was redeemed, so a token copied from Ray's logs is worthless),
then reads the request from storage, and hands the pointer (without the token) and the credentials
on to its Train workers in their loop config (`LOOP_CONFIG_KEY`); each reads the report token from
storage (`loop_token`) with those credentials. No S3 credential is ever in a job's environment.

The report token is a random secret per attempt; the database keeps only its sha256 (`token_hash`), and
the control plane takes telemetry for a job only from its current attempt, with that token
(`service.jobs.JobService.ingest`), and a checkpoint only under the job's prefix (`is_own_checkpoint`).

Like `service.contract.spec`, this module needs no SQLAlchemy, FastAPI or Ray: both sides import it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx
import pyarrow.fs as pafs
from pydantic import ValidationError

from service.contract.protocol import LAUNCH_ENV_VAR, LaunchPointer, LaunchRequest
from service.contract.storage import S3Credentials, checkpoint_uri, resolve_uri

HANDOFF_DIR = "_apiary"
LAUNCH_FILE = "launch.json"
TOKEN_FILE = "report-token"
# Where a run's handoff pointer is in Ray Train's loop config.
LOOP_CONFIG_KEY = "handoff"


@dataclass(frozen=True)
class Handoff:
    """What the service hands one attempt: its launch request, and its report token (never printed)."""

    request: LaunchRequest
    token: str = field(repr=False)
    # Redeemed once by the attempt's driver for the job's S3 credentials (service.jobs.redeem_credentials).
    fetch_token: str | None = field(default=None, repr=False)


def run_name(job_id: int) -> str:
    """The Ray Train run of a job; the same across attempts, so a new attempt finds its checkpoints."""
    return f"job-{job_id}"


def job_prefix(storage_uri: str, job_id: int) -> str:
    """The job's own storage prefix, with a trailing slash: its run, checkpoints and handoffs."""
    return checkpoint_uri(storage_uri=storage_uri, run_name=run_name(job_id), name="").rstrip("/") + "/"


def handoff_uri(storage_uri: str, *, job_id: int, attempt: int) -> str:
    return f"{job_prefix(storage_uri, job_id)}{HANDOFF_DIR}/attempt-{attempt}"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str | None, stored_hash: str | None) -> bool:
    return (
        token is not None and stored_hash is not None and hmac.compare_digest(token_hash(token), stored_hash)
    )


def is_own_checkpoint(uri: str, *, storage_uri: str, job_id: int) -> bool:
    """Whether `uri` names a folder under the job's prefix (not its handoffs, no `.`/`..` segments)."""
    prefix = job_prefix(storage_uri, job_id)
    if not uri.startswith(prefix):
        return False
    parts = unquote(uri[len(prefix) :]).split("/")
    return parts[0] != HANDOFF_DIR and all(part not in ("", ".", "..") for part in parts)


def write_handoff(
    request: LaunchRequest, *, token: str, credentials_url: str | None = None, fetch_token: str | None = None
) -> LaunchPointer:
    """Write the attempt's launch request and report token to storage; returns the job's pointer (with
    the attempt's fetch token and where to redeem it, when given)."""
    folder = handoff_uri(request.storage_uri, job_id=request.job_id, attempt=request.attempt)
    path, filesystem = resolve_uri(folder, s3_endpoint_url=request.s3_endpoint_url)
    filesystem.create_dir(path, recursive=True)
    _write(filesystem, f"{path}/{LAUNCH_FILE}", request.model_dump_json().encode())
    _write(filesystem, f"{path}/{TOKEN_FILE}", token.encode())
    if isinstance(filesystem, pafs.LocalFileSystem):
        os.chmod(f"{path}/{TOKEN_FILE}", 0o600)
    return LaunchPointer(
        job_id=request.job_id,
        attempt=request.attempt,
        handoff_uri=folder,
        s3_endpoint_url=request.s3_endpoint_url,
        credentials_url=credentials_url,
        credentials_token=fetch_token,
    )


def read_launch(pointer: LaunchPointer) -> LaunchRequest:
    """The attempt's launch request; raises ValueError when it is missing or is not the pointer's."""
    request = LaunchRequest.model_validate_json(_read(pointer, LAUNCH_FILE))
    if (request.job_id, request.attempt) != (pointer.job_id, pointer.attempt):
        raise ValueError(
            f"{pointer.handoff_uri} holds attempt {request.attempt} of job {request.job_id}, not attempt "
            f"{pointer.attempt} of job {pointer.job_id}"
        )
    return request


def read_token(pointer: LaunchPointer) -> str:
    return _read(pointer, TOKEN_FILE).decode().strip()


def redeem_credentials(pointer: LaunchPointer, *, timeout_s: float = 30) -> S3Credentials | None:
    """The job's S3 credentials, for which the driver redeems the pointer's fetch token (once: a second
    try is refused); None for a pointer without one. Raises ValueError when the control plane refuses
    or cannot be reached."""
    if pointer.credentials_url is None or pointer.credentials_token is None:
        return None
    try:
        response = httpx.post(
            pointer.credentials_url,
            headers={"Authorization": f"Bearer {pointer.credentials_token}"},
            timeout=timeout_s,
        )
    except httpx.HTTPError as err:
        raise ValueError(f"cannot reach {pointer.credentials_url}: {err}") from err
    if response.status_code != 200:
        raise ValueError(
            f"{pointer.credentials_url} refused the fetch token: {response.status_code} {response.text[:300]}"
        )
    try:
        return S3Credentials.model_validate_json(response.content)
    except ValidationError as err:
        raise ValueError(
            f"{pointer.credentials_url} answered no credentials: {err.error_count()} error(s)"
        ) from err


def pointer_from_env() -> LaunchPointer | None:
    """This process's launch pointer (a process of a job's attempt), or None outside a job."""
    raw = os.environ.get(LAUNCH_ENV_VAR)
    return LaunchPointer.model_validate_json(raw) if raw else None


def loop_token(loop_config: dict[str, Any]) -> str | None:
    """The report token of a worker's attempt: the driver puts the handoff pointer (not the token) in
    Ray Train's loop config (`LOOP_CONFIG_KEY`), and each worker reads the token from storage. None
    when the run has no handoff (`trainers.launch.run` called directly)."""
    pointer = loop_config.get(LOOP_CONFIG_KEY)
    return read_token(LaunchPointer.model_validate(pointer)) if pointer is not None else None


def _write(filesystem: pafs.FileSystem, path: str, data: bytes) -> None:
    with filesystem.open_output_stream(path) as stream:
        stream.write(data)


def _read(pointer: LaunchPointer, name: str) -> bytes:
    path, filesystem = resolve_uri(pointer.handoff_uri, s3_endpoint_url=pointer.s3_endpoint_url)
    try:
        with filesystem.open_input_stream(f"{path}/{name}") as stream:
            return bytes(stream.read())
    except OSError as err:
        raise ValueError(f"{pointer.handoff_uri}/{name} cannot be read: {err}") from err
