"""code packages: who uploaded which job code package (stored once by its sha256, in storage)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 06:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "code_packages",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", "owner", name=op.f("pk_code_packages")),
    )


def downgrade() -> None:
    op.drop_table("code_packages")
