"""checkpoints: one row per reported checkpoint, with its step metrics and its retention state

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 03:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "kept",
                "deleting",
                "deleted",
                name="checkpoint_state",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("retention_due", sa.Boolean(), nullable=False),
        sa.Column("delete_attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_checkpoints_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("job_id", "uri", name="uq_checkpoints_job_uri"),
    )
    with op.batch_alter_table("checkpoints") as batch_op:
        batch_op.create_index("ix_checkpoints_job_step", ["job_id", "step"], unique=False)
        batch_op.create_index(batch_op.f("ix_checkpoints_retention_due"), ["retention_due"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoints_retention_due"))
        batch_op.drop_index("ix_checkpoints_job_step")
    op.drop_table("checkpoints")
