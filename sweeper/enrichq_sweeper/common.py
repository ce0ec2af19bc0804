"""What every sweeper task shares: its named SQL, the statement timeout, who is running."""

from __future__ import annotations

import sqlalchemy as sa

from enrichq_schema.db import rerun_lost_races
from enrichq_schema.queries import Queries, load

__all__ = ["retry_races"]
STATEMENT_TIMEOUT_SECONDS_DEFAULT = 30.0
DEFAULT_BATCH_SIZE = 1000


def sql() -> Queries:
    """The sweeper's named statements (sql/sweeper.sql), loaded once per process."""
    return load("enrichq_sweeper", "sql/sweeper.sql")


def set_statement_timeout(conn: sa.Connection, seconds: float) -> None:
    """Limit every later statement of the current transaction to `seconds` (and plan each
    one for its own parameters; see sweeper_statement_timeout)."""
    conn.execute(sql()("sweeper_statement_timeout"), {"timeout_ms": str(int(seconds * 1000))})


# Shared with the queue's own transitions (enrichq_schema.db).
retry_races = rerun_lost_races
