"""Enrichment (DESIGN §4): read the ticket, look its customer up, write what was found.

The enrichment itself is a plug-in: ``ENRICHQ_ENRICHER=package.module:function`` names a
callable ``(ticket, context) -> Enrichment``. It raises ``TransientError`` (retry),
``PermanentError`` (fail) or ``Deferral`` (defer until a time); anything else counts as
transient. The built-in one, ``warehouse_lookup``, queries any SQLAlchemy warehouse.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from functools import cache
from typing import Any, Protocol

import sqlalchemy as sa

from enrichq_schema.queries import load
from enrichq_service.errors import PermanentError, SettingsError
from enrichq_service.settings import Settings

SQL = load("enrichq_service", "sql/enrich.sql")


@dataclass(frozen=True, slots=True)
class Ticket:
    """A ticket as mirrored from the help desk."""

    id: str
    requester_email: str | None
    tenant: str | None
    created_at: datetime | None
    updated_at: datetime | None


@dataclass(frozen=True, slots=True)
class Order:
    """One order found for a ticket's customer."""

    order_id: str
    customer_id: str | None = None
    placed_at: datetime | None = None
    total: Decimal | None = None


@dataclass(frozen=True, slots=True)
class Enrichment:
    """What an enricher found: the orders, and what the warehouse charged for the lookup."""

    orders: Sequence[Order] = ()
    job_id: str | None = None
    bytes_billed: int = 0

    def __post_init__(self) -> None:
        if self.bytes_billed < 0:
            raise PermanentError("enricher returned negative bytes_billed")


@dataclass(frozen=True, slots=True)
class EnrichContext:
    """What an enricher may use: settings, the warehouse, and a flag to stop early."""

    settings: Settings
    warehouse: sa.Engine
    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic() after which the attempt is abandoned


class Enricher(Protocol):
    def __call__(self, ticket: Ticket, context: EnrichContext, /) -> Enrichment: ...


@cache
def load_enricher(path: str) -> Enricher:
    """Import ``package.module:function``; a bad path is a SettingsError naming it."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        target = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        message = f"invalid setting ENRICHQ_ENRICHER: cannot import {path} ({exc})"
        raise SettingsError(message) from None
    if not callable(target):
        raise SettingsError(f"invalid setting ENRICHQ_ENRICHER: {path} is not callable")
    return target  # type: ignore[no-any-return]


def _quoted(engine_or_conn: sa.Engine | sa.Connection, qualified: str) -> str:
    preparer = engine_or_conn.dialect.identifier_preparer
    return ".".join(preparer.quote(part) for part in qualified.split("."))


@cache
def _statement(name: str, **tables: str) -> sa.TextClause:
    # Only validated, quoted identifiers are substituted; values are always bound.
    return sa.text(SQL[name].sql.format(**tables))


def read_tickets(conn: sa.Connection, settings: Settings, ids: Sequence[str]) -> dict[str, Ticket]:
    """The mirrored tickets among `ids`, by id."""
    if not ids:
        return {}
    stmt = _statement("enrich_read_tickets", tickets=_quoted(conn, settings.tickets_table))
    return {
        r.id: Ticket(r.id, r.requester_email, r.tenant, r.created_at, r.updated_at)
        for r in conn.execute(stmt, {"ids": list(ids)})
    }


def warehouse_lookup(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """The built-in enricher: the requester's orders in the configured warehouse tables."""
    if not ticket.requester_email:
        return Enrichment(())
    settings = context.settings
    stmt = _statement(
        "enrich_warehouse_orders",
        customers=_quoted(context.warehouse, settings.customers_table),
        orders=_quoted(context.warehouse, settings.orders_table),
    )
    with context.warehouse.connect() as conn:
        result = conn.execute(stmt, {"email": ticket.requester_email})
        orders = tuple(Order(str(r.order_id), r.customer_id, r.placed_at, r.total) for r in result)
        job_id, billed = _warehouse_job(result)
    return Enrichment(orders, job_id=job_id, bytes_billed=billed)


