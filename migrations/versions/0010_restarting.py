"""restarting: when Ray Train began restarting the current worker group (its `worker_failed` event), so
that the hang timeout waits for the new group instead of counting the restart as a hang

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 06:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("restarting_since", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("restarting_since")
