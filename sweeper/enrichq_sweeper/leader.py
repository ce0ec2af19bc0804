"""One active sweeper among any number of replicas: a session-level Postgres advisory lock.

The lock lives on a dedicated connection. When the process dies, its connection closes and
the server releases the lock, so a waiting replica takes over at its next try; nothing has
to expire first.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa

from enrichq_sweeper.common import sql

log = logging.getLogger(__name__)

# The advisory-lock key of the sweeper's leadership: "enrq" "swep" as two 32-bit halves
# (pg_locks shows them as classid 0x656E7271, objid 0x73776570).
SWEEPER_LOCK_ID = 0x656E7271_73776570


class LeaderLock:
    """The sweeper leader lock, held on its own connection of `url`."""

    def __init__(self, url: str, *, owner: str, lock_id: int = SWEEPER_LOCK_ID) -> None:
        from enrichq_schema.db import create_engine

        self.lock_id = lock_id
        # application_name shows who leads in pg_stat_activity (Postgres keeps 63 bytes).
        self._engine = create_engine(
            url,
            application_name=f"enrichq-sweeper {owner}"[:63],
            pool_size=1,
            isolation_level="AUTOCOMMIT",
        )
        self._conn: sa.Connection | None = None
        self._held = False

    @property
    def held(self) -> bool:
        """Whether this process believes it holds the lock (see `still_held`)."""
        return self._held

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; never waits. Connection errors propagate."""
        if self._held:
            return True
        if self._conn is None:
            self._conn = self._engine.connect()
        try:
            got = bool(
                self._conn.execute(
                    sql()("sweeper_advisory_lock"), {"lock_id": self.lock_id}
                ).scalar_one()
            )
        except Exception:
            self._drop()
            raise
        self._held = got
        return got

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