def _warehouse_job(result: sa.CursorResult[Any]) -> tuple[str | None, int]:
    """The warehouse's job id and bytes billed, where its DB-API cursor reports them.

    BigQuery's DB-API cursor keeps the query job; other warehouses bill nothing per query.
    """
    job = getattr(getattr(result, "cursor", None), "query_job", None)
    if job is None:
        return None, 0
    return str(getattr(job, "job_id", "") or "") or None, int(
        getattr(job, "total_bytes_billed", 0) or 0
    )


# -- writing results, for the jobs whose settle won


@dataclass(frozen=True, slots=True)
class Lookup:
    """One warehouse lookup as the lookup log records it."""

    queue_id: int
    ticket_id: str
    attempt: int
    job_id: str | None
    bytes_billed: int
    rows: int
    duration_ms: float
    status: str
    error: str | None = None


def write_results(
    conn: sa.Connection,
    results: Mapping[int, tuple[str, Enrichment]],
    *,
    looked_up_at: datetime | None = None,
) -> None:
    """Replace the rows of each ticket with its new orders (queue id → (ticket, result)).

    `looked_up_at` None is the database clock. Writes of one ticket by concurrent
    transactions are serialized on its enrichment row: the later one replaces, never merges.
    """
    if not results:
        return
    latest: dict[str, tuple[int, Enrichment]] = {}
    for queue_id, (ticket_id, enrichment) in sorted(results.items()):
        latest[ticket_id] = (queue_id, enrichment)
    tickets = sorted(latest)
    conn.execute(
        SQL("enrich_upsert_enrichments"),
        {
            "tickets": tickets,
            "enriched_ats": [looked_up_at] * len(tickets),
            "order_counts": [len(latest[t][1].orders) for t in tickets],
            "queue_ids": [latest[t][0] for t in tickets],
        },
    )
    conn.execute(SQL("enrich_delete_ticket_orders"), {"tickets": tickets})
    rows: dict[str, list[Any]] = {
        k: []
        for k in (
            "tickets",
            "order_ids",
            "customer_ids",
            "placed_ats",
            "totals",
            "looked_up_ats",
            "queue_ids",
        )
    }
    for ticket_id in tickets:
        queue_id, enrichment = latest[ticket_id]
        for order in enrichment.orders:
            rows["tickets"].append(ticket_id)
            rows["order_ids"].append(order.order_id)
            rows["customer_ids"].append(order.customer_id)
            rows["placed_ats"].append(order.placed_at)
            rows["totals"].append(order.total)
            rows["looked_up_ats"].append(looked_up_at)
            rows["queue_ids"].append(queue_id)
    if rows["tickets"]:
        conn.execute(SQL("enrich_insert_ticket_orders"), rows)


def log_lookups(conn: sa.Connection, lookups: Sequence[Lookup], *, now: datetime | None) -> None:
    """Record lookups in the lookup log and add their bytes to today's budget ledger."""
    if not lookups:
        return
    conn.execute(
        SQL("enrich_insert_lookup_log"),
        {
            "queue_ids": [x.queue_id for x in lookups],
            "tickets": [x.ticket_id for x in lookups],
            "attempts": [x.attempt for x in lookups],
            "job_ids": [x.job_id for x in lookups],
            "bytes": [x.bytes_billed for x in lookups],
            "rows": [x.rows for x in lookups],
            "durations": [x.duration_ms for x in lookups],
            "statuses": [x.status for x in lookups],
            "errors": [x.error for x in lookups],
        },
    )
    conn.execute(
        SQL("enrich_add_to_budget"),
        {"bytes": sum(x.bytes_billed for x in lookups), "lookups": len(lookups), "now": now},
    )


@dataclass(frozen=True, slots=True)
class Budget:
    """Today's warehouse spend against the daily budget (0 = no budget)."""

    spent: int
    limit: int
    resets_at: datetime

    @property
    def exhausted(self) -> bool:
        return self.limit > 0 and self.spent >= self.limit


def read_budget(conn: sa.Connection, limit: int, *, now: datetime | None = None) -> Budget:
    """Bytes billed today (UTC) and when the day resets."""
    row = conn.execute(SQL("enrich_budget_today"), {"now": now}).one()
    return Budget(int(row.bytes_billed), limit, row.resets_at)


def timed(fn: Callable[[], Enrichment]) -> tuple[Enrichment, float]:
    """Run a lookup; its result and how long it took in milliseconds."""
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1000
