"""Who may import whom (docs/architecture.md), read from the source: an arrow the wrong way fails here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the trainers (on the cluster) and the SDK may import of the service: the contract package and
# the planner's pure formulas (checkpoint.auto chooses its cadence with them on the cluster).
SHARED_PACKAGES = ("service.contract",)
SHARED_MODULES = ("service.planning.formulas",)
# The service's lower rooms, each with the only service packages it may import (besides itself). The
# application layer (service's top-level modules) and service.scheduling stand above them.
LOWER_ROOMS = {
    "service.contract": (),
    "service.capacity": ("service.contract",),
    "service.store": ("service.contract",),
    "service.planning.formulas": ("service.contract",),
}


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def shared(module: str) -> bool:
    return module in SHARED_MODULES or any(in_room(module, package) for package in SHARED_PACKAGES)


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


def test_nothing_inside_imports_the_public_package() -> None:
    """`apiary` (the names users import) stands above api, service and trainers, never below them."""
    for package in ("api", "service", "trainers"):
        for module, names in imports_of(package).items():
            assert "apiary" not in packages(names), module


def test_the_public_package_imports_only_the_sdk_and_the_contract() -> None:
    """At run time `apiary` imports api.extras alone (each public name is imported when first used);
    for type checkers, the SDK, the contract, the recipe protocol (and the built-in recipes' helpers)
    and the training context."""
    allowed = (
        "api.client",
        "api.schemas",
        "api.extras",
        *SHARED_PACKAGES,
        "trainers.recipe",
        "trainers.recipes",
        "trainers.context",
    )
    for module, names in imports_of("apiary").items():
        ours = {name for name in names if name.split(".")[0] in ("api", "service", "trainers")}
        assert all(any(in_room(name, ok) for ok in allowed) for name in ours), (module, ours)


def test_the_api_never_imports_the_trainers() -> None:
    for module, names in imports_of("api").items():
        assert "trainers" not in packages(names), module


def test_the_service_never_imports_the_api_or_the_trainers() -> None:
    for module, names in imports_of("service").items():
        assert not packages(names) & {"api", "trainers"}, module


def test_the_trainers_import_only_the_contract_and_the_formulas() -> None:
    for module, names in imports_of("trainers").items():
        assert all(shared(name) for name in names if name.startswith("service.")), module


def test_the_examples_import_what_a_users_code_may() -> None:
    """examples/ is code a user could have written: Ray, torch, and Apiary through its one public
    name, `apiary` (the recipe protocol and its helpers, the training context); never the internal
    packages."""
    for module, names in imports_of("examples").items():
        internal = packages(names) & {"api", "service", "trainers", "migrations"}
        assert not internal, (module, internal)


@pytest.mark.parametrize("room", sorted(LOWER_ROOMS))
def test_a_lower_room_imports_only_the_rooms_below_it(room: str) -> None:
    allowed = (room, *LOWER_ROOMS[room])
    for module, names in imports_of("service").items():
        if in_room(module, room):
            inner = {name for name in names if name.startswith("service.")}
            assert all(any(in_room(name, ok) for ok in allowed) for name in inner), (module, inner)


def test_the_service_has_no_import_circle() -> None:
    graph = {
        module: {name for name in names if name.startswith("service.") and name != module}
        for module, names in imports_of("service").items()
    }
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in done:
            return
        for name in graph.get(module, ()):
            visit(name, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_prometheus_is_imported_by_the_observability_module_only() -> None:
    """Not by the pure policy, nor the trainers: the metric objects live in service.observability."""
    for package in ("api", "service", "trainers"):
        for module, names in imports_of(package).items():
            if module != "service.observability":
                assert "prometheus_client" not in packages(names), module


# The modules that use Ray's private API (the trainers' door, and the service's to Ray's node drains),
# and their tests, which check each name against Ray.
RAY_DOOR = {
    "trainers/ray_private.py",
    "tests/unit/test_ray_private.py",
    "service/ray_drains.py",
    "tests/unit/test_ray_drains.py",
}


def ray_private_uses(path: Path) -> list[str]:
    """Where a module reaches Ray's private API: it imports a Ray module or name with a part that
    starts with `_` (`ray._private`, `ray.train.v2._internal`), reads such an attribute of a Ray
    name, defines such a method in a subclass of a Ray class (which overrides Ray's, or may one day),
    or assigns to a Ray name's attribute (monkeypatching, `setattr` too)."""
    tree = ast.parse(path.read_text())
    from_ray: set[str] = set()  # the names this module binds to Ray modules, classes and functions
    found: list[str] = []

    def private(dotted: str) -> bool:
        return any(part.startswith("_") and not part.endswith("__") for part in dotted.split("."))

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            inner = dotted(node.value)
            return f"{inner}.{node.attr}" if inner is not None else None
        return None

    def of_ray(node: ast.AST) -> str | None:
        name = dotted(node)
        return name if name is not None and name.split(".")[0] in from_ray else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ray":
                    from_ray.add(alias.asname or "ray")
                    if private(alias.name):
                        found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ray":
            for alias in node.names:
                from_ray.add(alias.asname or alias.name)
                if private(f"{node.module}.{alias.name}"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (name := of_ray(node)) and private(name):
            found.append(f"line {node.lineno}: {name}")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and (name := of_ray(target)):
                    found.append(f"line {node.lineno}: assigns {name}")
        elif isinstance(node, ast.Call) and node.args:
            called = dotted(node.func)
            if called is not None and called.split(".")[-1] == "setattr" and (name := of_ray(node.args[0])):
                found.append(f"line {node.lineno}: setattr on {name}")
        elif isinstance(node, ast.ClassDef) and any(of_ray(base) for base in node.bases):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and private(item.name):
                    found.append(f"line {item.lineno}: {node.name}, a Ray subclass, defines {item.name}")
    return found


def test_only_the_door_uses_rays_private_api() -> None:
    """trainers/ray_private.py names the Ray version it was checked against; anywhere else, a private
    name would break unseen when Ray is upgraded."""
    uses = {
        str(path.relative_to(ROOT)): ray_private_uses(path)
        for package in ("api", "service", "trainers", "benchmarks", "tests", "migrations", "examples")
        for path in sorted((ROOT / package).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in RAY_DOOR
    }
    assert {path: found for path, found in uses.items() if found} == {}
    # The check sees what the door does.
    assert ray_private_uses(ROOT / "trainers/ray_private.py")


CONTRACT = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "service" / "contract").glob("*.py")
    if path.name != "__init__.py"
)


# `apiary.Client`: what the public package's client name loads; api.cli: the `apiary` command, whose
# client commands run with no extra installed (api/extras.py).
@pytest.mark.parametrize(
    "module", ["apiary", "apiary.Client", "api.cli", "api.client", *CONTRACT, *SHARED_MODULES]
)
def test_the_sdk_and_the_shared_modules_load_without_the_database_or_ray(module: str) -> None:
    load = (
        f"import apiary; apiary.{module.split('.')[1]}"
        if module.startswith("apiary.")
        else f"import {module}"
    )
    probe = (
        f"import sys; {load}; "
        "print(sorted(m for m in ('sqlalchemy', 'fastapi', 'ray', 'torch') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_api_opens_no_database_session() -> None:
    """The API reaches the database through the service (`service.jobs`, `service.auth`), whose
    `service.store.repository` is the one module that talks to it: no route opens a session."""
    for path in sorted((ROOT / "api").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert node.func.attr != "session", f"{path.relative_to(ROOT)}:{node.lineno}"
