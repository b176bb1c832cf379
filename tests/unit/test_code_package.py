"""The code package a job brings (service.contract.code): packed the same way every time, without what
is excluded, refused above the limit before it is read; and what the service checks in one."""

from __future__ import annotations

import io
import os
import time
import zipfile
from pathlib import Path

import pytest

from service.contract.code import (
    MAX_FILES,
    module_source,
    pack,
    read_package,
    shadowed,
)
from service.contract.errors import CodeError, CodeTooLarge


def write(root: Path, files: dict[str, str | bytes]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def names(data: bytes) -> list[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return archive.namelist()


def test_the_same_folder_packs_to_the_same_bytes_whatever_its_times(tmp_path: Path) -> None:
    files = {"lab/__init__.py": "", "lab/train.py": "def train(config):\n    pass\n", "run.sh": "#!/bin/sh\n"}
    first = write(tmp_path / "a", files)
    second = write(tmp_path / "b", dict(reversed(files.items())))
    os.chmod(first / "run.sh", 0o755)
    os.chmod(second / "run.sh", 0o755)
    os.utime(second / "lab" / "train.py", (time.time() - 86_400, time.time() - 86_400))
    one, two = pack(first), pack(second)
    assert one.data == two.data and one.digest == two.digest
    assert one.digest.startswith("sha256:") and len(one.sha256) == 64
    assert names(one.data) == ["lab/__init__.py", "lab/train.py", "run.sh"]
    assert (one.files, one.size_bytes) == (3, len(files["lab/train.py"]) + len("#!/bin/sh\n"))
    with zipfile.ZipFile(io.BytesIO(one.data)) as archive:
        assert archive.getinfo("run.sh").external_attr >> 16 & 0o777 == 0o755
        assert archive.getinfo("lab/train.py").external_attr >> 16 & 0o777 == 0o644
    (second / "lab" / "train.py").write_text("def train(config):\n    return 1\n")
    assert pack(second).digest != one.digest


def test_git_caches_venvs_and_ignored_patterns_stay_out(tmp_path: Path) -> None:
    root = write(
        tmp_path,
        {
            "lab/train.py": "x = 1\n",
            "lab/__pycache__/train.cpython-311.pyc": b"\0",
            ".git/HEAD": "ref: refs/heads/main\n",
            ".venv/bin/python": "",
            "sub/.git/config": "",
            "data/big.parquet": b"\0" * 10,
            "lab/model.ckpt": b"\0",
            "lab/keep.ckpt": b"\0",
            "notes.md": "",
            "docs/notes.md": "",
            ".apiaryignore": "# data and checkpoints\ndata/\n*.ckpt\n!keep.ckpt\n/notes.md\n",
        },
    )
    assert names(pack(root).data) == [".apiaryignore", "docs/notes.md", "lab/keep.ckpt", "lab/train.py"]


def test_a_folder_over_the_limit_is_refused_before_it_is_read_naming_the_largest_entries(
    tmp_path: Path,
) -> None:
    root = write(tmp_path, {"lab/train.py": "x = 1\n", "data/a.bin": b"\0" * 3000, "b.bin": b"\0" * 1500})
    with pytest.raises(CodeTooLarge) as refused:
        pack(root, max_bytes=4000)
    message = str(refused.value)
    assert "APIARY_CODE_MAX_BYTES" in message and ".apiaryignore" in message
    assert message.index("data/") < message.index("b.bin"), message  # the largest first
    (root / ".apiaryignore").write_text("data/\n")
    assert pack(root, max_bytes=4000).files == 3


def test_a_link_to_a_folder_is_refused(tmp_path: Path) -> None:
    root = write(tmp_path / "code", {"lab/train.py": ""})
    (root / "elsewhere").symlink_to(tmp_path)
    with pytest.raises(CodeError, match="link to a folder"):
        pack(root)


def zip_of(entries: dict[str, bytes]) -> io.BytesIO:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in entries.items():
            archive.writestr(zipfile.ZipInfo(name), data)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize(
    "name", ["../evil.py", "/etc/passwd", "lab/../../x", "C:/x.py", "lab\\x.py", "./x.py", "a//b.py"]
)
def test_a_package_with_a_path_outside_its_folder_is_refused(name: str) -> None:
    with pytest.raises(CodeError, match="only relative paths"):
        read_package(zip_of({"ok.py": b"", name: b""}), max_bytes=1 << 20)


def test_a_package_is_measured_unpacked_and_must_be_a_zip() -> None:
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("zeros.bin", b"\0" * (2 << 20))
    assert len(bomb.getvalue()) < 1 << 20
    bomb.seek(0)
    with pytest.raises(CodeTooLarge, match=r"unpacks to 2\.0 MiB"):
        read_package(bomb, max_bytes=1 << 20)
    with pytest.raises(CodeError, match="not a zip"):
        read_package(io.BytesIO(b"not a zip"), max_bytes=1 << 20)
    contents = read_package(zip_of({"lab/": b"", "lab/a.py": b"12"}), max_bytes=1 << 20)
    assert contents.names == ("lab/a.py",) and contents.size_bytes == 2
    assert MAX_FILES >= 10_000


@pytest.mark.parametrize(
    ("files", "named"),
    [
        (["trainers/__init__.py", "lab/x.py"], "`trainers` package"),
        (["service/jobs.py"], "`service` package"),  # a namespace package is one too
        (["api.py"], "`api` module"),
        (["apiary/__init__.py"], "`apiary` package"),
        (["migrations.cpython-311-x86_64-linux-gnu.so"], "`migrations` module"),
    ],
)
def test_code_that_would_shadow_apiary_on_the_workers_is_named(files: list[str], named: str) -> None:
    why = shadowed(files)
    assert why is not None and named in why and "rename it" in why


def test_code_beside_apiary_is_fine() -> None:
    assert shadowed(["lab/service.py", "my_api/x.py", "apis.py", "service/README.md", "README.md"]) is None


def test_a_module_is_found_in_the_package_without_importing_it() -> None:
    package = zip_of(
        {
            "lab/__init__.py": b"",
            "lab/train.py": b"def train(config):\n    pass\n",
            "lab/models/__init__.py": b"class Net: ...\n",
            "fast.cpython-311-x86_64-linux-gnu.so": b"\x7fELF",
            "solo.py": b"raise SystemExit('never run')\n",
        }
    )
    found = module_source(package, "lab.train")
    assert (found.top_level, found.path) == (True, "lab/train.py")
    assert found.source == "def train(config):\n    pass\n"
    assert module_source(package, "lab.models").path == "lab/models/__init__.py"
    assert module_source(package, "solo").source == "raise SystemExit('never run')\n"
    compiled = module_source(package, "fast")
    assert compiled.path == "fast.cpython-311-x86_64-linux-gnu.so" and compiled.source is None
    missing = module_source(package, "lab.missing")
    assert missing.top_level and missing.path is None
    assert not module_source(package, "elsewhere.train").top_level
