"""Reading a test database."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa


def q(engine: sa.Engine, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """The rows of `sql` (bound `params`) as plain tuples, on a connection of their own."""
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql), params)]
