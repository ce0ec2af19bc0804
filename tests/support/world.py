"""A world for tests: the help desk, warehouse and legacy tables `enrichq_service.seed`
fills, tickets of a test's own, and the queue rows that enrich them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from enrichq_service import queue, seed
from enrichq_service.queue import EnqueueRequest
from tests.support.settings import make_settings

NOBODY = "nobody@example.org"  # the requester of a test's own tickets: no warehouse orders


def add_tickets(
    conn: sa.Connection, keys: Sequence[str], *, email: str | None = NOBODY, tenant: str = "acme"
) -> None:
    """Tickets `keys` in the help-desk mirror, requested by `email`."""
    if keys:
        conn.execute(
            sa.text(
                "INSERT INTO helpdesk.tickets (id, requester_email, tenant) VALUES (:k, :e, :t)"
            ),
            [{"k": key, "e": email, "t": tenant} for key in keys],
        )


def ticket_ids(conn: sa.Connection) -> list[str]:
    """Every ticket id of the help-desk mirror, in order."""
    return list(conn.execute(sa.text("SELECT id FROM helpdesk.tickets ORDER BY id")).scalars())


def enqueue(
    to: sa.Engine | sa.Connection,
    keys: Sequence[str],
    *,
    tenant: str | None = None,
    **settings: Any,
) -> None:
    """An enrich row for each of `keys`, visible now (`make_settings` and `settings`), in
    the connection's transaction or, given an engine, in a transaction of its own."""
    if isinstance(to, sa.Engine):
        with to.begin() as conn:
            enqueue(conn, keys, tenant=tenant, **settings)
        return
    requests = [EnqueueRequest.build(key=k, tenant=tenant) for k in keys]
    queue.enqueue(to, requests, settings=make_settings(None, **settings))


def seeded(
    engine: sa.Engine,
    tickets: int,
    *,
    extra: Sequence[str] = (),
    enqueued: bool = True,
    tenant: str | None = None,
    **settings: Any,
) -> list[str]:
    """The seeded world with `tickets` tickets and the `extra` ones (requested by NOBODY),
    every one of them enqueued (for `tenant`) unless told otherwise; the ticket ids, in
    order."""
    with engine.begin() as conn:
        seed.seed_world(conn, tickets=tickets)
        add_tickets(conn, extra)
        keys = ticket_ids(conn)
        if enqueued:
            enqueue(conn, keys, tenant=tenant, **settings)
    return keys
