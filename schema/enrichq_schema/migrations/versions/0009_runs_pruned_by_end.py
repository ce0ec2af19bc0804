"""run-log retention counts from a run's end, not its start

A run that lasted longer than the retention (a worker up for 40 days, retention 30) was
deleted by the first retention pass after it ended, together with the stop reason and error
an operator comes to read. Retention now deletes runs that *finished* before the cutoff, so
the old partial index on `started_at` (finished runs only) gives way to one on
`finished_at`. The run log is small (it is pruned), so building the index takes
milliseconds; dropping the old one takes ACCESS EXCLUSIVE on enrichq.runs, which waits
behind any open reader of the run log, and every run-log write waits behind it meanwhile.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 08:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"
OLD = "runs_finished_started_at_idx"
NEW = "runs_finished_at_idx"


def upgrade() -> None:
    """Swap the started_at index of finished runs for one on finished_at."""
    op.create_index(NEW, "runs", ["finished_at"], unique=False, schema=SCHEMA)
    op.drop_index(OLD, table_name="runs", schema=SCHEMA)


def downgrade() -> None:
    """Back to the started_at index of finished runs."""
    op.create_index(
        OLD,
        "runs",
        ["started_at"],
        unique=False,
        schema=SCHEMA,
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    op.drop_index(NEW, table_name="runs", schema=SCHEMA)
