"""The reconcile pass: enqueue the tickets the help desk changed without an event for them
(a webhook delivery is best effort), a page of recently updated tickets per transaction."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache

import sqlalchemy as sa

from enrichq_schema.identifiers import qualified, render
from enrichq_schema.settings import Settings
from enrichq_schema.states import KEY_MAX_LENGTH, NOTIFY_CHANNEL, OWNERLESS_PRIORITY, Kind
from enrichq_sweeper.common import DEFAULT_BATCH_SIZE, set_statement_timeout, sql

# How far back a pass looks: older changes are the backfill's and the refresh's business.
UPDATED_WITHIN_SECONDS = 7 * 86_400.0
# The cursor before the first page: before every (updated_at, id).
START: tuple[datetime, str] = (datetime.min.replace(tzinfo=UTC), "")


@cache
def _statement(tickets_table: str, dialect: sa.Dialect) -> sa.TextClause:
    """reconcile_enqueue_page with the tickets table's validated, quoted name in it."""
    return render(sql()["reconcile_enqueue_page"], tickets_table=qualified(dialect, tickets_table))


def quiet_seconds(settings: Settings) -> float:
    """How old a change must be before reconcile takes it: the longer visibility delay, the
    time an event sent for it had to arrive and be queued."""
    return max(settings.delay_created_seconds, settings.delay_updated_seconds)


@dataclass(frozen=True, slots=True)
class Page:
    """What one page of the pass did, and where the next one starts."""

    by_tenant: dict[str, int]  # rows enqueued per tenant ('' = none)
    scanned: int
    after: tuple[datetime, str] | None  # None: the page was the last one


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    """What a pass did: rows enqueued per tenant ('' = none), tickets read, pages."""

    by_tenant: dict[str, int] = field(default_factory=dict)
    scanned: int = 0
    pages: int = 0
    stopped: bool = False

    @property
    def enqueued(self) -> int:
        """Rows enqueued, every tenant."""
        return sum(self.by_tenant.values())


def enqueue_page(
    conn: sa.Connection,
    settings: Settings,
    *,
    after: tuple[datetime, str] = START,
    batch_size: int = DEFAULT_BATCH_SIZE,
    now: datetime | None = None,
) -> Page:
    """Enqueue the reconcile rows due among the next `batch_size` recently updated tickets
    after the cursor `after`, and wake the workers; the caller commits."""
    row = conn.execute(
        _statement(settings.tickets_table, conn.dialect),
        {
            "now": now,
            "priority": OWNERLESS_PRIORITY,
            "max_attempts": settings.max_attempts,
            "updated_within_seconds": UPDATED_WITHIN_SECONDS,
            "quiet_seconds": quiet_seconds(settings),
            "key_max_length": KEY_MAX_LENGTH,
            "after_updated_at": after[0],
            "after_id": after[1],
            "batch_size": batch_size,
        },
    ).one()
    by_tenant = {str(k): int(v) for k, v in (row.by_tenant or {}).items()}
    if by_tenant:
        conn.execute(sql()("queue_notify"), {"kind": Kind.ENRICH.value, "channel": NOTIFY_CHANNEL})
    last = None if row.scanned < batch_size else (row.last_updated_at, row.last_id)
    return Page(by_tenant, int(row.scanned), last)


def run_once(
    engine: sa.Engine,
    settings: Settings,
    *,
    now: datetime | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    should_stop: Callable[[], bool] | None = None,
) -> ReconcileResult:
    """One reconcile pass, one short transaction per page of tickets, asking `should_stop`
    between pages."""
    by_tenant: Counter[str] = Counter()
    scanned = pages = 0
    after: tuple[datetime, str] | None = START
    while after is not None:
        if should_stop is not None and should_stop():
            return ReconcileResult(dict(by_tenant), scanned, pages, stopped=True)
        with engine.begin() as conn:
            set_statement_timeout(conn, settings.statement_timeout_seconds)
            page = enqueue_page(conn, settings, after=after, batch_size=batch_size, now=now)
        by_tenant.update(page.by_tenant)
        scanned += page.scanned
        pages += 1
        after = page.after
    return ReconcileResult(dict(by_tenant), scanned, pages)
