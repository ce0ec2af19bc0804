"""Reading a test database."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa


def q(engine: sa.Engine, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """The rows of `sql` (bound `params`) as plain tuples, on a connection of their own."""
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql), params)]


def execute(engine: sa.Engine, sql: str, **params: Any) -> None:
    """Run `sql` (bound `params`) in a transaction of its own."""
    with engine.begin() as conn:
        conn.execute(sa.text(sql), params)


def insert_expired_leases(engine: sa.Engine, keys: list[str]) -> None:
    """Leased enrich rows whose leases ran out a minute ago, as if their worker had died."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts,"
                " lease_owner, lease_expires_at)"
                " VALUES ('enrich', :key, 'created', 'leased', 1, 5, 'dead-worker',"
                " now() - interval '1 minute')"
            ),
            [{"key": key} for key in keys],
        )


def lock_waiters(engine: sa.Engine) -> int:
    """Sessions of this database waiting for a lock now. Each call reads pg_stat_activity
    in a transaction of its own: within one transaction it is a snapshot that never moves."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            ).scalar_one()
        )
