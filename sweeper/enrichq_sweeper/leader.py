"""One active sweeper among any number of replicas: a session advisory lock, or a lease
row behind a transaction pooler."""

from __future__ import annotations

import abc
import logging
import math
import secrets
import time
from typing import Any

import sqlalchemy as sa

from enrichq_schema.settings import NETWORK_TIMEOUT_SECONDS_DEFAULT, Settings
from enrichq_schema.states import PoolMode
from enrichq_sweeper.common import sql

log = logging.getLogger(__name__)

# The advisory-lock key of the sweeper's leadership: "enrq" "swep" as two 32-bit halves
# (pg_locks shows them as classid 0x656E7271, objid 0x73776570).
SWEEPER_LOCK_ID = 0x656E7271_73776570
# The lease row of the sweeper's leadership (enrichq.leader_leases.name).
SWEEPER_LEASE_NAME = "sweeper"
# A lease lasts this many leadership checks: a leader that misses a few checks in a row
# (a slow database) keeps it, and one that died is replaced within this many.
LEASE_CHECKS = 6
# Random bytes after host:pid in a lease row's owner (shown as hex).
LEASE_OWNER_SUFFIX_BYTES = 4
# Unanswered keepalive probes after which the server drops the leader's session.
SERVER_KEEPALIVE_PROBES = 3
# A follower asks for the leadership this often (or every sweep interval, if that is
# shorter), and the leader checks that it still leads as often.
CHECK_SECONDS_MAX = 5.0
# The least a leadership statement may run (instant ones, but a loaded server is slow).
STATEMENT_SECONDS_MIN = 1.0


def check_seconds(settings: Settings) -> float:
    """How often a follower asks for the leadership, and the leader checks it still leads."""
    return min(CHECK_SECONDS_MAX, settings.sweep_interval_seconds)


def statement_seconds(settings: Settings) -> float:
    """The statement timeout of the leadership's connection: a check's worth, at least 1 s."""
    return max(STATEMENT_SECONDS_MIN, check_seconds(settings))


def reply_seconds(settings: Settings) -> float:
    """How long the leader waits for any one reply on its connection before it lets go:
    its statement timeout plus the network timeout (ENRICHQ_NETWORK_TIMEOUT_SECONDS, its
    default when that is 0)."""
    network = settings.network_timeout_seconds or NETWORK_TIMEOUT_SECONDS_DEFAULT
    return statement_seconds(settings) + network


def idle_session_seconds(settings: Settings) -> float:
    """How long the server keeps the leader's session while it says nothing (session mode):
    long enough for a leader that checks every `check_seconds` never to hit it, and longer
    than the leader's own reply wait plus a check, so a cut-off leader knows it lost the
    lock before the server hands it to another."""
    check = check_seconds(settings)
    return max(LEASE_CHECKS * check, reply_seconds(settings) + 2 * check)


def takeover_seconds(settings: Settings) -> float:
    """The longest a follower waits to lead after the leader is cut off from the database
    (or frozen, or killed): the server ends the leader's session (or its lease runs out),
    then the follower's next try leads."""
    check = check_seconds(settings)
    if settings.pool_mode is PoolMode.TRANSACTION:
        return LEASE_CHECKS * check + check
    return idle_session_seconds(settings) + check


class Leadership(abc.ABC):
    """The sweeper's leadership, whichever way it is held: what this process believes of
    it, and taking it without waiting (`_take`, once per try while not held)."""

    _held = False

    @property
    def held(self) -> bool:
        """Whether this process believes it leads (see `still_held`)."""
        return self._held

    def try_acquire(self) -> bool:
        """Lead if nobody does; never waits. Connection errors propagate."""
        if not self._held:
            self._held = self._take()
        return self._held

    @staticmethod
    def _engine_for(settings: Settings, url: str, owner: str, **options: Any) -> sa.Engine:
        """The one-connection engine the leadership is held over: every wait for a reply
        on it ends within `reply_seconds`."""
        from enrichq_schema.db import create_engine

        # application_name shows who leads in pg_stat_activity (Postgres keeps 63 bytes).
        name = f"enrichq-sweeper {owner}"[:63]
        statement = statement_seconds(settings)
        return create_engine(
            url,
            application_name=name,
            pool_size=1,
            pool_mode=settings.pool_mode,
            statement_timeout_seconds=statement,
            network_timeout_seconds=reply_seconds(settings) - statement,
            **options,
        )

    @abc.abstractmethod
    def _take(self) -> bool:
        """One try at leading: whether it succeeded."""

    @abc.abstractmethod
    def still_held(self) -> bool:
        """Whether this process still leads; False (and let go) when it cannot tell."""

    @abc.abstractmethod
    def release(self) -> None:
        """Stop leading (a no-op when not leading), so another replica leads at once."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop leading and close the connection."""


def leadership(
    settings: Settings, url: str, *, owner: str, check_seconds: float
) -> LeaderLock | LeaderLease:
    """The leadership that fits ENRICHQ_POOL_MODE; checked every `check_seconds`."""
    if settings.pool_mode is PoolMode.TRANSACTION:
        return LeaderLease(settings, url, owner=owner, ttl_seconds=check_seconds * LEASE_CHECKS)
    return LeaderLock(settings, url, owner=owner)


