"""Engine, sessions and migrations. Repository code takes a Session; callers own the transaction."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

import migrations
from service.contract.errors import DatabaseUnavailable, SchemaOutOfDate, one_line

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(migrations.__file__).parent


def build_engine(url: str, *, pool_size: int = 5) -> Engine:
    """An engine for `url`; on PostgreSQL, a pool of `pool_size` connections (and 10 more at a peak)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=10)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets the API read while the scheduler writes; foreign keys are off by default in SQLite.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def alembic_config(engine: Engine | None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if engine is not None:
        config.attributes["engine"] = engine
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database schema to `revision` (the service does this at start)."""
    command.upgrade(alembic_config(engine), revision)
    logger.info("database upgraded", extra={"action": "db_upgraded", "revision": revision})


def head_revision() -> str:
    """The newest revision this version of Apiary ships."""
    head = ScriptDirectory.from_config(alembic_config(None)).get_current_head()
    assert head is not None, "migrations/versions has one head"
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; None for an empty (never migrated) database."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def require_head(engine: Engine) -> None:
    """Refuse a schema that is not the one this code expects (when the service does not migrate)."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise SchemaOutOfDate(
            f"the database schema is at revision {current or 'none (empty database)'}, this Apiary "
            f"needs {head}: run `apiary db upgrade` first (or set APIARY_MIGRATE_ON_START=true)"
        )


class Database:
    def __init__(self, url: str, *, pool_size: int = 5) -> None:
        self.url = url
        self.engine = build_engine(url, pool_size=pool_size)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One unit of work: commits on success, rolls back on any error."""
        with self._sessions() as session, session.begin():
            yield session

    def wait(self, timeout_s: float, *, first_delay_s: float = 0.25, max_delay_s: float = 5.0) -> None:
        """Return once the database answers, retrying with exponential backoff for up to `timeout_s`
        (an orchestrator may start the service before its database); then DatabaseUnavailable."""
        deadline = time.monotonic() + timeout_s
        delay = first_delay_s
        while True:
            try:
                with self.engine.connect() as connection:
                    connection.execute(text("SELECT 1"))
                return
            except DBAPIError as err:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DatabaseUnavailable(
                        f"the database did not answer within {timeout_s:g} s: {one_line(err.orig or err)}"
                    ) from err
                logger.warning(
                    "waiting for the database (%s); retrying in %.1f s",
                    type(err.orig).__name__,
                    min(delay, left),
                    extra={"action": "database_wait"},
                )
                time.sleep(min(delay, left))
                delay = min(delay * 2, max_delay_s)

    def ping(self) -> None:
        """One round trip (`SELECT 1`); raises what the driver raises when the database does not answer."""
        with self.session() as session:
            session.execute(text("SELECT 1"))

    def upgrade(self) -> None:
        upgrade(self.engine)

    def require_head(self) -> None:
        require_head(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()
