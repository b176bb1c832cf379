"""credentials tokens: each attempt's single-use fetch token for the job's S3 credentials (its hash)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03 14:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("credentials_token_hash", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("credentials_redeemed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("credentials_redeemed_at")
        batch_op.drop_column("credentials_token_hash")
