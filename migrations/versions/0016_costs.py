"""costs: each job's ledger of resource-hours and their cost by the price signal (service.costs)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03 14:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

LEDGER = ("resource_hours", "priced_hours", "cost")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        for name in LEDGER:
            batch_op.add_column(sa.Column(name, sa.Float(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("cost_unit", sa.String(16), nullable=True))
        batch_op.add_column(sa.Column("cost_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("cost_at")
        batch_op.drop_column("cost_unit")
        for name in reversed(LEDGER):
            batch_op.drop_column(name)
