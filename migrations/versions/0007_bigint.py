"""64-bit ids, steps and counters: a long run passes 2**31 steps, and a busy service 2**31 rows

PostgreSQL's `integer` is 32-bit (SQLite's INTEGER is always 64-bit: there only the declared types
change, so that the schema matches the models). A serial primary key's sequence is altered too:
an `integer` sequence stops at 2**31 - 1 whatever its column's type.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 21:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# table -> columns that become BIGINT; the primary keys (`id`) stay INTEGER on SQLite, where only an
# INTEGER PRIMARY KEY is the auto-incrementing rowid.
COLUMNS: dict[str, tuple[str, ...]] = {
    "jobs": (
        "id",
        "attempt",
        "latest_checkpoint_step",
        "queue_position",
        "latest_step",
        "preemptions",
        "restarts",
        "failures",
    ),
    "job_events": ("id", "job_id"),
    "metrics": ("job_id", "attempt", "step", "rank"),
    "checkpoints": ("id", "job_id", "attempt", "step", "delete_attempts"),
    "idempotency_keys": ("job_id",),
}
SEQUENCES = ("jobs_id_seq", "job_events_id_seq", "checkpoints_id_seq")


def _alter(old: type[sa.types.TypeEngine[int]], new: type[sa.types.TypeEngine[int]]) -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for table, columns in COLUMNS.items():
        if sqlite:
            with op.batch_alter_table(table) as batch_op:
                for column in columns:
                    if column != "id":
                        batch_op.alter_column(column, type_=new(), existing_type=old())
        else:
            for column in columns:
                op.alter_column(table, column, type_=new(), existing_type=old())
    if not sqlite:
        kind = "bigint" if new is sa.BigInteger else "integer"
        for sequence in SEQUENCES:
            op.execute(f"ALTER SEQUENCE IF EXISTS {sequence} AS {kind}")


def upgrade() -> None:
    _alter(sa.Integer, sa.BigInteger)


def downgrade() -> None:
    _alter(sa.BigInteger, sa.Integer)
