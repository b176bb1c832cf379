"""A job's own code: the package `apiary submit --code DIR` makes of a folder, and what the service checks
in it before it stores it or runs it.

The package is a zip archive of the folder's files, made the same way every time (`pack`): paths in
sorted order, relative and `/`-separated, every timestamp 1980-01-01, mode 644 (755 for an executable),
no folder entries. The same folder therefore gives the same bytes, and its sha256 (`digest`,
`sha256:<hex>`) names it: the service stores each package once, and a spec names it in `code`.

Left out: any `.git`, `__pycache__` or `.venv` folder (at any depth), and what `.apiaryignore` at the
folder's top lists (gitignore patterns: `data/`, `*.ckpt`, `/notes`, `!keep.ckpt`). A folder whose files
add up to more than the size limit (`DEFAULT_MAX_BYTES`, the service's `APIARY_CODE_MAX_BYTES`) is
refused before anything is packed or sent (`CodeTooLarge`, naming the largest entries).

On the cluster the package is the job's Ray `working_dir`: unpacked on every node, first on every
process's path and its working folder. So it must not hold a top-level package or module named like one
of Apiary's own (`SHADOWED`): it would replace Apiary's on the workers (`shadowed`).

`read_package` checks what a client sent, without unpacking it: relative paths only (no `..`, no
absolute or drive paths), no duplicates, at most `MAX_FILES` files and the size limit unpacked.
`module_source` finds a module's source in it (the API reads the trainer's source with
`service.contract.trainer_kind`, never imports it).

Like the rest of `service.contract`, this needs neither the database nor Ray: the SDK packs with it.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from service.contract.errors import CodeError, CodeTooLarge

# Apiary's top-level packages (and the public `apiary` one): a job's code may not bring its own.
SHADOWED = ("api", "service", "trainers", "migrations", "apiary")
EXCLUDED_DIRS = frozenset({".git", "__pycache__", ".venv"})
IGNORE_FILE = ".apiaryignore"
DEFAULT_MAX_BYTES = 100 * 1024 * 1024
MAX_FILES = 50_000
# What a zip adds around its files at most (headers, central directory): a body larger than the
# unpacked limit plus this cannot be a package within the limit, deflated or stored.
ZIP_OVERHEAD_BYTES = 256 + 200 * MAX_FILES
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)
_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd")


@dataclass(frozen=True, kw_only=True)
class Package:
    """A packed folder: the archive's bytes and what identifies and measures it."""

    data: bytes
    digest: str  # sha256:<hex> of `data`
    files: int
    size_bytes: int  # the files' sizes, unpacked

    @property
    def sha256(self) -> str:
        return self.digest.removeprefix("sha256:")


@dataclass(frozen=True, kw_only=True)
class Contents:
    """What `read_package` found in an archive."""

    names: tuple[str, ...]  # file paths, as stored
    size_bytes: int  # unpacked


