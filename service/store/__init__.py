"""The database: the engine (`db`), the ORM models (`models`) and the repository, the only code that
opens a session. The Alembic environment and the migrations stay at the top level (`migrations/`, fixed
by the product brief), and upgrade these models."""
