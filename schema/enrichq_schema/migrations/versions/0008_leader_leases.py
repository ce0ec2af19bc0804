"""sweeper leadership by a lease row, for transaction pooling

- `leader_leases`: one row per led task (the sweeper's); its owner leads until
  `expires_at`. Used instead of the session advisory lock when ENRICHQ_POOL_MODE is
  `transaction`, where a session does not stay ours between transactions.

Downgrade loses: the lease row of a transaction-mode leader (it takes the leadership again
at its next check, once the table is back).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-10 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"


def upgrade() -> None:
    """One small new table."""
    op.create_table(
        "leader_leases",
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("expires_at > renewed_at", name="leader_leases_expires_after_renewal"),
        sa.PrimaryKeyConstraint("name", name="leader_leases_pkey"),
        schema=SCHEMA,
    )


def downgrade() -> None:
    """Back to 0007."""
    op.drop_table("leader_leases", schema=SCHEMA)