def digest_of(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def mib(size_bytes: int) -> str:
    return f"{size_bytes / 2**20:.1f} MiB"


# -- packing (the client) -------------------------------------------------------------------------------


def files_of(folder: Path) -> list[tuple[str, Path]]:
    """(path in the package, file) for every file of `folder` that goes in it, sorted by path."""
    if not folder.is_dir():
        raise CodeError(f"{folder} is not a folder")
    import pathspec  # here: the SDK loads this module for its constants, and only `submit --code` packs

    ignore_file = folder / IGNORE_FILE
    spec = pathspec.GitIgnoreSpec.from_lines(
        ignore_file.read_text(encoding="utf-8").splitlines() if ignore_file.is_file() else []
    )
    found: list[tuple[str, Path]] = []
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        kept = []
        for name in sorted(dirs):
            relative = (here / name).relative_to(folder).as_posix()
            if name in EXCLUDED_DIRS or spec.match_file(relative + "/"):
                continue
            if (here / name).is_symlink():
                raise CodeError(
                    f"{here / name} is a link to a folder: copy what the job needs into the folder, or "
                    f"list it in {IGNORE_FILE}"
                )
            kept.append(name)
        dirs[:] = kept
        for name in names:
            relative = (here / name).relative_to(folder).as_posix()
            if not spec.match_file(relative):
                found.append((relative, here / name))
    return sorted(found)


def pack(folder: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Package:
    """The package of `folder` (see the module docstring); `CodeTooLarge` above `max_bytes` of files,
    found before any file is read."""
    files = files_of(folder)
    sizes = [(relative, path.stat().st_size) for relative, path in files]
    total = sum(size for _, size in sizes)
    if total > max_bytes:
        raise CodeTooLarge(_too_large(folder, sizes, total=total, max_bytes=max_bytes))
    if len(files) > MAX_FILES:
        raise CodeError(
            f"{folder} holds {len(files)} files, more than {MAX_FILES}: list some in {IGNORE_FILE}"
        )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for relative, path in files:
            info = zipfile.ZipInfo(relative, date_time=_FIXED_TIME)
            info.create_system = 3  # unix, whatever packed it: the mode bits below are read on the nodes
            executable = path.stat().st_mode & stat.S_IXUSR
            info.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes(), compresslevel=6)
    data = buffer.getvalue()
    return Package(data=data, digest=digest_of(data), files=len(files), size_bytes=total)


def _too_large(folder: Path, sizes: list[tuple[str, int]], *, total: int, max_bytes: int) -> str:
    by_top: dict[str, int] = {}
    for relative, size in sizes:
        top = relative.split("/", 1)[0] + ("/" if "/" in relative else "")
        by_top[top] = by_top.get(top, 0) + size
    largest = sorted(by_top.items(), key=lambda item: -item[1])[:3]
    shown = ", ".join(f"{name} {mib(size)}" for name, size in largest)
    return (
        f"{folder} is {mib(total)} of files, more than the code limit of {mib(max_bytes)} "
        f"(APIARY_CODE_MAX_BYTES); the largest: {shown}. Leave data and checkpoints out: list them in "
        f"{folder / IGNORE_FILE}"
    )


# -- checking (the service) -----------------------------------------------------------------------------


def read_package(source: str | Path | IO[bytes], *, max_bytes: int) -> Contents:
    """The files of a package, checked (see the module docstring), without unpacking it."""
    try:
        with zipfile.ZipFile(source) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CodeError(f"the code package is not a zip archive: {err}") from None
    if len(infos) > MAX_FILES:
        raise CodeError(f"the code package holds {len(infos)} entries, more than {MAX_FILES}")
    names: list[str] = []
    seen: set[str] = set()
    total = 0
    for info in infos:
        name = info.filename
        if not _safe(name):
            raise CodeError(f"the code package holds {name!r}: only relative paths inside the folder may")
        if info.is_dir():
            continue
        if name in seen:
            raise CodeError(f"the code package holds {name!r} twice")
        seen.add(name)
        names.append(name)
        total += info.file_size
    if total > max_bytes:
        raise CodeTooLarge(
            f"the code package unpacks to {mib(total)}, more than the code limit of {mib(max_bytes)} "
            "(APIARY_CODE_MAX_BYTES)"
        )
    return Contents(names=tuple(names), size_bytes=total)


def _safe(name: str) -> bool:
    if not name or "\\" in name or "\x00" in name or name.startswith("/") or re.match(r"[A-Za-z]:", name):
        return False
    return all(part not in ("", ".", "..") for part in name.rstrip("/").split("/"))


def shadowed(names: tuple[str, ...] | list[str]) -> str | None:
    """Why this code cannot run beside Apiary (a top-level package or module named like one of Apiary's
    own), or None. A folder counts when it holds Python files, as a package (or a namespace one) would."""
    for name in names:
        top, _, rest = name.partition("/")
        module = top.split(".", 1)[0]
        if module not in SHADOWED:
            continue
        if rest and rest.endswith(".py"):
            return (
                f"the code has a top-level `{top}` package: on the workers it would take the place of "
                f"Apiary's own `{top}`; rename it (or list it in {IGNORE_FILE})"
            )
        if not rest and top.endswith(_MODULE_SUFFIXES):
            return (
                f"the code has a top-level `{module}` module ({top}): on the workers it would take the "
                f"place of Apiary's own `{module}`; rename it (or list it in {IGNORE_FILE})"
            )
    return None


@dataclass(frozen=True, kw_only=True)
class ModuleInCode:
    """Where a module is in a package: `top_level` whether its top-level package or module is there (then
    the code's, first on the path, is the one imported), `path` its file (None: not in the code),
    `source` that file's text when it is Python source."""

    top_level: bool
    path: str | None
    source: str | None


def module_source(source: str | Path | IO[bytes], module: str) -> ModuleInCode:
    """Find `module` (dotted) in a package: `a/b.py`, `a/b/__init__.py`, or a compiled `a/b.*.so`."""
    with zipfile.ZipFile(source) as archive:
        names = set(archive.namelist())
        parts = module.split(".")
        top = parts[0]
        top_level = any(
            name.startswith(top + "/") or ("/" not in name and name.split(".", 1)[0] == top) for name in names
        )
        base = "/".join(parts)
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in names:
                text = archive.read(candidate).decode("utf-8", errors="replace")
                return ModuleInCode(top_level=top_level, path=candidate, source=text)
        folder, _, leaf = base.rpartition("/")
        for name in sorted(names):
            parent, _, file = name.rpartition("/")
            if parent == folder and file.split(".", 1)[0] == leaf and file.endswith(_MODULE_SUFFIXES):
                return ModuleInCode(top_level=top_level, path=name, source=None)
    return ModuleInCode(top_level=top_level, path=None, source=None)
