"""What a job may name at submission: the modules a custom trainer may come from, the places a dataset
may be read from.

Trainers (`check_trainer`). A custom trainer (`package.module:function`) runs on every worker of the
cluster, so it must come from a module under one of the operator's prefixes
(`Settings.trainer_modules`, `APIARY_TRAINER_MODULES`: comma-separated, e.g. `acme.trainers,lab`;
empty by default: only the built-ins). The module must also be resolvable in Apiary's environment;
that is found with `importlib.machinery.PathFinder` one package level at a time, which reads folders
and never imports anything, not even the parent packages (whose `__init__` would run user code in the
API's process).

Datasets (`check_dataset`). A dataset URI must lie under one of the data roots
(`Settings.data_roots`, `APIARY_DATA_ROOTS`: comma-separated `file:///abs/path` (or `/abs/path`)
folders and `s3://bucket/prefix` prefixes, `s3://` for any bucket; default: the data dir's
`datasets/` folder and any `s3://`). A local path is resolved first (`..`, symlinks), so
`file:///data/../etc` is `/etc`. Only then is it listed, bounded in files and depth
(`service.contract.storage.list_shards`), in a worker thread that the request waits for at most
`Settings.dataset_check_timeout_s`; and every file the listing found is resolved in turn, so that a
link inside an allowed folder (to a file or to a folder) that leads out of the roots refuses the
dataset.

Apiary's own places are never data, whatever the roots say (`OwnPlaces`): its data dir holds the
database, the local Ray's token, temp folder and logs, and the default checkpoints with each attempt's
report token, so only the data dir's `datasets/` folder may hold datasets; the local Ray's temp folder
(outside the data dir when that path is long) is refused too, and so is any path through a handoff
folder (`_apiary`, `service.contract.handoff`), local or in S3.

A dataset with a manifest is listed in full once per version of its manifest (`ListingCache`: by
location, and the manifest's inode, size, ctime and mtime locally, its size and mtime in S3): until the
manifest changes, a submission skips reading it and the per-shard metadata calls in S3, but still
resolves the URI against the roots, and locally stats and resolves every shard again (a shard gone, of
another size, or replaced by a link out of the roots is refused as before).

"Not allowed" and "not found" give the same message, so that the answers cannot be used to map the
API host's files. The check is made at submission: the trainers list the dataset again when the job
runs, as the user the cluster runs them as.
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow.fs as pafs

from service.contract.errors import DatasetError, InvalidSpec
from service.contract.handoff import HANDOFF_DIR
from service.contract.protocol import find_module
from service.contract.spec import BUILTIN_TRAINERS, DataFormat
from service.contract.storage import (
    MANIFEST_NAME,
    MAX_LIST_DEPTH,
    MAX_LIST_ENTRIES,
    DatasetMissing,
    list_shards,
    resolve_uri,
)

logger = logging.getLogger(__name__)

# Listings of all submissions share these threads: a flood of slow listings waits in line (and times
# out) instead of starting a thread each.
_LISTING_THREADS = 4
_listing_pool = ThreadPoolExecutor(max_workers=_LISTING_THREADS, thread_name_prefix="apiary-dataset-check")


# -- trainers -------------------------------------------------------------------------------------------


def check_trainer(trainer: str, *, allowed_modules: Sequence[str]) -> None:
    """Raise `InvalidSpec` (field `trainer`) unless `trainer` is a built-in, or a function of a module
    under `allowed_modules` that can be found in this environment. Imports nothing."""
    if trainer in BUILTIN_TRAINERS:
        return
    module = trainer.split(":", 1)[0]
    allowed = any(module == prefix or module.startswith(prefix + ".") for prefix in allowed_modules)
    if not allowed or find_module(module) is None:
        shown = ", ".join(allowed_modules) if allowed_modules else "none"
        raise InvalidSpec(
            f"trainer {trainer!r} is not allowed here: a custom trainer must be a module that is "
            f"installed in Apiary's environment under one of the prefixes of APIARY_TRAINER_MODULES "
            f"({shown}); built-ins: {', '.join(sorted(BUILTIN_TRAINERS))}",
            field="trainer",
        )


# -- datasets -------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class OwnPlaces:
    """Local folders that are Apiary's own (`folders`: the data dir, the local Ray's temp folder), with
    the ones inside them that hold data after all (`data_folders`: the data dir's `datasets/`)."""

    folders: tuple[str, ...] = ()
    data_folders: tuple[str, ...] = ()

    def hold(self, location: str) -> bool:
        """Whether `location` (resolved) is one of Apiary's own places, or passes through a handoff."""
        if HANDOFF_DIR in location.split("/"):
            return True
        if location.startswith("s3://"):
            return False
        mine = any(_under(location, os.path.realpath(folder)) for folder in self.folders)
        return mine and not any(_under(location, os.path.realpath(folder)) for folder in self.data_folders)


def check_dataset(
    uri: str,
    *,
    roots: Sequence[str],
    data_format: DataFormat,
    s3_endpoint_url: str | None,
    timeout_s: float,
    own: OwnPlaces = OwnPlaces(),
    max_entries: int = MAX_LIST_ENTRIES,
    max_depth: int = MAX_LIST_DEPTH,
    field: str = "dataset.uri",
) -> None:
    """Raise `DatasetError` (naming `field`) unless `uri` lies under one of `roots` and none of Apiary's
    `own` places, exists and holds shards of `data_format` that all lie there too (links resolved), as
    found within `timeout_s` by a bounded listing."""
    location = _resolved_location(uri)
    resolved_roots = _resolved_roots(roots)

    def allowed(place: str) -> bool:
        return any(_under(place, root) for root in resolved_roots) and not own.hold(place)

    if location is None or not allowed(location):
        raise _not_available(uri, field=field)

    def listed_files_allowed() -> bool:
        files = _listed_shards(
            location,
            data_format=data_format,
            s3_endpoint_url=s3_endpoint_url,
            max_entries=max_entries,
            max_depth=max_depth,
        )
        if location.startswith("s3://"):
            return not any(HANDOFF_DIR in file.split("/") for file in files)
        return all(allowed(os.path.realpath(file)) for file in files)

    future = _listing_pool.submit(listed_files_allowed)
    try:
        if not future.result(timeout=timeout_s):
            raise _not_available(uri, field=field)
    except DatasetMissing:
        raise _not_available(uri, field=field) from None
    except DatasetError as err:
        if not isinstance(err.__cause__, OSError):
            raise
        # The storage's own text names endpoints and hosts: it goes to the log, not to the client.
        logger.warning("%s", err.message, extra={"action": "dataset_unreadable"})
        raise DatasetError(
            f"dataset {uri} cannot be read from its storage: check the URI and that the service may read "
            "it (the service's log has the storage's answer)",
            field=field,
        ) from None
    except FutureTimeout:
        future.cancel()
        raise DatasetError(
            f"dataset {uri} could not be checked within {timeout_s:g} s: write it with a manifest "
            "(apiary data shard) or point at a smaller folder",
            field=field,
        ) from None


# -- listings remembered by their manifest -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Listing:
    marker: tuple[int, ...]  # the manifest's change marker when the dataset was listed in full
    files: tuple[str, ...]
    sizes: tuple[int | None, ...] | None  # local shards' sizes then (None in S3)


class ListingCache:
    """Full listings of datasets with a manifest, by location, format and S3 endpoint (at most
    `max_entries`, the least recently used dropped). A listing stands while its manifest's change
    marker is the same, and is not remembered while the manifest's mtime is within `RACY_S` of now (a
    change in the same clock tick could leave the marker as it was; git's racy-clean rule)."""

    RACY_S = 2.0

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._listings: OrderedDict[tuple[str, str, str | None], _Listing] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, str | None], marker: tuple[int, ...]) -> _Listing | None:
        with self._lock:
            listing = self._listings.get(key)
            if listing is None or listing.marker != marker:
                return None
            self._listings.move_to_end(key)
            return listing

    def put(self, key: tuple[str, str, str | None], listing: _Listing) -> None:
        with self._lock:
            self._listings[key] = listing
            self._listings.move_to_end(key)
            while len(self._listings) > self.max_entries:
                self._listings.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._listings.clear()


