"""Shared fixtures. Database tests run twice: on SQLite and on PostgreSQL (a fresh database per test).

PostgreSQL: APIARY_TEST_PG_URL (default postgresql+psycopg://postgres@127.0.0.1:5432/postgres) is
the server used to create and drop test databases. `.ci/run` makes sure it is running.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from service.datasets import write_classification_dataset

PG_ADMIN_URL = os.environ.get("APIARY_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'apiary.db'}"
        return
    yield from _fresh_postgres_database()


def _fresh_postgres_database() -> Iterator[str]:
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"apiary_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as err:  # a missing PostgreSQL must fail the suite, not skip it
        raise RuntimeError(f"PostgreSQL at {PG_ADMIN_URL} is needed for the tests: {err}") from err
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    yield from _fresh_postgres_database()


@pytest.fixture
def classification_dataset(tmp_path: Path) -> str:
    uri = f"file://{tmp_path / 'dataset'}"
    write_classification_dataset(uri, num_shards=2, rows_per_shard=64, num_features=8, num_classes=3)
    return uri
