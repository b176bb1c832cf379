"""two queues: the preempting state, waiting decisions and progress on jobs, the scheduler lease, owner usage

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

OLD_STATES = ("queued", "admitted", "running", "succeeded", "failed", "cancelled")
NEW_STATES = ("queued", "admitted", "running", "preempting", "succeeded", "failed", "cancelled")
# (table, column, the CHECK constraint the models' Enum creates)
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
        batch_op.add_column(sa.Column("queue_position", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("waiting_reason", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("eta_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("latest_step", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("seconds_per_step", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("last_checkpoint_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("stop_requested", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("stop_requested_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("preemptions", sa.Integer(), server_default="0", nullable=False))
    op.create_table(
        "scheduler_leases",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_scheduler_leases")),
    )
    op.create_table(
        "owner_usage",
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("usage", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_owner_usage")),
    )


def downgrade() -> None:
    op.drop_table("owner_usage")
    op.drop_table("scheduler_leases")
    with op.batch_alter_table("jobs") as batch_op:
        for column in (
            "preemptions",
            "stop_requested_at",
            "stop_requested",
            "last_checkpoint_at",
            "seconds_per_step",
            "latest_step",
            "eta_at",
            "waiting_reason",
            "queue_position",
        ):
            batch_op.drop_column(column)
    _swap_state_checks(OLD_STATES)