_listings = ListingCache()


def _listed_shards(
    location: str,
    *,
    data_format: DataFormat,
    s3_endpoint_url: str | None,
    max_entries: int,
    max_depth: int,
) -> list[str]:
    """`list_shards` of a resolved `location`, from `_listings` while its manifest is unchanged.

    What a remembered listing skips: reading and parsing the manifest, and (in S3) a metadata call per
    shard. What it still does: a local shard is stat'ed (it must exist with the size it had, as the
    manifest's check asks) and, in `check_dataset`, resolved again (a shard replaced by a link out of
    the roots is refused); the URI and the roots are checked on every request. A dataset without a
    manifest is listed every time: its listing is its only change marker."""
    local = not location.startswith("s3://")
    uri = Path(location).as_uri() if local else location
    key = (location, str(data_format), s3_endpoint_url)
    marker = _manifest_marker(location, s3_endpoint_url=s3_endpoint_url)
    if marker is not None:
        listing = _listings.get(key, marker)
        if listing is not None and (listing.sizes is None or _sizes(listing.files) == listing.sizes):
            return list(listing.files)
    files, _ = list_shards(
        uri,
        data_format=data_format,
        s3_endpoint_url=s3_endpoint_url,
        max_entries=max_entries,
        max_depth=max_depth,
    )
    # The marker was read before the listing: a manifest changed since makes the next check list again.
    if marker is not None and time.time() - marker[-1] / 1e9 > ListingCache.RACY_S:
        sizes = _sizes(files) if local else None
        if sizes is None or None not in sizes:
            _listings.put(key, _Listing(marker=marker, files=tuple(files), sizes=sizes))
    return files


