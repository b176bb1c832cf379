"""spot_nodes: the spot nodes the scheduler has seen, and which left as interruptions (the observed
interruption rate of `checkpoint: {auto: true}`)

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03 17:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "spot_nodes",
        sa.Column("node_id", sa.String(length=128), nullable=False),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("left_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("interrupted", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_spot_nodes")),
    )
    op.create_index(op.f("ix_spot_nodes_left_at"), "spot_nodes", ["left_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_spot_nodes_left_at"), table_name="spot_nodes")
    op.drop_table("spot_nodes")
