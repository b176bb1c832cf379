"""web_sessions: the web view's logins (service.auth), server-side: the browser's cookie holds a random
session id (only its SHA-256 is stored), not the API token; logout and revocation end it

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 07:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "web_sessions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_hash", sa.String(length=64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["api_tokens.id"],
            name=op.f("fk_web_sessions_token_id_api_tokens"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_web_sessions")),
        sa.UniqueConstraint("session_hash", name=op.f("uq_web_sessions_session_hash")),
    )
    op.create_index(op.f("ix_web_sessions_token_id"), "web_sessions", ["token_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_web_sessions_token_id"), table_name="web_sessions")
    op.drop_table("web_sessions")
