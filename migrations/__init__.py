"""Alembic migrations (run by the service at start, or `alembic -c migrations/alembic.ini upgrade head`)."""
