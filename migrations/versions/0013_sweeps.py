"""sweeps: the sweeps table, each trial's sweep, number and point on its job, the pruned state

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 07:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

OLD_STATES = ("queued", "admitted", "running", "preempting", "recovering", "succeeded", "failed", "cancelled")
NEW_STATES = (*OLD_STATES, "pruned")
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
    op.create_table(
        "sweeps",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("best_job_id", sa.BigInteger(), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )
    op.create_index("ix_sweeps_state", "sweeps", ["state"])
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("sweep_id", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("trial", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("trial_params", sa.JSON(), nullable=True))
        batch_op.create_foreign_key(
            op.f("fk_jobs_sweep_id_sweeps"), "sweeps", ["sweep_id"], ["id"], ondelete="SET NULL"
        )
        # One job per trial number: two leaders (or a restart) never start a trial twice.
        batch_op.create_index("ix_jobs_sweep_trial", ["sweep_id", "trial"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("ix_jobs_sweep_trial")
        batch_op.drop_constraint(op.f("fk_jobs_sweep_id_sweeps"), type_="foreignkey")
        for column in ("trial_params", "trial", "sweep_id"):
            batch_op.drop_column(column)
    op.drop_index("ix_sweeps_state", table_name="sweeps")
    op.drop_table("sweeps")
    op.execute("DELETE FROM job_events WHERE from_state = 'pruned' OR to_state = 'pruned'")
    op.execute("UPDATE jobs SET state = 'cancelled' WHERE state = 'pruned'")
    _swap_state_checks(OLD_STATES)
