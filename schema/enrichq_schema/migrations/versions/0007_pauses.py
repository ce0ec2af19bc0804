"""pauses: claims stopped by an operator, per kind and tenant

- `pauses`: one row per scope (a kind, a tenant, both or neither; NULL matches all),
  written by `enrichq pause`, deleted by `enrichq resume`, read by every claim.

Downgrade: refused while any pause is in force (see `downgrade`), so no pause is lost.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 04:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"


def upgrade() -> None:
    """A small new table."""
    op.create_table(
        "pauses",
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("kind", sa.Text),
        sa.Column("tenant", sa.Text),
        sa.Column("reason", sa.Text),
        sa.Column("paused_by", sa.Text, nullable=False),
        sa.Column(
            "paused_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.CheckConstraint(
            "kind IS NULL OR kind IN ('enrich', 'refresh')", name="pauses_kind_known"
        ),
        sa.PrimaryKeyConstraint("id", name="pauses_pkey"),
        sa.UniqueConstraint(
            "kind", "tenant", name="pauses_kind_tenant_key", postgresql_nulls_not_distinct=True
        ),
        schema=SCHEMA,
    )


def downgrade() -> None:
    """Back to 0006; refused while a pause is in force (the older schema would drop it
    and every claim would go through again, unannounced)."""
    paused = op.get_bind().execute(sa.text("SELECT count(*) FROM enrichq.pauses")).scalar_one()
    if paused:
        raise RuntimeError(
            f"{paused} pause(s) in force (`enrichq status` lists them): the schema below 0007 "
            "cannot keep them; run `enrichq resume` for each (or wait) before downgrading "
            "below 0007"
        )
    op.drop_table("pauses", schema=SCHEMA)
