"""queue rows may have reason `reconcile`

The sweeper's reconcile pass enqueues the tickets the help desk changed without an event
reaching enrichq; their rows say so. The check is added NOT VALID and validated after, so
the queue is not locked against writes while its rows are read.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05 07:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"
CHECK = "queue_reason_known"
REASONS_BEFORE = "'created', 'updated', 'refresh', 'redrive', 'manual'"
REASONS_AFTER = f"{REASONS_BEFORE}, 'reconcile'"


def _check(reasons: str) -> None:
    op.drop_constraint(op.f(CHECK), "queue", schema=SCHEMA, type_="check")
    op.execute(
        f"ALTER TABLE {SCHEMA}.queue ADD CONSTRAINT {CHECK} CHECK (reason IN ({reasons})) NOT VALID"
    )
    op.execute(f"ALTER TABLE {SCHEMA}.queue VALIDATE CONSTRAINT {CHECK}")


def upgrade() -> None:
    """Allow `reconcile`."""
    _check(REASONS_AFTER)


def downgrade() -> None:
    """Back to 0016: reconciled rows become `manual` (an enqueue nobody's event asked for)."""
    op.drop_constraint(op.f(CHECK), "queue", schema=SCHEMA, type_="check")
    op.execute(f"UPDATE {SCHEMA}.queue SET reason = 'manual' WHERE reason = 'reconcile'")
    op.execute(
        f"ALTER TABLE {SCHEMA}.queue ADD CONSTRAINT {CHECK}"
        f" CHECK (reason IN ({REASONS_BEFORE})) NOT VALID"
    )
    op.execute(f"ALTER TABLE {SCHEMA}.queue VALIDATE CONSTRAINT {CHECK}")
