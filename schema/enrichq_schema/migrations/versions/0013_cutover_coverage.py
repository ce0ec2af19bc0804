"""parity runs record what they read; a backfill kind of work

A parity run now records the time its data is as of (`data_at`: a standby's last replayed
commit, else the database clock), how far a standby's replay was behind
(`replica_lag_seconds`), and per tenant what the shadow table held and how many tickets
consumers can read that enrichq never enriched (`coverage`): the cutover gate refuses a run
on stale data and checks the shadow table still holds what the run saw. `enrichq backfill`
enqueues work of a new kind, `backfill`, which pauses and the audit log name too. Adding
nullable columns and swapping two CHECK constraints on small tables is instant.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 16:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"
KINDS_BEFORE = "'enrich', 'refresh'"
KINDS_AFTER = "'enrich', 'refresh', 'backfill'"
COMMANDS_BEFORE = "'cancel', 'dlq discard', 'dlq redrive', 'pause', 'resume'"
COMMANDS_AFTER = f"{COMMANDS_BEFORE}, 'backfill'"
PAUSES_CHECK_0007 = "pauses_pauses_kind_known"
PAUSES_CHECK = "pauses_kind_known"


def _checks(kinds: str, commands: str, *, pauses_from: str, pauses_to: str) -> None:
    op.drop_constraint(op.f(pauses_from), "pauses", schema=SCHEMA, type_="check")
    op.create_check_constraint(
        op.f(pauses_to), "pauses", f"kind IS NULL OR kind IN ({kinds})", schema=SCHEMA
    )
    op.drop_constraint(op.f("audit_log_command_known"), "audit_log", schema=SCHEMA, type_="check")
    op.create_check_constraint(
        op.f("audit_log_command_known"), "audit_log", f"command IN ({commands})", schema=SCHEMA
    )


def upgrade() -> None:
    """Add what a parity run read; allow the backfill kind and command."""
    op.add_column("parity_runs", sa.Column("data_at", sa.DateTime(timezone=True)), schema=SCHEMA)
    op.add_column("parity_runs", sa.Column("replica_lag_seconds", sa.Float()), schema=SCHEMA)
    op.add_column(
        "parity_runs",
        sa.Column("coverage", postgresql.JSONB(astext_type=sa.Text())),
        schema=SCHEMA,
    )
    # 0007 named the pauses' check pauses_pauses_kind_known; it gets its declared name
    _checks(KINDS_AFTER, COMMANDS_AFTER, pauses_from=PAUSES_CHECK_0007, pauses_to=PAUSES_CHECK)


def downgrade() -> None:
    """Drop them again (backfill rows and audit rows must be gone first)."""
    op.execute("DELETE FROM enrichq.pauses WHERE kind = 'backfill'")
    _checks(KINDS_BEFORE, COMMANDS_BEFORE, pauses_from=PAUSES_CHECK, pauses_to=PAUSES_CHECK_0007)
    op.drop_column("parity_runs", "coverage", schema=SCHEMA)
    op.drop_column("parity_runs", "replica_lag_seconds", schema=SCHEMA)
    op.drop_column("parity_runs", "data_at", schema=SCHEMA)
