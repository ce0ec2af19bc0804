"""What every sweeper task shares: its named SQL, the statement timeout, who is running."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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


# What the run log leaves out of a pass's result: it records a duration of its own, and a
# stopped pass shows in its stop reason.
_NOT_COUNTED = frozenset({"duration_seconds", "stopped"})


@dataclass(frozen=True, slots=True)
class BatchedPass:
    """How a pass that works in bounded batches went (the counts are its subclass's)."""

    batches: int = 0
    duration_seconds: float = 0.0
    # the longest a batch held its row locks, from its write's first lock to its commit
    max_batch_seconds: float = 0.0
    stopped: bool = False

    def counts(self) -> dict[str, float]:
        """The figures the pass's run-log row records: every count, and the longest batch."""
        values: dict[str, float] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _NOT_COUNTED
        }
        values["max_batch_seconds"] = round(self.max_batch_seconds, 6)
        return values
