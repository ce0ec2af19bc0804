"""The refresh schedule: re-enrich recently active tickets whose enrichment is stale, a
page of recently updated tickets per transaction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache

import sqlalchemy as sa

from enrichq_schema.identifiers import qualified, render
from enrichq_schema.settings import Settings
from enrichq_schema.states import KEY_MAX_LENGTH, NOTIFY_CHANNEL, OWNERLESS_PRIORITY, Kind
from enrichq_sweeper.common import DEFAULT_BATCH_SIZE, set_statement_timeout, sql

UPDATED_WITHIN_SECONDS = 7 * 86_400.0
ENRICHED_BEFORE_SECONDS = 86_400.0
# The cursor before the first page: before every (updated_at, id).
START: tuple[datetime, str] = (datetime.min.replace(tzinfo=UTC), "")


@cache
def _statement(tickets_table: str, dialect: sa.Dialect) -> sa.TextClause:
    """refresh_enqueue_page with the tickets table's name in it.

    A table name cannot be a bound parameter, so it goes into the text: Settings has
    checked it is schema.table of plain identifiers, and each part is quoted by the
    dialect's identifier preparer besides.
    """
    return render(sql()["refresh_enqueue_page"], tickets_table=qualified(dialect, tickets_table))


@dataclass(frozen=True, slots=True)
class RefreshPage:
    """What one page of the schedule did, and where the next one starts."""

    inserted: int
    scanned: int
    after: tuple[datetime, str] | None  # None: the page was the last one


def enqueue_page(
    conn: sa.Connection,
    settings: Settings,
    *,
    after: tuple[datetime, str] = START,
    batch_size: int = DEFAULT_BATCH_SIZE,
    now: datetime | None = None,
) -> RefreshPage:
    """Enqueue the refresh rows due among the next `batch_size` recently updated tickets
    after the cursor `after`, and wake the workers; the caller commits."""
    row = conn.execute(
        _statement(settings.tickets_table, conn.dialect),
        {
            "now": now,
            "priority": OWNERLESS_PRIORITY,
            "max_attempts": settings.max_attempts,
            "updated_within_seconds": UPDATED_WITHIN_SECONDS,
            "enriched_before_seconds": ENRICHED_BEFORE_SECONDS,
            "key_max_length": KEY_MAX_LENGTH,
            "after_updated_at": after[0],
            "after_id": after[1],
            "batch_size": batch_size,
        },
    ).one()
    if row.inserted:
        conn.execute(sql()("queue_notify"), {"kind": Kind.REFRESH.value, "channel": NOTIFY_CHANNEL})
    last = None if row.scanned < batch_size else (row.last_updated_at, row.last_id)
    return RefreshPage(int(row.inserted), int(row.scanned), last)


def run_once(
    engine: sa.Engine,
    settings: Settings,
    *,
    now: datetime | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> int:
    """One refresh pass, one short transaction per page of tickets; how many rows it enqueued."""
    inserted = 0
    after: tuple[datetime, str] | None = START
    while after is not None:
        with engine.begin() as conn:
            set_statement_timeout(conn, settings.statement_timeout_seconds)
            page = enqueue_page(conn, settings, after=after, batch_size=batch_size, now=now)
        inserted += page.inserted
        after = page.after
    return inserted
