"""run log: a liveness stamp on each run, and the `lost` stop reason

A worker killed with kill -9 never closes its run row, so retention (which prunes runs by
their end) never pruned it: a crash loop added one open row per restart for ever. A run
now carries `seen_at`, its last sign of life (its start, then every heartbeat of its
worker), and the sweeper closes the open runs that went silent with stop reason `lost`,
`finished_at` = their last sign of life.

Open runs made before this revision get `seen_at` = their start, so the sweeper closes
those of dead workers once this release's sweeper runs (and those of live workers of the
previous release too, until they stop: their own stop reason then replaces `lost`).

Locks: ACCESS EXCLUSIVE on enrichq.runs (new column, constraint replaced after a scan of
the small run log), waited for at most `enrichq migrate`'s lock timeout; run-log writes
(each worker's and sweeper pass's start and end) queue behind it meanwhile.

Downgrade: `seen_at` is dropped, and runs closed as `lost` become `error` with their
error text kept (the previous schema has no `lost`).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"
CHECK = "runs_stop_reason_known"
INDEX = "runs_open_seen_at_idx"
REASONS_BEFORE = "'no_work', 'time_budget', 'budget_exhausted', 'shutdown', 'error'"
REASONS_AFTER = f"{REASONS_BEFORE}, 'lost'"


def upgrade() -> None:
    """Add seen_at (open runs: their start) and its index; allow `lost`."""
    op.add_column(
        "runs",
        sa.Column(
            "seen_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        schema=SCHEMA,
    )
    op.execute("UPDATE enrichq.runs SET seen_at = started_at WHERE finished_at IS NULL")
    op.create_index(
        INDEX,
        "runs",
        ["seen_at"],
        unique=False,
        schema=SCHEMA,
        postgresql_where=sa.text("finished_at IS NULL"),
    )
    op.drop_constraint(op.f(CHECK), "runs", schema=SCHEMA, type_="check")
    op.create_check_constraint(
        op.f(CHECK),
        "runs",
        f"stop_reason IS NULL OR stop_reason IN ({REASONS_AFTER})",
        schema=SCHEMA,
    )


def downgrade() -> None:
    """Back to 0009: `lost` runs become `error` (their error text kept); seen_at goes."""
    op.drop_constraint(op.f(CHECK), "runs", schema=SCHEMA, type_="check")
    op.execute("UPDATE enrichq.runs SET stop_reason = 'error' WHERE stop_reason = 'lost'")
    op.create_check_constraint(
        op.f(CHECK),
        "runs",
        f"stop_reason IS NULL OR stop_reason IN ({REASONS_BEFORE})",
        schema=SCHEMA,
    )
    op.drop_index(INDEX, table_name="runs", schema=SCHEMA)
    op.drop_column("runs", "seen_at", schema=SCHEMA)