def _manifest_marker(location: str, *, s3_endpoint_url: str | None) -> tuple[int, ...] | None:
    """What changes when a dataset's manifest is rewritten, replaced or removed: locally its inode, size,
    ctime and mtime; in S3 its size and mtime (mtime last). None without a manifest."""
    manifest = f"{location.rstrip('/')}/{MANIFEST_NAME}"
    if not location.startswith("s3://"):
        try:
            found = os.stat(manifest)
        except OSError:
            return None
        return (found.st_ino, found.st_size, found.st_ctime_ns, found.st_mtime_ns)
    path, filesystem = resolve_uri(manifest, s3_endpoint_url=s3_endpoint_url)
    try:
        info = filesystem.get_file_info(path)
    except OSError:
        return None  # the listing says what is wrong
    if info.type != pafs.FileType.File or info.size is None or info.mtime_ns is None:
        return None
    return (info.size, info.mtime_ns)


def _sizes(files: Sequence[str]) -> tuple[int | None, ...]:
    """Each local file's size (None: gone)."""
    sizes: list[int | None] = []
    for file in files:
        try:
            sizes.append(os.stat(file).st_size)
        except OSError:
            sizes.append(None)
    return tuple(sizes)


def _not_available(uri: str, *, field: str) -> DatasetError:
    # One text for "outside the data roots" and "does not exist": neither tells what is on the host.
    return DatasetError(
        f"dataset {uri} does not exist or is not under a data root this Apiary may read (APIARY_DATA_ROOTS)",
        field=field,
    )


def _resolved_location(uri: str) -> str | None:
    """A local URI as its real absolute path (`..` and symlinks resolved), an S3 URI as itself; None for
    an S3 key with `.` or `..` segments or anything else (no place a dataset may be)."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        key = parsed.path.rstrip("/")
        if not parsed.netloc or (key and posixpath.normpath(key) != key) or "//" in key:
            return None
        return f"s3://{parsed.netloc}{key}"
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        path = unquote(parsed.path)
        return os.path.realpath(path) if path.startswith("/") else None
    return None


def _resolved_roots(roots: Sequence[str]) -> list[str]:
    resolved = []
    for root in roots:
        if root.startswith("s3://"):
            resolved.append(root.rstrip("/") if root != "s3://" else root)
        else:
            path = unquote(urlparse(root).path) if root.startswith("file://") else root
            resolved.append(os.path.realpath(path))
    return resolved


def _under(location: str, root: str) -> bool:
    if root == "s3://":
        return location.startswith("s3://")
    return location == root or location.startswith(root.rstrip("/") + "/")
