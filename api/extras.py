"""Which extra of the `apiary` distribution brings what (pyproject.toml's optional-dependencies).

`pip install apiary` is the SDK and the CLI's client commands; `apiary[server]` adds the control plane
(`serve`, `db`, `token`, `demo`), `apiary[cluster]` what a Ray node runs (the trainers). A command
whose extra is missing says which one to install (api/cli.py), found without importing anything.
"""

from __future__ import annotations

import importlib.util

# extra -> the top-level modules it brings (tests/unit/test_extras.py holds this to pyproject.toml).
EXTRAS: dict[str, tuple[str, ...]] = {
    "cluster": ("torch", "ray", "pyarrow"),
    "server": (
        "fastapi",
        "uvicorn",
        "sse_starlette",
        "sqlalchemy",
        "alembic",
        "psycopg",
        "jinja2",
        "prometheus_client",
        "pythonjsonlogger",
        "tensorboardX",
        "optuna",
        "pyarrow",
        "ray",
    ),
}


def missing(*extras: str) -> list[str]:
    """The modules of `extras` that are not installed, in order."""
    modules = dict.fromkeys(module for extra in extras for module in EXTRAS[extra])
    return [module for module in modules if importlib.util.find_spec(module) is None]


def extra_of(module: str) -> str | None:
    """The extra that brings top-level `module` (the cluster's first: the trainers need it), if any."""
    top = module.split(".", 1)[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def install_hint(*extras: str) -> str:
    return f"pip install 'apiary[{','.join(extras)}]'"
