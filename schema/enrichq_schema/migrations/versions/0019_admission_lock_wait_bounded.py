"""an admission waits a bounded time for the fleet's admission lock, in either pool mode

`enrichq.admission_take` takes the fleet's admission lock and lets it go in one statement,
which the worker runs in autocommit so that no lock outlives it. In session mode the
session's statement timeout bounds its wait for that lock; behind a transaction pooler a
statement in autocommit runs with none of the session settings (they are set per
transaction), so an admission waited for as long as another session held the lock, and
then took a slot its worker had long given up on. The function now bounds the wait
itself (`lock_timeout` in its definition, as long as a lookup waits for a slot, 2 s): past
it the statement fails, changes nothing, and the worker tries again with backoff. (The
bound is per lock wait: the statement's DELETE of expired slots may wait as long again.)
A later revision that replaces the function (CREATE OR REPLACE drops its settings) must
set it again; tests/db/test_admission.py checks that it is there.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 02:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SIGNATURE = (
    "enrichq.admission_take(uuid, text, integer, bigint, bigint, double precision,"
    " timestamptz, integer)"
)
# enrichq_service.worker.admission.ADMISSION_LOCK_WAIT_SECONDS
LOCK_WAIT = "2s"


def upgrade() -> None:
    op.execute(f"ALTER FUNCTION {SIGNATURE} SET lock_timeout = '{LOCK_WAIT}'")


def downgrade() -> None:
    op.execute(f"ALTER FUNCTION {SIGNATURE} RESET lock_timeout")
