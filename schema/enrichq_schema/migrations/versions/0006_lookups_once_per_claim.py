"""lookups once per claim, and the fleet-wide admission of warehouse lookups

- `lookup_log.claim_token` and the unique index on (queue_id, claim_token): a settle that
  runs again after its COMMIT reply was lost records (and charges) each lookup once.
  Rows logged before this revision have no token; NULLs never conflict.
- `lookups_in_flight`: the slots of ENRICHQ_WAREHOUSE_MAX_CONCURRENCY and the bytes
  reserved against ENRICHQ_DAILY_BYTES_BUDGET by lookups running now.

Downgrade loses: the lookups' claim tokens (a settle retried after the downgrade may log
and charge a lookup twice) and the admission slots of lookups running at that moment
(their bytes reserved are forgotten: the day's budget may be overspent by them).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 01:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"


def upgrade() -> None:
    """A nullable column and an index on the lookup log, a small new table."""
    op.add_column("lookup_log", sa.Column("claim_token", pg.UUID(as_uuid=True)), schema=SCHEMA)
    op.create_index(
        "lookup_log_claim_key",
        "lookup_log",
        ["queue_id", "claim_token"],
        unique=True,
        schema=SCHEMA,
    )
    op.create_table(
        "lookups_in_flight",
        sa.Column("token", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("reserved_bytes", sa.BigInteger, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "reserved_bytes >= 0", name="lookups_in_flight_reserved_bytes_non_negative"
        ),
        sa.PrimaryKeyConstraint("token", name="lookups_in_flight_pkey"),
        schema=SCHEMA,
    )


def downgrade() -> None:
    """Back to 0005."""
    op.drop_table("lookups_in_flight", schema=SCHEMA)
    op.drop_index("lookup_log_claim_key", table_name="lookup_log", schema=SCHEMA)
    op.drop_column("lookup_log", "claim_token", schema=SCHEMA)
