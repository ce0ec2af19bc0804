"""What every sweeper task shares: its named SQL, the statement timeout, who is running."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import TypeVar

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from enrichq_schema.errors import constraint_name
from enrichq_schema.queries import Queries, load

QUEUED_KEY_INDEX = "queue_queued_key_uq"
# A batch that loses a race to another transaction is run again this often; each retry
# sees the other transaction's committed work.
RACE_RETRIES = 5
STATEMENT_TIMEOUT_SECONDS_DEFAULT = 30.0
DEFAULT_BATCH_SIZE = 1000

T = TypeVar("T")


def sql() -> Queries:
    """The sweeper's named statements (sql/sweeper.sql), loaded once per process."""
    return load("enrichq_sweeper", "sql/sweeper.sql")


def owner_id() -> str:
    """This process as the run log names it: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def set_statement_timeout(conn: sa.Connection, seconds: float) -> None:
    """Limit every later statement of the current transaction to `seconds` (and plan each
    one for its own parameters; see sweeper_statement_timeout)."""
    conn.execute(sql()("sweeper_statement_timeout"), {"timeout_ms": str(int(seconds * 1000))})


class RaceLost(Exception):
    """A row changed under a batch statement after its snapshot; the statement runs again."""


def retry_races(conn: sa.Connection, statement: Callable[[], T]) -> T:
    """Run `statement` in a savepoint, again when it lost a race to another transaction.

    Two races are expected and short. A statement that puts a row back in the queue sees
    the key's queued row when it was committed before the statement's snapshot; one
    committed after shows up as a violation of the queued-key index instead. And a batch
    that decides on its snapshot raises RaceLost when a row it meant to write changed in
    the meantime. Running the statement again gives it a snapshot that sees the other
    transaction's work.
    """
    for attempt in range(RACE_RETRIES):
        try:
            with conn.begin_nested():
                return statement()
        except sa_exc.IntegrityError as exc:
            if constraint_name(exc) != QUEUED_KEY_INDEX or attempt == RACE_RETRIES - 1:
                raise
        except RaceLost:
            if attempt == RACE_RETRIES - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover
