"""operator controls: the `cancelled` dead reason, the audit log, seen webhook event ids

- `enrichq cancel` moves queued and leased rows to dead_letter with dead_reason
  `cancelled`, so the queue's CHECK on dead reasons allows it. Replacing the check makes
  Postgres read the queue table once (history included) under the migration's ACCESS
  EXCLUSIVE lock, so claims and settles wait for that scan (the whole upgrade took 0.5 s
  on a table of a million rows here), and for as long as the lock itself is waited for.
  A NOT VALID check would skip the scan, but `alembic check` (tests/migrations) then
  fails: SQLAlchemy 2.1 reflects such a constraint with a dialect option that Alembic
  1.20 cannot rebuild.
- `dlq discard/redrive --older-than` reads dead letters through queue_dead_finished_idx,
  which migration 0003 builds (EXPLAIN tests in tests/db/test_controls_plans.py).
- `enrichq.audit_log`: every operator action (cancel, dlq discard, dlq redrive, pause,
  resume), listed by `enrichq audit`.
- `enrichq.seen_events`: webhook event ids seen within ENRICHQ_EVENT_DEDUPE_HOURS, so a
  redelivered event enqueues nothing; pruned by the sweeper's retention pass.

Downgrade loses: the whole audit log (export it first: `enrichq audit --json`), the
webhook event ids seen (a redelivery within ENRICHQ_EVENT_DEDUPE_HOURS is enqueued again:
it merges with a queued row, or enriches the ticket once more), and every cancelled dead
letter (deleted: the older schema has no `cancelled`).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 21:41:57
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEAD_REASON_CHECK = "queue_dead_reason_iff_dead"
DEAD_REASONS_BEFORE = "'attempts_exhausted', 'superseded'"
DEAD_REASONS_AFTER = "'attempts_exhausted', 'superseded', 'cancelled'"


def _dead_reason_check(reasons: str) -> str:
    return (
        "(state = 'dead_letter') = (dead_reason IS NOT NULL)"
        f" AND (dead_reason IS NULL OR dead_reason IN ({reasons}))"
    )


def _replace_dead_reason_check(reasons: str) -> None:
    """Swap the dead-reason CHECK for one allowing exactly `reasons`."""
    op.drop_constraint(op.f(DEAD_REASON_CHECK), "queue", schema="enrichq", type_="check")
    op.create_check_constraint(
        op.f(DEAD_REASON_CHECK), "queue", _dead_reason_check(reasons), schema="enrichq"
    )


def upgrade() -> None:
    """Allow `cancelled`; create the audit log and the seen-event table."""
    _replace_dead_reason_check(DEAD_REASONS_AFTER)
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column(
            "at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("origin", sa.Text(), nullable=False),
        sa.Column("command", sa.Text(), nullable=False),
        sa.Column(
            "filter",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("rows_affected", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column(
            "detail",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("note", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "command IN ('cancel', 'dlq discard', 'dlq redrive', 'pause', 'resume')",
            name=op.f("audit_log_command_known"),
        ),
        sa.CheckConstraint(
            "finished_at IS NULL OR finished_at >= at", name=op.f("audit_log_finished_after_start")
        ),
        sa.CheckConstraint("rows_affected >= 0", name=op.f("audit_log_rows_affected_non_negative")),
        sa.PrimaryKeyConstraint("id", name=op.f("audit_log_pkey")),
        schema="enrichq",
    )
    op.create_table(
        "seen_events",
        sa.Column("event_id", sa.Text(), nullable=False),
        sa.Column(
            "seen_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("queue_id", sa.BigInteger(), nullable=True),
        sa.CheckConstraint(
            "char_length(event_id) BETWEEN 1 AND 200", name=op.f("seen_events_event_id_length")
        ),
        sa.PrimaryKeyConstraint("event_id", name=op.f("seen_events_pkey")),
        schema="enrichq",
    )
    op.create_index(
        "seen_events_seen_at_idx", "seen_events", ["seen_at"], unique=False, schema="enrichq"
    )


def downgrade() -> None:
    """Drop the two tables; the dead-reason CHECK goes back to the two older reasons.

    Cancelled rows cannot satisfy the older check: they are deleted first (they are dead
    letters that nobody is meant to redrive, and the older schema has no word for them).
    """
    op.drop_index("seen_events_seen_at_idx", table_name="seen_events", schema="enrichq")
    op.drop_table("seen_events", schema="enrichq")
    op.drop_table("audit_log", schema="enrichq")
    op.execute(
        "DELETE FROM enrichq.queue WHERE state = 'dead_letter' AND dead_reason = 'cancelled'"
    )
    _replace_dead_reason_check(DEAD_REASONS_BEFORE)
