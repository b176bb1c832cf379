"""report tokens: the sha256 of the current attempt's report token, which its telemetry must carry

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 21:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
# 0007 and 0008 come from other branches; the merge relinks this one after them.
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("report_token_hash", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("report_token_hash")
