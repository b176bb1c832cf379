"""node drains: nodes an admin said are going away, and each job's checkpoint write time (service.drains)

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03 17:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_drains",
        sa.Column("node_id", sa.String(length=128), nullable=False),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("requested_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_node_drains")),
    )
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("checkpoint_write_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("checkpoint_write_s")
    op.drop_table("node_drains")
