"""Alembic environment: uses the engine the service hands over, or APIARY_DATABASE_URL."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine

from service.store.models import Base


def _engine() -> Engine:
    engine = context.config.attributes.get("engine")
    if engine is not None:
        return engine
    from service.settings import Settings
    from service.store.db import build_engine

    return build_engine(Settings().resolved_database_url)


def run_migrations_online() -> None:
    with _engine().connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


run_migrations_online()