def server_session_params(settings: Settings) -> dict[str, str]:
    """The leader session's server settings (milliseconds or seconds, as text): the idle
    session timeout, and TCP keepalives and a user timeout that notice a dead peer within
    the network timeout."""
    network = settings.network_timeout_seconds or NETWORK_TIMEOUT_SECONDS_DEFAULT
    return {
        "idle_ms": str(int(idle_session_seconds(settings) * 1000)),
        "keepalives_idle": str(max(1, math.ceil(network / 2))),
        "keepalives_interval": str(max(1, math.ceil(network / 2 / SERVER_KEEPALIVE_PROBES))),
        "keepalives_count": str(SERVER_KEEPALIVE_PROBES),
        "user_timeout_ms": str(max(1, int(network * 1000))),
    }


def _compiled(statement: Any, engine: sa.Engine, params: dict[str, str]) -> tuple[str, Any]:
    """`statement` with `params` as the DBAPI cursor takes them."""
    compiled = statement.compile(dialect=engine.dialect)
    return compiled.string, compiled.construct_params(params)


class LeaderLock(Leadership):
    """The sweeper leader lock, held on its own connection of `url`. The server ends that
    session (and so frees the lock) when this process goes silent for
    `idle_session_seconds`, or its TCP peer stops answering for the network timeout."""

    def __init__(
        self, settings: Settings, url: str, *, owner: str, lock_id: int = SWEEPER_LOCK_ID
    ) -> None:
        self.lock_id = lock_id
        self._engine = self._engine_for(settings, url, owner, isolation_level="AUTOCOMMIT")
        self._conn: sa.Connection | None = None
        params = server_session_params(settings)

        @sa.event.listens_for(self._engine, "connect")
        def _cut_off_sessions_end(dbapi_connection: Any, record: Any) -> None:
            # the server ends the session, and so frees the lock, when this process goes
            # silent: idle too long (a partition behind a proxy that still acknowledges
            # our packets), or its TCP peer gone (a real partition, a dead host)
            with dbapi_connection.cursor() as cursor:
                statement = sql()("leader_session_settings")
                cursor.execute(*_compiled(statement, self._engine, params))
            if not dbapi_connection.autocommit:
                dbapi_connection.commit()

    def _take(self) -> bool:
        if self._conn is None:
            self._conn = self._engine.connect()
        try:
            return bool(
                self._conn.execute(
                    sql()("sweeper_advisory_lock"), {"lock_id": self.lock_id}
                ).scalar_one()
            )
        except Exception:
            self._drop()
            raise

    def still_held(self) -> bool:
        """Ask the server whether the lock's session is alive; False (and let go) if not."""
        if not self._held or self._conn is None:
            return False
        try:
            self._conn.execute(sa.text("SELECT 1")).scalar_one()
        except Exception as exc:
            log.warning("leader lock connection lost: %s", type(exc).__name__)
            self._drop()
            return False
        return True

    def release(self) -> None:
        """Give the lock up (a no-op when not held); the connection is kept for later tries."""
        if not self._held or self._conn is None:
            self._held = False
            return
        try:
            self._conn.execute(sql()("sweeper_advisory_unlock"), {"lock_id": self.lock_id})
        except Exception as exc:
            # Closing the session releases the lock as well.
            log.warning("leader lock not released cleanly: %s", type(exc).__name__)
            self._drop()
        self._held = False

    def close(self) -> None:
        """Release the lock and close its connection."""
        self.release()
        self._drop()
        self._engine.dispose()

    def _drop(self) -> None:
        self._held = False
        if self._conn is not None:
            try:
                self._conn.invalidate()
                self._conn.close()
            except Exception:  # noqa: S110 -- the connection is being thrown away either way
                pass
            self._conn = None


class LeaderLease(Leadership):
    """The sweeper's leadership as a lease row of `enrichq.leader_leases` (transaction
    pooling). `still_held` renews it; a renewal that fails, or none that succeeded within
    half the lease, gives it up here, well before the row runs out for the others."""

    def __init__(
        self,
        settings: Settings,
        url: str,
        *,
        owner: str,
        ttl_seconds: float,
        name: str = SWEEPER_LEASE_NAME,
    ) -> None:
        self.name = name
        # two replicas may share a host name and a pid (containers: pid 1 each)
        self.owner = f"{owner}:{secrets.token_hex(LEASE_OWNER_SUFFIX_BYTES)}"
        self.ttl_seconds = ttl_seconds
        self._engine = self._engine_for(settings, url, owner)
        self._renewed = 0.0  # time.monotonic() before the last renewal that succeeded

    def still_held(self) -> bool:
        """Renew the lease; False (and let go) when someone else holds it, the renewal
        failed, or the last success is more than half a lease old."""
        if not self._held:
            return False
        try:
            renewed = self._take()
        except Exception as exc:
            log.warning("leader lease not renewed: %s", type(exc).__name__)
            renewed = False
        if not renewed or time.monotonic() - self._renewed > self.ttl_seconds / 2:
            self._held = False
        return self._held

    def release(self) -> None:
        """Give the lease up (a no-op when not held), so another replica leads at once."""
        if not self._held:
            return
        self._held = False
        try:
            with self._engine.begin() as conn:
                conn.execute(
                    sql()("leader_lease_release"), {"name": self.name, "owner": self.owner}
                )
        except Exception as exc:
            # It runs out by itself within one lease.
            log.warning("leader lease not released cleanly: %s", type(exc).__name__)

    def close(self) -> None:
        """Release the lease and close the connection."""
        self.release()
        self._engine.dispose()

    def _take(self) -> bool:
        started = time.monotonic()
        with self._engine.begin() as conn:
            expires = conn.execute(
                sql()("leader_lease_take"),
                {
                    "name": self.name,
                    "owner": self.owner,
                    "ttl_seconds": self.ttl_seconds,
                    "now": None,
                },
            ).scalar()
        if expires is None:
            return False
        self._renewed = started
        return True
