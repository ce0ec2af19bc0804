"""How an engine's sessions get their settings per pool mode (session or transaction
pooling), and how long a connection may wait for the server."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import psycopg
import psycopg.errors
import sqlalchemy as sa
from psycopg.abc import PQGen
from sqlalchemy.engine import ExecutionContext

from enrichq_schema.queries import load
from enrichq_schema.states import PoolMode

__all__ = [
    "WITHOUT_SETTINGS",
    "BoundedConnection",
    "NoReply",
    "PoolMode",
    "install",
    "longer_replies",
    "network_params",
]

log = logging.getLogger(__name__)
RV = TypeVar("RV")

# Keepalive probes sent before an idle connection is declared dead.
KEEPALIVE_PROBES = 3
# libpq treats a connect_timeout under 2 s as 2 s.
CONNECT_TIMEOUT_MIN_SECONDS = 2
# An execution option: this statement runs in autocommit without the engine's settings on
# purpose (it bounds itself), so transaction mode has nothing to warn about.
WITHOUT_SETTINGS = "enrichq_without_settings"
# How often a wait wakes up to let Python handle signals (psycopg's own default).
WAIT_INTERVAL_SECONDS = 0.1


class NoReply(psycopg.OperationalError):
    """The server did not answer in time; the connection was closed."""


class _NeverRaised(Exception):
    """Stands in for psycopg's wait timeout where a psycopg version has none."""


# What psycopg raises when Connection.wait(timeout=...) runs out (psycopg 3.3's name;
# tests/db/test_network_timeouts.py fails if an upgrade renames it).
WAIT_TIMEOUT: type[Exception] = getattr(psycopg.errors, "_WaitTimeout", _NeverRaised)


def _sql() -> Any:
    return load("enrichq_schema", "sql/session.sql")


def network_params(timeout_seconds: float) -> dict[str, object]:
    """libpq connection options that notice a dead network within about `timeout_seconds`.

    Keepalives: an idle connection is probed after half the timeout, then every
    (timeout / 2) / probes seconds, and dropped after that many unanswered probes.
    `tcp_user_timeout`: data the peer does not acknowledge for the timeout drops the
    connection (keepalives alone never fire while data is in flight). `connect_timeout`:
    the same bound on connecting, per host of a multi-host URL.
    """
    idle = max(1, math.ceil(timeout_seconds / 2))
    interval = max(1, math.ceil(timeout_seconds / 2 / KEEPALIVE_PROBES))
    return {
        "keepalives": 1,
        "keepalives_idle": idle,
        "keepalives_interval": interval,
        "keepalives_count": KEEPALIVE_PROBES,
        "tcp_user_timeout": max(1, int(timeout_seconds * 1000)),
        "connect_timeout": max(CONNECT_TIMEOUT_MIN_SECONDS, math.ceil(timeout_seconds)),
    }


class BoundedConnection(psycopg.Connection[Any]):
    """A psycopg connection that waits at most `reply_timeout` seconds for any one exchange
    with the server (a statement and its reply, a commit). Past it the connection is closed
    and the call fails like a lost connection (SQLAlchemy then discards it from its pool).

    Waits that carry their own timeout (`notifies(timeout=…)`) keep it."""

    reply_timeout: float | None = None

    def wait(
        self, gen: PQGen[RV], interval: float = WAIT_INTERVAL_SECONDS, timeout: float | None = None
    ) -> RV:
        bound = self.reply_timeout
        if timeout is not None or bound is None:
            return super().wait(gen, interval, timeout)
        try:
            return super().wait(gen, interval, bound)
        except WAIT_TIMEOUT:
            # Mid-exchange: the protocol state is unknown, so the connection is unusable.
            self.close()
            raise NoReply(
                f"no reply from the database within {bound:g} s; connection closed"
            ) from None


@contextlib.contextmanager
def longer_replies(conn: sa.Connection, seconds: float) -> Iterator[None]:
    """Within the block, `conn` waits `seconds` longer for each reply than its engine's
    bound: for a statement that sets itself a statement timeout that much longer than the
    engine's (a connection without a bound is left as it is)."""
    dbapi_connection = conn.connection.dbapi_connection
    bound = getattr(dbapi_connection, "reply_timeout", None)
    if not isinstance(dbapi_connection, BoundedConnection) or bound is None:
        yield
        return
    dbapi_connection.reply_timeout = bound + seconds
    try:
        yield
    finally:
        dbapi_connection.reply_timeout = bound


