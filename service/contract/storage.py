"""Object storage, shared by the service (checks at submission) and the trainers (reads on the cluster).

Dataset and checkpoint URIs are `file:///abs/path` (or a bare absolute path) and `s3://bucket/prefix`;
S3 credentials come from the usual AWS variables, and `APIARY_S3_ENDPOINT_URL` names an S3-compatible
endpoint (MinIO, moto). Like `service.contract.spec`, this module needs only pyarrow: a URI that the API
accepts resolves the same way in the trainer.

A dataset folder may hold a manifest, `_manifest.json` (written by `apiary data shard`, see
`service.sharding`), listing every shard with its rows, size and sha256:

    {"format_version": 1, "format": "parquet" | "webdataset", "num_rows": N,
     "schema": {"column": "arrow type", ...}, "schema_ipc": "<base64 Arrow IPC schema>",
     "shards": [{"path": "shard-00000.parquet", "num_rows": n, "size_bytes": b, "sha256": "hex",
                 "row_groups": [rows, ...]  # parquet only: rows per row group, the units of resume
                }, ...]}

Shard paths are relative to the folder. A manifest is written last, so its presence means the shards
are complete; the trainer checks every shard against it before any worker starts (`validate_manifest`).
A folder without one (shards written by other tools) is scanned instead: `list_shards`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.fs as pafs
from pydantic import Field

from service.contract.errors import DatasetError, one_line
from service.contract.spec import DataFormat, Strict

SHARD_SUFFIXES = {DataFormat.PARQUET: ".parquet", DataFormat.WEBDATASET: ".tar"}
MANIFEST_NAME = "_manifest.json"
MANIFEST_VERSION = 1
_HASH_CHUNK_BYTES = 8 << 20
# A dataset folder without a manifest is listed one level at a time, up to these bounds: a URI such as
# file:/// must not walk a whole filesystem.
MAX_LIST_ENTRIES = 100_000
MAX_LIST_DEPTH = 16


class DatasetMissing(DatasetError):
    """The dataset does not exist."""


class S3Credentials(Strict):
    """The S3 credentials of a job's processes, held in memory only (`use_s3_credentials`).

    The driver of an attempt redeems its fetch token for them at the control plane
    (`POST /internal/jobs/{id}/attempts/{k}/credentials`), hands them to its Train workers in their loop
    config and to Ray Data's read tasks with their `ShardSource`: never in an environment variable of
    the job's runtime_env, which Ray logs and shows on its dashboard."""

    access_key: str | None = None
    secret_key: str | None = Field(default=None, repr=False)
    session_token: str | None = Field(default=None, repr=False)
    region: str | None = None


# This process's S3 credentials (a job's process); None: the AWS SDK's own chain (environment, role).
_credentials: S3Credentials | None = None


# What the AWS SDKs (boto3, pyarrow, s3fs: the job's own code) read for each field.
_AWS_ENV = {
    "access_key": ("AWS_ACCESS_KEY_ID",),
    "secret_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN",),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
}


def use_s3_credentials(credentials: S3Credentials | None) -> None:
    """Every S3 filesystem this process resolves from now on (`resolve_uri`) uses `credentials`, and so
    does the job's own code that reads S3 the usual way (the AWS SDKs' environment variables, set in
    this process only: `os.environ` changes neither what Ray recorded nor `/proc/<pid>/environ`; a
    process this one starts inherits them, as it would any of its variables)."""
    global _credentials
    _credentials = credentials
    if credentials is None:
        return
    for key, names in _AWS_ENV.items():
        value = getattr(credentials, key)
        if value is None:
            continue
        for name in names:
            os.environ[name] = value


def s3_credentials() -> S3Credentials | None:
    return _credentials


def resolve_uri(uri: str, *, s3_endpoint_url: str | None = None) -> tuple[str, pafs.FileSystem]:
    """Turn a dataset or storage URI into (path on the filesystem, pyarrow filesystem).

    `file:///abs/path` and a bare absolute path are local; `s3://bucket/prefix` uses S3 with
    credentials from the usual AWS environment variables and, when given, a custom endpoint
    (MinIO, moto) such as `http://127.0.0.1:9000`.
    """
    if uri.startswith("s3://"):
        parsed = urlparse(uri)
        path = f"{parsed.netloc}{parsed.path}".rstrip("/")
        if not parsed.netloc:
            raise ValueError(f"{uri} has no bucket: expected s3://bucket/prefix")
        return path, _s3_filesystem(s3_endpoint_url)
    if uri.startswith("file://"):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{uri} names host {parsed.netloc!r}: use file:///absolute/path")
        path = unquote(parsed.path)
    elif "://" in uri:
        raise ValueError(f"{uri}: unsupported scheme (use file:///absolute/path or s3://bucket/prefix)")
    else:
        path = uri
    # Ray Train workers chdir into a session folder, so a relative path would silently point elsewhere.
    if not path.startswith("/"):
        raise ValueError(f"{uri} is not an absolute path")
    return path.rstrip("/") or "/", pafs.LocalFileSystem()


