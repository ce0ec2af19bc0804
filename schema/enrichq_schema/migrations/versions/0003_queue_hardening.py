"""queue hardening: claim tokens, one lease per ticket, indexes bounded by what they serve

- `queue.claim_token`: every claim sets a new one; fenced writes match it (an attempt
  number repeats after a defer, a redrive or a claim a server crash undid).
- `queue_leased_key_uq` replaces `queue_leased_key_idx`: one lease per key, whatever the
  kind. A database upgraded from 0002 may hold two leases of one key (the race this closes):
  all but the one whose lease ends last are dead-lettered as superseded by it first, so the
  index can be built; their workers' settles are then refused by the fence, and the kept
  lease enriches the ticket.
- `queue_terminal_finished_idx` (done, failed and dead letters together) is split into
  `queue_finished_idx` (done/failed) and `queue_dead_finished_idx`, so pruning one never
  walks the other; both carry what the terminal counts group by (index-only counts).
- `queue_given_up_key_idx`: refresh's "has the queue given up on this ticket" probe.
- Retention reads the oldest rows of `lookup_log`, `runs` and `tenant_served` by index.
- `queue_counts`: the terminal counts the sweeper writes once a pass and /metrics reads.

Downgrade loses: every claim token, live leases' included. Upgraded again, a lease taken
before the downgrade has no token, so its worker's settle and heartbeat are refused by the
fence: the job is lost, its attempt spent, and the sweeper puts the row back once the
lease expires. The terminal counts are dropped (the next sweeper pass writes them again).
The second leases dead-lettered by the upgrade stay dead letters.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 22:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"
LEASED = "state = 'leased'"
TERMINAL = "state IN ('done', 'failed', 'dead_letter')"
GIVEN_UP = "state = 'failed' OR (state = 'dead_letter' AND dead_reason <> 'superseded')"

# Two leases of one key, from before this revision: keep the one whose lease ends last.
RESOLVE_DOUBLE_LEASES = """
WITH ranked AS (
    SELECT id, first_value(id) OVER (
               PARTITION BY key ORDER BY lease_expires_at DESC, id DESC) AS kept
    FROM enrichq.queue
    WHERE state = 'leased'
)
UPDATE enrichq.queue AS q
SET state = 'dead_letter', dead_reason = 'superseded', superseded_by = r.kept,
    finished_at = now(), updated_at = now(), last_error = 'superseded by a second lease',
    lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
FROM ranked AS r
WHERE q.id = r.id AND r.id <> r.kept
"""


def upgrade() -> None:
    """Add the token and the counts table; swap the indexes. ACCESS EXCLUSIVE on the queue
    (the column, the dropped indexes) and SHARE while the indexes build (open rows only,
    except the two finished-row indexes, built over the retained history): writers queue
    behind it while it waits and while it builds."""
    op.add_column("queue", sa.Column("claim_token", pg.UUID(as_uuid=True)), schema=SCHEMA)
    op.execute(RESOLVE_DOUBLE_LEASES)
    op.drop_index("queue_leased_key_idx", table_name="queue", schema=SCHEMA)
    op.create_index(
        "queue_leased_key_uq",
        "queue",
        ["key"],
        unique=True,
        schema=SCHEMA,
        postgresql_where=sa.text(LEASED),
    )
    op.drop_index("queue_terminal_finished_idx", table_name="queue", schema=SCHEMA)
    op.create_index(
        "queue_finished_idx",
        "queue",
        ["finished_at"],
        schema=SCHEMA,
        postgresql_include=["kind", "state"],
        postgresql_where=sa.text("state IN ('done', 'failed')"),
    )
    op.create_index(
        "queue_dead_finished_idx",
        "queue",
        ["finished_at"],
        schema=SCHEMA,
        postgresql_include=["kind", "dead_reason"],
        postgresql_where=sa.text("state = 'dead_letter'"),
    )
    op.create_index(
        "queue_given_up_key_idx",
        "queue",
        ["key", "id"],
        schema=SCHEMA,
        postgresql_where=sa.text(GIVEN_UP),
    )
    op.create_index("lookup_log_created_at_idx", "lookup_log", ["created_at"], schema=SCHEMA)
    op.create_index(
        "runs_finished_started_at_idx",
        "runs",
        ["started_at"],
        schema=SCHEMA,
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    op.create_index("tenant_served_bucket_idx", "tenant_served", ["bucket"], schema=SCHEMA)
    op.create_table(
        "queue_counts",
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("dead_reason", sa.Text, nullable=False),
        sa.Column("rows", sa.BigInteger, nullable=False),
        sa.Column("counted_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("kind", "state", "dead_reason", name="queue_counts_pkey"),
        schema=SCHEMA,
    )


def downgrade() -> None:
    """Back to 0002 (the dead-lettered second leases stay dead letters)."""
    op.drop_table("queue_counts", schema=SCHEMA)
    op.drop_index("tenant_served_bucket_idx", table_name="tenant_served", schema=SCHEMA)
    op.drop_index("runs_finished_started_at_idx", table_name="runs", schema=SCHEMA)
    op.drop_index("lookup_log_created_at_idx", table_name="lookup_log", schema=SCHEMA)
    op.drop_index("queue_given_up_key_idx", table_name="queue", schema=SCHEMA)
    op.drop_index("queue_dead_finished_idx", table_name="queue", schema=SCHEMA)
    op.drop_index("queue_finished_idx", table_name="queue", schema=SCHEMA)
    op.create_index(
        "queue_terminal_finished_idx",
        "queue",
        ["finished_at"],
        schema=SCHEMA,
        postgresql_where=sa.text(TERMINAL),
    )
    op.drop_index("queue_leased_key_uq", table_name="queue", schema=SCHEMA)
    op.create_index(
        "queue_leased_key_idx",
        "queue",
        ["key"],
        schema=SCHEMA,
        postgresql_where=sa.text(LEASED),
    )
    op.drop_column("queue", "claim_token", schema=SCHEMA)
