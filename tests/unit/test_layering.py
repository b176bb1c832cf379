"""Who may import whom (DESIGN.md): read from the source, so a new arrow the wrong way fails here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The service modules that the trainers (and the SDK) may import: the shared kernel of both sides.
SHARED = {
    "service.spec",
    "service.protocol",
    "service.handoff",  # the attempt's launch request and report token in storage
    "service.storage",
    "service.webdataset",
    "service.errors",
    "service.planner",  # pure cluster math: checkpoint.auto chooses its cadence with it on the cluster
}


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(package: str) -> dict[str, set[str]]:
    """module -> the modules it imports, for each module of `package` (`from a import b` counts as
    `a.b` when that is a module of this repository, else as `a`)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    inner = f"{node.module}.{alias.name}"
                    names.add(inner if is_module(inner) else node.module)
        found[module] = names
    return found


def packages(names: set[str]) -> set[str]:
    return {name.split(".", 1)[0] for name in names}


def test_the_api_never_imports_the_trainers() -> None:
    for module, names in imports_of("api").items():
        assert "trainers" not in packages(names), module


def test_the_service_never_imports_the_api_or_the_trainers() -> None:
    for module, names in imports_of("service").items():
        assert not packages(names) & {"api", "trainers"}, module


def test_the_trainers_import_only_the_shared_service_modules() -> None:
    for module, names in imports_of("trainers").items():
        assert {name for name in names if name.startswith("service.")} <= SHARED, module


def test_the_shared_modules_import_nothing_but_each_other_of_the_service() -> None:
    service = imports_of("service")
    for module in SHARED:
        assert {name for name in service[module] if name.startswith("service.")} <= SHARED, module


def test_prometheus_is_imported_by_the_observability_module_only() -> None:
    """Not by the pure policy, nor the trainers: the metric objects live in service.observability."""
    for package in ("api", "service", "trainers"):
        for module, names in imports_of(package).items():
            if module != "service.observability":
                assert "prometheus_client" not in packages(names), module


@pytest.mark.parametrize("module", ["api.client", *sorted(SHARED)])
def test_the_sdk_and_the_shared_modules_load_without_the_database_or_ray(module: str) -> None:
    probe = (
        f"import sys, {module}; "
        "print(sorted(m for m in ('sqlalchemy', 'fastapi', 'ray', 'torch') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
