"""recovery: the recovering state, restart and failure counts on jobs, metrics keyed by worker-group segment

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 04:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

OLD_STATES = ("queued", "admitted", "running", "preempting", "succeeded", "failed", "cancelled")
NEW_STATES = ("queued", "admitted", "running", "preempting", "recovering", "succeeded", "failed", "cancelled")
STATE_COLUMNS = (
    ("jobs", "state", "ck_jobs_job_state"),
    ("job_events", "from_state", "ck_job_events_job_event_from_state"),
    ("job_events", "to_state", "ck_job_events_job_event_to_state"),
)


def _swap_state_checks(states: tuple[str, ...]) -> None:
    allowed = ", ".join(f"'{state}'" for state in states)
    for table, column, constraint in STATE_COLUMNS:
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_constraint(op.f(constraint), type_="check")
            batch_op.create_check_constraint(op.f(constraint), f"{column} IN ({allowed})")


def upgrade() -> None:
    _swap_state_checks(NEW_STATES)
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("restarts", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("failures", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("segment", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("metrics") as batch_op:
        batch_op.add_column(sa.Column("segment", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.drop_constraint("uq_metrics_point", type_="unique")
        batch_op.create_unique_constraint(
            "uq_metrics_point", ["job_id", "attempt", "segment", "rank", "step"]
        )


def downgrade() -> None:
    with op.batch_alter_table("metrics") as batch_op:
        batch_op.drop_constraint("uq_metrics_point", type_="unique")
        batch_op.create_unique_constraint("uq_metrics_point", ["job_id", "attempt", "rank", "step"])
        batch_op.drop_column("segment")
    with op.batch_alter_table("jobs") as batch_op:
        for column in ("segment", "failures", "restarts"):
            batch_op.drop_column(column)
    _swap_state_checks(OLD_STATES)
