"""Shared fixtures. The tests are grouped by what they need:

- `tests/unit`: nothing but this process (and the processes a test spawns itself);
- `tests/integration`: a real database (SQLite and PostgreSQL) or S3 server, no Ray;
- `tests/ray`: a real local Ray cluster, trainers run through `trainers.launch.run()`;
- `tests/e2e`: `apiary serve` as a user runs it, with its own local Ray.

Tests under `tests/ray` and `tests/e2e` carry the `ray` marker (`-m "not ray"` skips them). Helpers
live in `tests/support`.

Database tests run twice: on SQLite and on PostgreSQL, a fresh database per test, copied from one that
was migrated once per session (`empty_database_url` for the migration tests).

PostgreSQL: APIARY_TEST_PG_URL (default postgresql+psycopg://postgres@127.0.0.1:5432/postgres) is
the server used to create and drop test databases. `.ci/run` makes sure it is running.

S3: `s3_server` runs the venv's `moto_server` (moto 5.2.5: the system's 5.2.1 breaks pyarrow's
multipart writes) on a free loopback port for the whole session, with the buckets in `S3_BUCKETS`;
`s3` also points the AWS variables and APIARY_S3_ENDPOINT_URL of one test at it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from api.demo import classification_table, write_shards
from service.cluster import free_port
from tests.support.databases import database_name, fresh_postgres_database
from tests.support.telemetry import TelemetryServer
from tests.support.wait import wait_until

PG_ADMIN_URL = os.environ.get("APIARY_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if {"ray", "e2e"} & set(item.path.relative_to(TESTS).parts[:1]):
            item.add_marker(pytest.mark.ray)


@dataclass(frozen=True)
class MigratedTemplates:
    """One database of each kind at the newest revision, made once a session: a test's database is a
    copy (a file copy, or PostgreSQL's CREATE DATABASE ... TEMPLATE), not ten migrations again."""

    sqlite_file: Path
    postgres_name: str


@pytest.fixture(scope="session")
def migrated_templates(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigratedTemplates]:
    from service.store.db import build_engine, upgrade

    sqlite_file = tmp_path_factory.mktemp("template") / "apiary.db"
    with fresh_postgres_database(PG_ADMIN_URL, prefix="apiary_template") as postgres:
        for url in (f"sqlite:///{sqlite_file}", postgres):
            engine = build_engine(url)
            upgrade(engine)
            engine.dispose()
        yield MigratedTemplates(sqlite_file=sqlite_file, postgres_name=database_name(postgres))


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(
    request: pytest.FixtureRequest, tmp_path: Path, migrated_templates: MigratedTemplates
) -> Iterator[str]:
    """A fresh database at the newest revision, SQLite then PostgreSQL (`empty_database_url` for one
    that was never migrated)."""
    if request.param == "sqlite":
        yield migrated_sqlite(tmp_path, migrated_templates)
        return
    yield from _fresh_postgres_database(template=migrated_templates.postgres_name)


def migrated_sqlite(folder: Path, templates: MigratedTemplates) -> str:
    copy = folder / "apiary.db"
    shutil.copyfile(templates.sqlite_file, copy)
    return f"sqlite:///{copy}"


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database that was never migrated, SQLite then PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'apiary.db'}"
        return
    yield from _fresh_postgres_database()


def _fresh_postgres_database(*, template: str | None = None) -> Iterator[str]:
    with fresh_postgres_database(PG_ADMIN_URL, prefix="apiary_test", template=template) as url:
        yield url


@pytest.fixture
def postgres_url() -> Iterator[str]:
    yield from _fresh_postgres_database()


@pytest.fixture
def classification_dataset(tmp_path: Path) -> str:
    uri = (tmp_path / "dataset").as_uri()
    write_shards(classification_table(num_rows=128, num_features=8, num_classes=3), uri, num_shards=2)
    return uri


@pytest.fixture
def telemetry_server() -> Iterator[TelemetryServer]:
    server = TelemetryServer()
    yield server
    server.close()


S3_BUCKETS = ("apiary-datasets", "apiary-checkpoints")
# moto accepts any credentials; fixed fake ones keep the AWS SDK from looking further (instance metadata).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "apiary-test",
    "AWS_SECRET_ACCESS_KEY": "apiary-test-secret",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 server (moto) on 127.0.0.1 for the session, with `S3_BUCKETS`; yields its endpoint URL."""
    import boto3

    moto_server = Path(sys.executable).parent / "moto_server"
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(moto_server), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def answers() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"moto_server exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        try:
            return httpx.get(f"{endpoint}/moto-api/", timeout=2).status_code < 500
        except httpx.HTTPError:
            return False

    try:
        wait_until(answers, timeout_s=60, interval_s=0.2, what=f"moto_server answering on {endpoint}")
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=S3_ENV["AWS_REGION"],
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
        )
        for bucket in S3_BUCKETS:
            client.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class S3:
    endpoint_url: str
    # A fresh prefix per test in each bucket: the server (and its buckets) live for the whole session.
    datasets_uri: str
    checkpoints_uri: str
    env: dict[str, str]


@pytest.fixture
def s3(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    """The session's S3 server, with this test's AWS variables and APIARY_S3_ENDPOINT_URL pointing at it."""
    env = {**S3_ENV, "APIARY_S3_ENDPOINT_URL": s3_server}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    prefix = uuid.uuid4().hex[:12]
    return S3(
        endpoint_url=s3_server,
        datasets_uri=f"s3://{S3_BUCKETS[0]}/{prefix}",
        checkpoints_uri=f"s3://{S3_BUCKETS[1]}/{prefix}",
        env=env,
    )
