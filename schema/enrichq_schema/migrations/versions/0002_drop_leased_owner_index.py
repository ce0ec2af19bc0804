"""drop queue_leased_owner_idx

Every claimed row was written to four indexes (the primary key and three over leased rows).
No statement reads leases by owner alone: the heartbeat and the settles look their rows up
by id, the sweeper by expiry, the claim's live-lease probe by key. Dropping the owner index
removes one index write per claimed row. This is a plain DROP INDEX: an ACCESS EXCLUSIVE
lock on the queue table. Once it has the lock it takes milliseconds, but while it waits for
the lock (behind any open reader of the queue: a pg_dump, an idle psql) every claim,
heartbeat and settle queues behind it; `enrichq migrate` bounds that wait with a short
lock_timeout and tries again (enrichq_schema.db.migrate).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 08:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEX = "queue_leased_owner_idx"


def upgrade() -> None:
    """Drop the index (ACCESS EXCLUSIVE on the queue: every claim waits while it waits)."""
    op.drop_index(INDEX, table_name="queue", schema="enrichq")


def downgrade() -> None:
    """Build it again."""
    op.create_index(
        INDEX,
        "queue",
        ["lease_owner"],
        unique=False,
        schema="enrichq",
        postgresql_where=sa.text("state = 'leased'"),
    )
