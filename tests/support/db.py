"""Reading a test database."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa


def q(engine: sa.Engine, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """The rows of `sql` (bound `params`) as plain tuples, on a connection of their own."""
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql), params)]


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
