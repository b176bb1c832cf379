"""The extras by role (pyproject.toml) and what api/extras.py says each brings: the modules a command
checks before it runs are the modules of exactly that extra's distributions, read from the installed
metadata; and `pip install apiary` itself brings none of the heavy ones."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from api.extras import EXTRAS, extra_of, install_hint, missing

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HEAVY = ("torch", "ray", "fastapi", "sqlalchemy", "psycopg", "pyarrow", "alembic", "uvicorn")


def distribution(requirement: str) -> str:
    """`ray[default]==2.60.0` -> `ray`, normalized as packaging does (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group()).lower()


def distributions_of(module: str) -> set[str]:
    return {distribution(name) for name in metadata.packages_distributions().get(module, [])}


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_each_extra_checks_the_modules_of_its_own_distributions(extra: str) -> None:
    declared = {distribution(requirement) for requirement in PROJECT["optional-dependencies"][extra]}
    checked = {name for module in EXTRAS[extra] for name in distributions_of(module)}
    assert checked == declared


def test_the_base_install_brings_no_server_or_cluster_dependency() -> None:
    base = {distribution(requirement) for requirement in PROJECT["dependencies"]}
    assert base.isdisjoint({name for module in HEAVY for name in distributions_of(module)})


def test_dev_is_everything() -> None:
    dev = PROJECT["optional-dependencies"]["dev"]
    assert "apiary[server,cluster,examples]" in dev


def test_what_is_missing_is_found_without_importing_it() -> None:
    assert missing("server", "cluster") == []  # the dev install has everything
    assert extra_of("torch.nn") == "cluster" and extra_of("fastapi") == "server" and extra_of("json") is None
    assert install_hint("server", "cluster") == "pip install 'apiary[server,cluster]'"