def node_local(uri: str) -> bool:
    """Whether `uri` names a local path: one machine's disk, which the other nodes of a cluster do
    not see unless it is a shared mount (Settings.shared_filesystem). Object storage (s3://) is not."""
    return "://" not in uri or uri.startswith("file://")


def checkpoint_uri(*, storage_uri: str, run_name: str, name: str) -> str:
    """Where Ray Train persists checkpoint folder `name` of a run, as a URI the control plane can store.

    A storage_uri without a scheme is a local absolute path and becomes `file:///abs/...`; any other
    URI (file://, s3://) is extended as is: `{storage_uri}/{run_name}/{name}`.
    """
    if "://" not in storage_uri:
        return Path(storage_uri, run_name, name).absolute().as_uri()
    return f"{storage_uri.rstrip('/')}/{run_name}/{name}"


def _s3_filesystem(endpoint_url: str | None) -> pafs.FileSystem:
    # Explicit credentials travel with the filesystem when Ray pickles it (Train's storage_filesystem).
    options: dict[str, Any] = {}
    if _credentials is not None:
        if _credentials.access_key is not None and _credentials.secret_key is not None:
            options |= {
                "access_key": _credentials.access_key,
                "secret_key": _credentials.secret_key,
                "session_token": _credentials.session_token,
            }
        if _credentials.region is not None:
            options["region"] = _credentials.region
    if endpoint_url is None:
        return pafs.S3FileSystem(**options)
    endpoint = urlparse(endpoint_url)
    if endpoint.scheme not in ("http", "https") or not endpoint.netloc:
        raise ValueError(f"s3_endpoint_url {endpoint_url!r} must look like http(s)://host:port")
    return pafs.S3FileSystem(endpoint_override=endpoint.netloc, scheme=endpoint.scheme, **options)


def list_shards(
    uri: str,
    *,
    data_format: DataFormat = DataFormat.PARQUET,
    s3_endpoint_url: str | None = None,
    max_entries: int = MAX_LIST_ENTRIES,
    max_depth: int = MAX_LIST_DEPTH,
) -> tuple[list[str], pafs.FileSystem]:
    """The shard files at `uri` (one file, or a folder searched recursively), sorted by path.

    Raises `DatasetError` (a ValueError, HTTP 422 at submission) when there are none (`DatasetMissing`
    when nothing is at `uri`), or when the folder holds more than `max_entries` files and folders or
    nests deeper than `max_depth`.

    With a manifest, the shards are the manifest's (in its order), after checking that its format is
    the job's and that each shard exists with the recorded size (metadata calls only, no data read).
    """
    suffix = SHARD_SUFFIXES[data_format]
    path, filesystem = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    try:
        info = filesystem.get_file_info(path)
    except OSError as err:
        raise DatasetError(f"dataset {uri} cannot be read: {one_line(err)}") from err
    if info.type == pafs.FileType.NotFound:
        raise DatasetMissing(f"dataset {uri} does not exist")
    if info.type == pafs.FileType.File:
        return [path], filesystem
    manifest = read_manifest(uri, s3_endpoint_url=s3_endpoint_url)
    if manifest is not None:
        if manifest.format != data_format:
            raise DatasetError(
                f"dataset {uri}: its {MANIFEST_NAME} says format '{manifest.format}', "
                f"the job says '{data_format}'"
            )
        validate_manifest(manifest, uri=uri, s3_endpoint_url=s3_endpoint_url, verify_checksums=False)
        return [f"{path}/{shard.path}" for shard in manifest.shards], filesystem
    files = sorted(
        file
        for file in _walk_files(uri, path, filesystem, max_entries=max_entries, max_depth=max_depth)
        if file.endswith(suffix)
    )
    if not files:
        raise DatasetError(f"dataset {uri} has no {suffix} files")
    return files, filesystem


def _walk_files(
    uri: str, root: str, filesystem: pafs.FileSystem, *, max_entries: int, max_depth: int
) -> list[str]:
    """The files under folder `root`, one level at a time, skipping hidden ones (the same rule as pyarrow
    and Spark: `_SUCCESS`, `.crc` and friends are not data, nor is anything in such a folder)."""
    files: list[str] = []
    level, seen = [root], 0
    for _ in range(max_depth + 1):
        below: list[str] = []
        for folder in level:
            try:
                entries = filesystem.get_file_info(pafs.FileSelector(folder, recursive=False))
            except OSError as err:
                raise DatasetError(f"dataset {uri} cannot be read: {one_line(err)}") from err
            seen += len(entries)
            if seen > max_entries:
                raise DatasetError(
                    f"dataset {uri} holds more than {max_entries} files and folders: write it with a "
                    "manifest (apiary data shard) or point at a smaller folder"
                )
            for entry in entries:
                if entry.base_name.startswith((".", "_")):
                    continue
                if entry.type == pafs.FileType.File:
                    files.append(entry.path)
                elif entry.type == pafs.FileType.Directory:
                    below.append(entry.path)
        if not below:
            return files
        level = below
    raise DatasetError(f"dataset {uri} nests folders deeper than {max_depth} levels")


