"""`pip install apiary` with no extra, as a user's laptop has it: a wheel of this checkout in a fresh
venv (tests/integration/test_client_install.py, benchmarks/cli_startup.py).

The venv installs from a wheelhouse kept between runs (APIARY_TEST_WHEELS, default
~/.cache/apiary-tests/wheels): filled from the package index the first time (or when the base
dependencies change), offline after that."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(os.environ.get("APIARY_TEST_WHEELS", Path.home() / ".cache" / "apiary-tests" / "wheels"))
PACKAGES = ("apiary", "api", "service", "trainers", "migrations")


def build_client_venv(folder: Path) -> Path:
    """A venv at `folder`/venv holding this checkout's wheel and its base dependencies; its `bin/`."""
    source = folder / "source"
    source.mkdir(parents=True)
    # The sources a wheel is built from, copied: the build leaves nothing in the checkout.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    build = ("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(folder), str(source))
    _checked(_pip(*build, cwd=folder))
    wheel = next(folder.glob("apiary-*.whl"))
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = ("--python", python, "install", "--no-index", "--find-links", str(WHEELHOUSE))
    if _pip(*install, str(wheel), cwd=folder).returncode != 0:
        # The first run here (or new dependencies): fill the wheelhouse from the index, with the base
        # dependencies only (an apiary wheel there would be taken for this one, old metadata and all).
        dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        _checked(_pip("wheel", "-w", str(WHEELHOUSE), *dependencies, cwd=folder))
        _checked(_pip(*install, str(wheel), cwd=folder))
    return venv / "bin"


def _pip(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """pip, away from the checkout: there `python -m pip` would see its editable install's metadata
    (and PYTHONPATH its packages), and take apiary for installed already."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env,
    )


def _checked(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, f"{' '.join(done.args)}: {done.stderr}"
