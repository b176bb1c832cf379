"""plateau: where a job's watched metric stands (service.plateau), so that every API replica judges
its telemetry alike and a restarted service forgets nothing

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03 10:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("plateau", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("plateau")
