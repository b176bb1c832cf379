"""Where the jobs' own code packages (service.contract.code) are kept, and how one reaches the cluster.

A package is stored once, by its sha256, beside the jobs' checkpoints:

    {storage_uri}/_code/<sha256>.zip

(the storage root, local or S3, that every replica of the service shares; outside every job's prefix,
so no trainer can report it as a checkpoint). The database says who uploaded which (`CodePackage`
rows): a spec may name only its owner's packages, and a job's package is given back only to the job's
owner or an admin.

The scheduler hands a job's package to Ray as the job's `working_dir`, a local zip file
(`local_path`: the stored file itself on local storage, else a copy fetched once into
`{data_dir}/code-cache` and checked against its digest). Ray's job client uploads it to the cluster's
GCS, once per content, and every node unpacks it for the job's driver, workers and Ray Data tasks: a
node needs no copy of the code, and nothing is installed into the service.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from service.contract.code import ZIP_OVERHEAD_BYTES, mib, module_source
from service.contract.errors import CodeTooLarge, InvalidSpec
from service.contract.spec import BUILTIN_TRAINERS
from service.contract.storage import resolve_uri
from service.contract.trainer_kind import TrainerKind, TrainerNotDefined, kind_of
from service.settings import Settings

CODE_DIR = "_code"
_CHUNK_BYTES = 1 << 20


class Incoming:
    """An upload being received: written to a temporary file, hashed and counted as it comes, refused
    (`CodeTooLarge`) as soon as it passes what a package within the limit can weigh."""

    def __init__(self, path: Path, *, max_bytes: int) -> None:
        self.path = path
        self.size_bytes = 0
        self._max_body_bytes = max_bytes + ZIP_OVERHEAD_BYTES
        self._max_bytes = max_bytes
        self._hash = hashlib.sha256()
        self._file = path.open("wb")

    def write(self, chunk: bytes) -> None:
        self.size_bytes += len(chunk)
        if self.size_bytes > self._max_body_bytes:
            raise CodeTooLarge(
                f"the code package is larger than the code limit of {mib(self._max_bytes)} "
                "(APIARY_CODE_MAX_BYTES): leave data and checkpoints out of the folder (.apiaryignore)"
            )
        self._hash.update(chunk)
        self._file.write(chunk)

    def close(self) -> None:
        self._file.close()

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


@dataclass(frozen=True)
class CodeStore:
    storage_uri: str
    s3_endpoint_url: str | None
    cache_dir: Path
    max_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> CodeStore:
        return cls(
            storage_uri=settings.resolved_storage_uri,
            s3_endpoint_url=settings.s3_endpoint_url,
            cache_dir=settings.data_dir / "code-cache",
            max_bytes=settings.code_max_bytes,
        )

    def uri(self, sha256: str) -> str:
        if "://" not in self.storage_uri:
            return str(Path(self.storage_uri, CODE_DIR, f"{sha256}.zip"))
        return f"{self.storage_uri.rstrip('/')}/{CODE_DIR}/{sha256}.zip"

    @contextlib.contextmanager
    def receiving(self) -> Iterator[Incoming]:
        """A temporary file for an upload (removed afterwards, stored or not)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix="upload-", suffix=".zip", dir=self.cache_dir)
        os.close(handle)
        incoming = Incoming(Path(name), max_bytes=self.max_bytes)
        try:
            yield incoming
        finally:
            incoming.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    def has(self, sha256: str) -> bool:
        path, filesystem = resolve_uri(self.uri(sha256), s3_endpoint_url=self.s3_endpoint_url)
        return bool(filesystem.get_file_info(path).type == pafs.FileType.File)

    def put(self, sha256: str, file: Path) -> None:
        """Store `file` as package `sha256`, unless it is stored already (the same bytes: once)."""
        if self.has(sha256):
            return
        path, filesystem = resolve_uri(self.uri(sha256), s3_endpoint_url=self.s3_endpoint_url)
        filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
        if isinstance(filesystem, pafs.LocalFileSystem):
            # Written beside, then renamed: a reader never sees half a package.
            partial = f"{path}.{secrets.token_hex(6)}.partial"  # one per writer (threads, replicas)
            shutil.copyfile(file, partial)
            os.replace(partial, path)
            return
        with filesystem.open_output_stream(path) as out, file.open("rb") as source:
            while chunk := source.read(_CHUNK_BYTES):
                out.write(chunk)
        if file.parent == self.cache_dir:  # an upload, checked: this replica's copy for its submissions
            os.replace(file, self.cache_dir / f"{sha256}.zip")

    def local_path(self, sha256: str) -> Path:
        """The package as a file on this machine (fetched once from S3 and checked); OSError when the
        storage cannot give it."""
        path, filesystem = resolve_uri(self.uri(sha256), s3_endpoint_url=self.s3_endpoint_url)
        if isinstance(filesystem, pafs.LocalFileSystem):
            if not Path(path).is_file():
                raise FileNotFoundError(f"code package sha256:{sha256} is not in storage ({path})")
            return Path(path)
        cached = self.cache_dir / f"{sha256}.zip"
        if cached.is_file():
            return cached
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        partial = self.cache_dir / f"{sha256}.{secrets.token_hex(6)}.partial"
        digest = hashlib.sha256()
        with filesystem.open_input_stream(path) as source, partial.open("wb") as out:
            while chunk := source.read(_CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            partial.unlink()
            raise OSError(f"code package {self.uri(sha256)} does not match its sha256")
        os.replace(partial, cached)
        return cached

    def chunks(self, sha256: str) -> Iterator[bytes]:
        """The package's bytes, read from storage a piece at a time."""
        path, filesystem = resolve_uri(self.uri(sha256), s3_endpoint_url=self.s3_endpoint_url)
        with filesystem.open_input_stream(path) as source:
            while chunk := source.read(_CHUNK_BYTES):
                yield bytes(chunk)


def sha256_of(digest: str) -> str:
    return digest.removeprefix("sha256:")


def trainer_in_code(package: Path, trainer: str) -> tuple[bool, TrainerKind | None]:
    """Whether `trainer` comes from the job's code (its top-level package or module is in it: the
    code's, first on the path, is the one the workers import), and its kind when the source tells.

    Raises `InvalidSpec` (field `trainer`) when it certainly cannot run: the module is not in the code,
    does not parse, or does not define the name. Reads the source, never imports it."""
    if trainer in BUILTIN_TRAINERS:
        return False, TrainerKind.RECIPE
    module, _, name = trainer.partition(":")
    found = module_source(package, module)
    if not found.top_level:
        return False, None
    if found.path is None:
        raise InvalidSpec(
            f"trainer {trainer!r}: the job's code has `{module.split('.')[0]}` but no module {module!r} "
            f"(looked for {module.replace('.', '/')}.py and {module.replace('.', '/')}/__init__.py)",
            field="trainer",
        )
    if found.source is None:
        return True, None  # compiled: the driver finds out
    try:
        return True, kind_of(found.source, name)
    except TrainerNotDefined:
        raise InvalidSpec(
            f"trainer {trainer!r}: {found.path} in the job's code defines no {name!r}", field="trainer"
        ) from None
    except SyntaxError as err:
        raise InvalidSpec(
            f"trainer {trainer!r}: {found.path} in the job's code does not parse: line {err.lineno}: "
            f"{err.msg}",
            field="trainer",
        ) from None
