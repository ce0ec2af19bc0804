"""What the runtime's threads share about talking to the database: a kept connection, a
capped backoff, and which errors mean "the database is unavailable, try again"."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

BACKOFF_MAX_SECONDS = 5.0


class ThreadConnection:
    """A connection one thread keeps between its transactions (the claim loop's, the
    settler's): no pool checkout, and no ping, per transaction. After any error inside a
    transaction it is closed, so the next transaction starts on a fresh one from the pool
    (which a server restart has then invalidated)."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._conn: sa.Connection | None = None

    @contextlib.contextmanager
    def begin(self) -> Iterator[sa.Connection]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        if self._conn is None:
            self._conn = self._engine.connect()
        try:
            with self._conn.begin():
                yield self._conn
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sa_exc.DBAPIError):
                conn.close()


class Backoff:
    """Capped exponential backoff for trying the database again."""

    def __init__(self) -> None:
        self._n = 0

    def next(self) -> float:
        self._n += 1
        return float(min(BACKOFF_MAX_SECONDS, 0.1 * 2.0**self._n))

    def reset(self) -> None:
        self._n = 0


def is_unavailable(exc: BaseException) -> bool:
    """Whether `exc` says the database could not do the work now (connection lost, server
    starting or stopping, a statement cancelled or timed out), as opposed to refusing it
    (a value it will not store, a constraint): worth the same work again later."""
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(
        exc,
        sa_exc.OperationalError
        | sa_exc.InterfaceError
        | sa_exc.PendingRollbackError
        | sa_exc.TimeoutError,
    )
