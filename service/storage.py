"""Object storage, shared by the service (checks at submission) and the trainers (reads on the cluster).

Dataset and checkpoint URIs are `file:///abs/path` (or a bare absolute path) and `s3://bucket/prefix`;
S3 credentials come from the usual AWS variables, and `APIARY_S3_ENDPOINT_URL` names an S3-compatible
endpoint (MinIO, moto). Like `service.spec`, this module needs only pyarrow: a URI that the API
accepts resolves the same way in the trainer.
"""

from __future__ import annotations

from urllib.parse import unquote, urlparse

import pyarrow.fs as pafs

from service.errors import DatasetError

SHARD_SUFFIXES = {"parquet": ".parquet"}


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


def _s3_filesystem(endpoint_url: str | None) -> pafs.FileSystem:
    if endpoint_url is None:
        return pafs.S3FileSystem()
    endpoint = urlparse(endpoint_url)
    if endpoint.scheme not in ("http", "https") or not endpoint.netloc:
        raise ValueError(f"s3_endpoint_url {endpoint_url!r} must look like http(s)://host:port")
    return pafs.S3FileSystem(endpoint_override=endpoint.netloc, scheme=endpoint.scheme)


def list_shards(
    uri: str, *, data_format: str = "parquet", s3_endpoint_url: str | None = None
) -> tuple[list[str], pafs.FileSystem]:
    """The shard files at `uri` (one file, or a folder searched recursively), sorted by path.

    Raises `DatasetError` (a ValueError, HTTP 422 at submission) when there are none.
    """
    suffix = SHARD_SUFFIXES[data_format]
    path, filesystem = resolve_uri(uri, s3_endpoint_url=s3_endpoint_url)
    try:
        info = filesystem.get_file_info(path)
    except OSError as err:
        raise DatasetError(f"dataset {uri} cannot be read: {_one_line(err)}") from err
    if info.type == pafs.FileType.NotFound:
        raise DatasetError(f"dataset {uri} does not exist")
    if info.type == pafs.FileType.File:
        return [path], filesystem
    selector = pafs.FileSelector(path, recursive=True)
    files = sorted(
        entry.path
        for entry in filesystem.get_file_info(selector)
        if entry.type == pafs.FileType.File
        and entry.path.endswith(suffix)
        # The same hidden-file rule as pyarrow and Spark: _SUCCESS, .crc and friends are not data.
        and not any(part.startswith((".", "_")) for part in entry.path[len(path) :].split("/") if part)
    )
    if not files:
        raise DatasetError(f"dataset {uri} has no {suffix} files")
    return files, filesystem


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__
