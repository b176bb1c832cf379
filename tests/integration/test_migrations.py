from __future__ import annotations

import re

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text

from service.contract.states import JobState
from service.store.db import alembic_config, build_engine, upgrade
from service.store.models import Base


def test_upgrade_of_an_empty_database_matches_the_models(empty_database_url: str) -> None:
    engine = build_engine(empty_database_url)
    upgrade(engine)
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
    assert set(inspect(engine).get_table_names()) >= {"jobs", "job_events", "metrics", "alembic_version"}
    engine.dispose()


def test_upgrade_twice_is_a_no_op(empty_database_url: str) -> None:
    engine = build_engine(empty_database_url)
    upgrade(engine)
    upgrade(engine)
    with engine.connect() as connection:
        found = connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
    head = ScriptDirectory.from_config(alembic_config(None)).get_current_head()
    assert found == head
    # One line of migrations: each revision's number follows its parent's (a branch fails here).
    revisions = list(ScriptDirectory.from_config(alembic_config(None)).walk_revisions())
    assert [r.revision for r in revisions] == [f"{n:04d}" for n in range(len(revisions), 0, -1)]
    engine.dispose()


def test_the_database_state_constraint_matches_the_python_enum(empty_database_url: str) -> None:
    engine = build_engine(empty_database_url)
    upgrade(engine)
    checks = inspect(engine).get_check_constraints("jobs")
    state_check = next(check for check in checks if "state" in check["sqltext"])
    allowed = set(re.findall(r"'([a-z_-]+)'", state_check["sqltext"]))
    assert allowed == {state.value for state in JobState}
    engine.dispose()


def test_the_64_bit_migration_goes_down_and_up_again(empty_database_url: str) -> None:
    engine = build_engine(empty_database_url)
    upgrade(engine)
    command.downgrade(alembic_config(engine), "0006")
    assert step_type(engine) == "INTEGER"
    upgrade(engine)
    assert step_type(engine) == "BIGINT"
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
    engine.dispose()


def step_type(engine: Engine) -> str:
    return next(str(c["type"]) for c in inspect(engine).get_columns("metrics") if c["name"] == "step")
