"""A fresh PostgreSQL database per test or benchmark run, dropped afterwards (even with open sessions)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url


@contextmanager
def fresh_postgres_database(admin_url: str, *, prefix: str, template: str | None = None) -> Iterator[str]:
    """Create a database named `{prefix}_<random>` on the server of `admin_url` and yield its URL: an
    empty one, or a copy of the database `template` (which nobody may be connected to).

    A server that cannot be reached raises RuntimeError naming it: a missing PostgreSQL must fail a
    test run, never skip it.
    """
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    copy = f' TEMPLATE "{template}"' if template is not None else ""
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"{copy}'))
    except Exception as err:
        admin.dispose()
        raise RuntimeError(f"PostgreSQL at {admin_url} is needed here: {err}") from err
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def database_name(url: str) -> str:
    name = make_url(url).database
    assert name is not None, url
    return name
