"""queue rows say when work last merged into them; dead letters are indexed by ticket

`merged_at` is set when an event merges into a queued row: a cancel that selected the row
before leaves it queued, so work that arrived after the cancel began survives it. The
dead-letter index on (key, kind, id) serves the dlq verbs' `--key` and the pages their
selection is read in. Adding a nullable column rewrites nothing; the index covers dead
letters only, so building it holds queue writes back for the time it takes to read them.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 16:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"
INDEX = "queue_dead_key_idx"


def upgrade() -> None:
    """Add queue.merged_at and the dead-letter index by ticket."""
    op.add_column(
        "queue", sa.Column("merged_at", sa.DateTime(timezone=True), nullable=True), schema=SCHEMA
    )
    op.create_index(
        INDEX,
        "queue",
        ["key", "kind", "id"],
        unique=False,
        schema=SCHEMA,
        postgresql_where=sa.text("state = 'dead_letter'"),
    )


def downgrade() -> None:
    """Drop them again."""
    op.drop_index(INDEX, table_name="queue", schema=SCHEMA)
    op.drop_column("queue", "merged_at", schema=SCHEMA)