def install(
    engine: sa.Engine,
    mode: PoolMode,
    settings: Mapping[str, str],
    *,
    reply_timeout_seconds: float | None = None,
    optional: frozenset[str] = frozenset(),
) -> None:
    """Make `engine`'s sessions run with `settings` (server parameters) the way `mode`
    allows, and bound every wait for the server by `reply_timeout_seconds` (None: none).

    A setting named in `optional` is a safeguard the sessions can do without: where the
    server refuses its value, the engine's first connection finds out, says so once, and
    every session goes on without it. Any other refused setting fails the connection.
    """
    if reply_timeout_seconds is not None:
        bound = reply_timeout_seconds

        @sa.event.listens_for(engine, "do_connect")
        def _bounded(dialect: Any, record: Any, cargs: Any, cparams: Any) -> Any:
            conn = BoundedConnection.connect(*cargs, **cparams)
            conn.reply_timeout = bound
            return conn

    if not settings:
        return
    local = mode is PoolMode.TRANSACTION
    applied = _Settings(engine, dict(settings), optional, local=local)

    if mode is PoolMode.SESSION:

        @sa.event.listens_for(engine, "connect")
        def _apply_once(dbapi_connection: Any, record: Any) -> None:
            applied.check(dbapi_connection)
            with dbapi_connection.cursor() as cursor:
                cursor.execute(applied.statement, applied.params)
            if not dbapi_connection.autocommit:
                dbapi_connection.commit()

        return

    @sa.event.listens_for(engine, "connect")
    def _check(dbapi_connection: Any, record: Any) -> None:
        applied.check(dbapi_connection)

    # DBAPI connections whose transaction has begun without its settings yet (weakly held:
    # a connection the pool throws away leaves by itself)
    pending: weakref.WeakSet[Any] = weakref.WeakSet()

    @sa.event.listens_for(engine, "begin")
    def _pending(conn: sa.Connection) -> None:
        pending.add(conn.connection.dbapi_connection)

    def _apply_first(cursor: Any, context: ExecutionContext) -> None:
        dbapi_connection = cursor.connection
        first = dbapi_connection in pending
        pending.discard(dbapi_connection)
        if dbapi_connection.autocommit:
            # each statement is a transaction of its own, and a setting made in one is gone
            # before the next: it runs with the server's defaults (a plug-in's own query on
            # a connection it set to AUTOCOMMIT, say: no statement timeout of the deadline)
            if not context.execution_options.get(WITHOUT_SETTINGS):
                applied.autocommit_seen()
        elif first:
            # the same server transaction as the statement that follows
            cursor.execute(applied.statement, applied.params)

    @sa.event.listens_for(engine, "do_execute", retval=True)
    def _execute(cursor: Any, statement_: str, parameters: Any, context: ExecutionContext) -> bool:
        _apply_first(cursor, context)
        return False

    @sa.event.listens_for(engine, "do_executemany", retval=True)
    def _executemany(
        cursor: Any, statement_: str, parameters: Any, context: ExecutionContext
    ) -> bool:
        _apply_first(cursor, context)
        return False

    @sa.event.listens_for(engine, "do_execute_no_params", retval=True)
    def _execute_no_params(cursor: Any, statement_: str, context: ExecutionContext) -> bool:
        _apply_first(cursor, context)
        return False


class _Settings:
    """An engine's session settings as one `session_apply` statement, less the optional
    ones its server refused (found out on the engine's first connection)."""

    def __init__(
        self, engine: sa.Engine, settings: dict[str, str], optional: frozenset[str], *, local: bool
    ) -> None:
        self._compiled = _sql()("session_apply").compile(dialect=engine.dialect)
        self.statement: str = self._compiled.string
        self._settings = settings
        self._untried = {name: settings[name] for name in optional if name in settings}
        self._local = local
        self._lock = threading.Lock()
        self._autocommit_said = False
        self._checked = False
        self.params: Any = self._params(settings, local=local)

    def _params(self, settings: Mapping[str, str], *, local: bool) -> Any:
        names, values = list(settings), list(settings.values())
        return self._compiled.construct_params({"names": names, "values": values, "local": local})

    def autocommit_seen(self) -> None:
        """Say once that a statement of this engine ran without its settings (not the
        dialect's own, which it runs before the first connection is handed out)."""
        if self._autocommit_said or not self._checked:
            return
        self._autocommit_said = True
        log.warning(
            "ENRICHQ_POOL_MODE=transaction: a statement in autocommit runs without enrichq's "
            "session settings (%s); run it in a transaction to have them",
            ", ".join(self._settings),
        )

    def check(self, dbapi_connection: Any) -> None:
        """Try each optional setting not tried yet in a transaction of its own, rolled back;
        leave out those the server refuses."""
        self._checked = True
        if not self._untried:
            return
        with self._lock:
            for name, value in list(self._untried.items()):
                try:
                    with dbapi_connection.cursor() as cursor:
                        cursor.execute(self.statement, self._params({name: value}, local=True))
                except psycopg.DatabaseError as exc:
                    if not _refused(exc):
                        raise
                    del self._settings[name]
                    log.warning(
                        "the database refuses %s = %s, so enrichq's sessions run without it: %s",
                        name,
                        value,
                        str(exc).splitlines()[0],
                    )
                finally:
                    if not dbapi_connection.autocommit:
                        dbapi_connection.rollback()
                del self._untried[name]
            self.params = self._params(self._settings, local=self._local)


def _refused(exc: psycopg.DatabaseError) -> bool:
    """Is `exc` the server refusing a setting's value (not a lost connection, say)?"""
    return isinstance(
        exc, psycopg.errors.InvalidParameterValue | psycopg.errors.CantChangeRuntimeParam
    )


# How many times the pooler probe looks: under load a pooler may happen to serve both
# connections from separate sessions once; three misses in a row are unlikely.
PROBE_ROUNDS = 3


def transaction_pooled(engine: sa.Engine, rounds: int = PROBE_ROUNDS) -> str | None:
    """Evidence that `engine` reaches its server through a transaction (or statement)
    pooler, or None when none was seen.

    `engine` must be in autocommit, so each statement is a transaction of its own. Two
    client connections, A and B, ask which server process runs their statement: A, then B,
    then A again. A direct connection, and a session pooler, keep one server session per
    client connection, so A sees one process twice and B another. A transaction pooler
    hands a session back after every transaction and lends it to the next client (PgBouncer
    reuses the most recently freed one), so B sees A's process, or A sees two.
    """
    backend = _sql()("session_backend")
    with engine.connect() as a, engine.connect() as b:
        for _ in range(rounds):
            a_first = a.execute(backend).scalar_one()
            b_pid = b.execute(backend).scalar_one()
            a_again = a.execute(backend).scalar_one()
            if a_first != a_again:
                return f"one connection was served by server processes {a_first} and {a_again}"
            if b_pid == a_first:
                return f"two connections were served by one server process ({b_pid})"
    return None
