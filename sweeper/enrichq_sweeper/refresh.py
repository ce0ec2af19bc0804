"""The refresh schedule: re-enrich recently active tickets whose enrichment is stale.

Late orders reach agents this way: a ticket updated in the last week whose last enrichment
is more than a day old (or that was never enriched) gets one `refresh` row, visible now,
with no tenant, at the middle plan's priority.
"""

from __future__ import annotations

from datetime import datetime
from functools import cache

import sqlalchemy as sa

from enrichq_schema.states import KEY_MAX_LENGTH, OWNERLESS_PRIORITY, Kind
from enrichq_service.settings import Settings
from enrichq_sweeper.common import set_statement_timeout, sql

UPDATED_WITHIN_SECONDS = 7 * 86_400.0
ENRICHED_BEFORE_SECONDS = 86_400.0


@cache
def _statement(tickets_table: str, dialect: sa.Dialect) -> sa.TextClause:
    """refresh_enqueue with the tickets table's name in it.

    A table name cannot be a bound parameter, so it goes into the text: Settings has
    checked it is schema.table of plain identifiers, and each part is quoted by the
    dialect's identifier preparer besides.
    """
    preparer = dialect.identifier_preparer
    schema, table = tickets_table.split(".")
    quoted = f"{preparer.quote_schema(schema)}.{preparer.quote(table)}"
    return sa.text(sql()["refresh_enqueue"].sql.replace("{tickets_table}", quoted))


def enqueue(conn: sa.Connection, settings: Settings, *, now: datetime | None = None) -> int:
    """Enqueue the refresh rows due now and wake the workers; how many went in."""
    inserted = conn.execute(
        _statement(settings.tickets_table, conn.dialect),
        {
            "now": now,
            "priority": OWNERLESS_PRIORITY,
            "max_attempts": settings.max_attempts,
            "updated_within_seconds": UPDATED_WITHIN_SECONDS,
            "enriched_before_seconds": ENRICHED_BEFORE_SECONDS,
            "key_max_length": KEY_MAX_LENGTH,
        },
    ).scalar_one()
    if inserted:
        conn.execute(sql()("queue_notify"), {"kind": Kind.REFRESH.value})
    return int(inserted)


def run_once(engine: sa.Engine, settings: Settings, *, now: datetime | None = None) -> int:
    """One refresh pass in one transaction; how many refresh rows it enqueued."""
    with engine.begin() as conn:
        set_statement_timeout(conn, settings.statement_timeout_seconds)
        return enqueue(conn, settings, now=now)
