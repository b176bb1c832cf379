"""`apiary db upgrade | current` (api/cli_db.py) on a fresh SQLite and PostgreSQL database, and a service
started with `migrate_on_start` off, which refuses a schema that is not the newest."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from typer.testing import CliRunner, Result

from api.cli import app
from service.contract.errors import SchemaOutOfDate
from service.runtime import Runtime
from service.settings import Settings
from service.store.db import build_engine, head_revision
from tests.support.fakes import FakeBackend


def _apiary(database_url: str, tmp_path: Path, *args: str) -> Result:
    env = {"APIARY_DATABASE_URL": database_url, "APIARY_DATA_DIR": str(tmp_path / "data")}
    return CliRunner().invoke(app, list(args), env=env)


def _expect(database_url: str, tmp_path: Path, command: str, *, code: int, says: str) -> None:
    result = _apiary(database_url, tmp_path, "db", *command.split())
    assert result.exit_code == code, result.output
    assert says in result.output


def test_db_upgrade_creates_the_schema_then_current_reports_the_head(
    empty_database_url: str, tmp_path: Path
) -> None:
    head, url = head_revision(), empty_database_url
    _expect(url, tmp_path, "current", code=1, says=f"empty; the newest is {head}: run `apiary db")
    _expect(url, tmp_path, "upgrade", code=0, says=f"upgraded from an empty database to {head}")
    engine = build_engine(empty_database_url)
    assert {"jobs", "job_events", "alembic_version"} <= set(inspect(engine).get_table_names())
    engine.dispose()
    _expect(empty_database_url, tmp_path, "upgrade", code=0, says=f"already at {head}")
    _expect(empty_database_url, tmp_path, "current", code=0, says=f"{head} (head)")


def test_db_upgrade_to_an_older_revision_then_current_says_it_is_behind(
    empty_database_url: str, tmp_path: Path
) -> None:
    _expect(empty_database_url, tmp_path, "upgrade 0001", code=0, says="to 0001")
    _expect(empty_database_url, tmp_path, "current", code=1, says=f"0001; the newest is {head_revision()}")


def test_db_commands_name_an_unreachable_database_without_its_password(tmp_path: Path) -> None:
    url = "postgresql+psycopg://apiary:hunter2-secret@127.0.0.1:1/apiary"
    result = _apiary(url, tmp_path, "db", "upgrade")
    assert result.exit_code == 1
    assert "127.0.0.1:1/apiary" in result.output and "hunter2-secret" not in result.output
    bad = _apiary("nosuchdb://x", tmp_path, "db", "current")
    assert bad.exit_code == 2 and "APIARY_DATABASE_URL" in bad.output


def test_a_service_that_does_not_migrate_refuses_an_old_schema_and_starts_on_the_newest(
    empty_database_url: str, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path / "data", database_url=empty_database_url, migrate_on_start=False)
    runtime = Runtime(settings, backend=FakeBackend(), run_scheduler=False)
    with pytest.raises(SchemaOutOfDate, match="apiary db upgrade"):
        runtime.start()
    runtime.stop()
    engine = build_engine(empty_database_url)
    assert "jobs" not in inspect(engine).get_table_names()  # it did not migrate on its own
    engine.dispose()

    assert _apiary(empty_database_url, tmp_path, "db", "upgrade").exit_code == 0
    runtime = Runtime(settings, backend=FakeBackend(), run_scheduler=False)
    runtime.start()
    try:
        assert runtime.db is not None
        with runtime.db.session() as session:
            assert session.execute(text("SELECT count(*) FROM jobs")).scalar() == 0
    finally:
        runtime.stop()
