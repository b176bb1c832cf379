"""`apiary db`: the database schema (Alembic), as its own deployment step.

    apiary db upgrade          # bring APIARY_DATABASE_URL's schema to the newest revision
    apiary db current          # the revision it is at, and whether that is the newest

The service upgrades the schema itself when it starts (`APIARY_MIGRATE_ON_START`, on by default, which
suits the embedded SQLite). A deployment with several replicas runs `apiary db upgrade` once before it
rolls out a new version and starts the replicas with `APIARY_MIGRATE_ON_START=false`; they then refuse a
schema that is not at the newest revision instead of racing to migrate it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console

from service.contract.errors import one_line

if TYPE_CHECKING:
    # Imported where used: the client commands' `apiary` loads no database code (api/cli.py).
    from sqlalchemy import Engine
    from sqlalchemy.exc import SQLAlchemyError

    from service.settings import Settings

console = Console(soft_wrap=True)


def register(app: typer.Typer, *, load_settings: Callable[[], Settings]) -> None:
    db_app = typer.Typer(help="The database schema: upgrade it, or show its revision.", no_args_is_help=True)
    app.add_typer(db_app, name="db")

    @db_app.command("upgrade")
    def upgrade(
        revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    ) -> None:
        """Migrate APIARY_DATABASE_URL's schema to REVISION (default: the newest)."""
        settings = load_settings()
        from sqlalchemy.exc import SQLAlchemyError

        from api.logformat import configure_logging
        from service.store import db

        configure_logging(settings.log_format)  # each migration it runs is a log line
        engine = _engine(settings)
        try:
            before = db.current_revision(engine)
            db.upgrade(engine, revision)
            after = db.current_revision(engine)
        except SQLAlchemyError as err:
            _fail(settings, err)
        finally:
            engine.dispose()
        if before == after:
            console.print(f"{_where(settings)}: already at {after}")
        else:
            console.print(f"{_where(settings)}: upgraded from {before or 'an empty database'} to {after}")

    @db_app.command("current")
    def current() -> None:
        """Print the schema's revision and whether it is the newest (exit 1 if it is not)."""
        settings = load_settings()
        from sqlalchemy.exc import SQLAlchemyError

        from service.store import db

        engine = _engine(settings)
        try:
            revision = db.current_revision(engine)
        except SQLAlchemyError as err:
            _fail(settings, err)
        finally:
            engine.dispose()
        head = db.head_revision()
        if revision == head:
            console.print(f"{_where(settings)}: {revision} (head)")
            return
        console.print(
            f"{_where(settings)}: {revision or 'empty'}; the newest is {head}: run `apiary db upgrade`"
        )
        raise typer.Exit(1)


def _engine(settings: Settings) -> Engine:
    from sqlalchemy.exc import SQLAlchemyError

    from service.store import db

    try:
        return db.build_engine(settings.resolved_database_url)
    except (SQLAlchemyError, ValueError) as err:  # a malformed URL, an unknown driver
        console.print(f"[red]error:[/] APIARY_DATABASE_URL: {one_line(err)}")
        raise typer.Exit(2) from None


def _where(settings: Settings) -> str:
    """The database, without its password."""
    from sqlalchemy.engine import make_url

    return make_url(settings.resolved_database_url).render_as_string(hide_password=True)


def _fail(settings: Settings, err: SQLAlchemyError) -> NoReturn:
    console.print(f"[red]error:[/] {_where(settings)}: {one_line(err.__cause__ or err)}")
    raise typer.Exit(1)