def is_list_type(data_type: pa.DataType) -> bool:
    """A list column of any Arrow flavour (list, large list, fixed-size list)."""
    return bool(
        pa.types.is_list(data_type)
        or pa.types.is_large_list(data_type)
        or pa.types.is_fixed_size_list(data_type)
    )


def is_number_type(data_type: pa.DataType) -> bool:
    return bool(pa.types.is_integer(data_type) or pa.types.is_floating(data_type))


# ---------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    path: str  # relative to the dataset folder
    num_rows: int
    size_bytes: int
    sha256: str
    # Rows per parquet row group, in file order; empty for webdataset (a tar shard is one unit).
    row_groups: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    format: DataFormat
    num_rows: int
    schema: dict[str, str]
    schema_ipc: str
    shards: list[ShardEntry]
    format_version: int = MANIFEST_VERSION

    def arrow_schema(self) -> pa.Schema:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(self.schema_ipc)))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            format=DataFormat(data["format"]),
            num_rows=int(data["num_rows"]),
            schema=dict(data["schema"]),
            schema_ipc=data["schema_ipc"],
            shards=[ShardEntry(**shard) for shard in data["shards"]],
            format_version=int(data["format_version"]),
        )


def schema_fields(schema: pa.Schema) -> tuple[dict[str, str], str]:
    """The manifest's two views of a schema: readable types, and the exact Arrow IPC bytes (base64)."""
    readable = {name: str(schema.field(name).type) for name in schema.names}
    return readable, base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


def read_manifest(uri: str, *, s3_endpoint_url: str | None = None) -> Manifest | None:
    """The manifest of the dataset folder at `uri`, or None when it has none.

    Raises `DatasetError` when a manifest exists but cannot be parsed.
    """
    root, filesystem = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    location = f"{root}/{MANIFEST_NAME}"
    try:
        if filesystem.get_file_info(location).type != pafs.FileType.File:
            return None
        with filesystem.open_input_stream(location) as stream:
            raw = stream.read()
    except OSError as err:
        raise DatasetError(f"dataset {uri}: {MANIFEST_NAME} cannot be read: {one_line(err)}") from err
    try:
        manifest = Manifest.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError) as err:
        raise DatasetError(
            f"dataset {uri}: {MANIFEST_NAME} is not a valid manifest: {one_line(err)}"
        ) from err
    if manifest.format_version != MANIFEST_VERSION:
        raise DatasetError(
            f"dataset {uri}: {MANIFEST_NAME} has format_version {manifest.format_version}, "
            f"this Apiary reads {MANIFEST_VERSION}"
        )
    return manifest


def write_manifest(manifest: Manifest, uri: str, *, s3_endpoint_url: str | None = None) -> str:
    """Write `_manifest.json` into the dataset folder at `uri`; returns its path."""
    root, filesystem = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    location = f"{root}/{MANIFEST_NAME}"
    with filesystem.open_output_stream(location) as stream:
        stream.write(manifest.to_json().encode())
    return location


def sha256_of(path: str, filesystem: pafs.FileSystem) -> str:
    digest = hashlib.sha256()
    with filesystem.open_input_stream(path) as stream:
        while chunk := stream.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def validate_manifest(
    manifest: Manifest,
    *,
    uri: str,
    s3_endpoint_url: str | None = None,
    verify_checksums: bool = True,
    max_threads: int = 8,
) -> None:
    """Check every shard of `manifest` against the files at `uri`: present, same size, same sha256.

    The checksum pass reads every byte once (threads overlap object-store latency); without it only
    metadata is read. Raises `DatasetError` naming the first bad shard.
    """
    root, filesystem = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    if sum(shard.num_rows for shard in manifest.shards) != manifest.num_rows:
        raise DatasetError(f"dataset {uri}: {MANIFEST_NAME} rows per shard do not add up to num_rows")
    paths = [f"{root}/{shard.path}" for shard in manifest.shards]
    try:
        infos = filesystem.get_file_info(paths)
    except OSError as err:
        raise DatasetError(f"dataset {uri} cannot be read: {one_line(err)}") from err
    for shard, info in zip(manifest.shards, infos, strict=True):
        if info.type != pafs.FileType.File:
            raise DatasetError(f"dataset {uri}: shard {shard.path} is listed in {MANIFEST_NAME} but missing")
        if info.size != shard.size_bytes:
            raise DatasetError(
                f"dataset {uri}: shard {shard.path} has {info.size} bytes, {MANIFEST_NAME} says "
                f"{shard.size_bytes} (corrupt or rewritten)"
            )
    if not verify_checksums:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(max_threads, len(paths)))) as pool:
        digests = list(pool.map(lambda path: sha256_of(path, filesystem), paths))
    for shard, digest in zip(manifest.shards, digests, strict=True):
        if digest != shard.sha256:
            raise DatasetError(
                f"dataset {uri}: shard {shard.path} fails its sha256 check against {MANIFEST_NAME} (corrupt)"
            )
