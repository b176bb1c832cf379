"""Object storage as the service sees it: resolving dataset URIs (file:// and s3://)."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

import pyarrow.fs as pafs

from service.errors import DatasetNotFound

SHARD_SUFFIXES = {"parquet": (".parquet",)}


def filesystem_for(uri: str, *, s3_endpoint_url: str | None = None) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a file:/// or s3:// URI."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return pafs.LocalFileSystem(), unquote(parsed.path)
    if parsed.scheme == "s3":
        endpoint = s3_endpoint_url or os.environ.get("APIARY_S3_ENDPOINT_URL")
        options: dict[str, object] = {"region": os.environ.get("AWS_REGION", "us-east-1")}
        if endpoint:
            endpoint_url = urlparse(endpoint)
            options["endpoint_override"] = endpoint_url.netloc or endpoint
            options["scheme"] = endpoint_url.scheme or "https"
        return pafs.S3FileSystem(**options), f"{parsed.netloc}{parsed.path}".rstrip("/")
    raise DatasetNotFound(f"unsupported URI scheme in {uri!r}; use file:/// or s3://", field="dataset.uri")


def list_shards(uri: str, *, data_format: str = "parquet", s3_endpoint_url: str | None = None) -> list[str]:
    """The shard files under `uri` (a file or a folder), sorted; raises DatasetNotFound if none."""
    fs, path = filesystem_for(uri, s3_endpoint_url=s3_endpoint_url)
    suffixes = SHARD_SUFFIXES[data_format]
    try:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            return [path]
        if info.type == pafs.FileType.NotFound:
            raise DatasetNotFound(f"dataset {uri} does not exist", field="dataset.uri")
        selector = pafs.FileSelector(path, recursive=True)
        shards = sorted(i.path for i in fs.get_file_info(selector) if i.path.endswith(suffixes))
    except OSError as err:
        raise DatasetNotFound(f"cannot read dataset {uri}: {err}", field="dataset.uri") from err
    if not shards:
        raise DatasetNotFound(
            f"dataset {uri} holds no {data_format} shards ({', '.join(suffixes)} files)", field="dataset.uri"
        )
    return shards
