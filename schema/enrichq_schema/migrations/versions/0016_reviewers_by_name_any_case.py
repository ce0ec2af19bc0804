"""one approval per reviewer and run, the reviewer's name compared in any case

`--by alice` and `--by Alice` were two reviewers. Each approval now carries its reviewer's
name case-folded (`reviewer_key`, filled by enrichq; old rows get the database's lower()),
unique per run in place of the name itself. Approvals that only the case of the name told
apart are merged first, keeping the earliest (its time and note).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 17:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"
TABLE = "parity_approvals"
OLD = "parity_approvals_parity_run_id_approved_by_key"
NEW = "parity_approvals_parity_run_id_reviewer_key_key"


def upgrade() -> None:
    op.add_column(TABLE, sa.Column("reviewer_key", sa.Text(), nullable=True), schema=SCHEMA)
    op.execute(f"UPDATE {SCHEMA}.{TABLE} SET reviewer_key = lower(approved_by)")
    op.execute(
        f"DELETE FROM {SCHEMA}.{TABLE} AS a USING {SCHEMA}.{TABLE} AS b"
        " WHERE a.parity_run_id = b.parity_run_id AND a.reviewer_key = b.reviewer_key"
        " AND a.id > b.id"
    )
    op.alter_column(TABLE, "reviewer_key", nullable=False, schema=SCHEMA)
    op.drop_constraint(OLD, TABLE, schema=SCHEMA, type_="unique")
    op.create_unique_constraint(NEW, TABLE, ["parity_run_id", "reviewer_key"], schema=SCHEMA)


def downgrade() -> None:
    # names unique in any case are unique as they are: nothing is lost but the key
    op.drop_constraint(NEW, TABLE, schema=SCHEMA, type_="unique")
    op.create_unique_constraint(OLD, TABLE, ["parity_run_id", "approved_by"], schema=SCHEMA)
    op.drop_column(TABLE, "reviewer_key", schema=SCHEMA)
