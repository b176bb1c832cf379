"""auth_state: whether every request needs an API token (service.auth), persisted once set: a server
that ever had a token keeps requiring one

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 06:45:00
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "auth_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("required", sa.Boolean(), nullable=False),
        sa.Column("required_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_auth_state")),
    )
    # A database that already had a token required auth (while a token was active): it stays required.
    had_token = op.get_bind().execute(sa.text("SELECT COUNT(*) FROM api_tokens")).scalar()
    op.bulk_insert(
        table,
        [
            {
                "id": 1,
                "required": bool(had_token),
                "required_since": datetime.now(UTC) if had_token else None,
                "reason": "an API token existed before this migration" if had_token else None,
            }
        ],
    )


def downgrade() -> None:
    op.drop_table("auth_state")
