"""Enrichers for tests, importable by path (``tests.support.enrichers:name``) in subprocesses."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

from enrichq_service.enrich import EnrichContext, Enrichment, Order, Ticket, warehouse_lookup
from enrichq_service.errors import Deferral, PermanentError


def tagged(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """One order named after the ticket and this process's ENRICHQ_TEST_TAG, 1,000 bytes."""
    tag = os.environ.get("ENRICHQ_TEST_TAG", "x")
    return Enrichment((Order(f"O-{ticket.id}-{tag}"),), job_id=f"job-{tag}", bytes_billed=1000)


def slow(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Sleep ENRICHQ_TEST_SLOW_SECONDS (stopping early when cancelled), then `tagged`."""
    seconds = float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "1"))
    marker = os.environ.get("ENRICHQ_TEST_STARTED_DIR")
    if marker:
        with open(os.path.join(marker, ticket.id), "w") as f:
            f.write(str(os.getpid()))
    if context.cancelled.wait(seconds) and os.environ.get("ENRICHQ_TEST_HONOUR_CANCEL"):
        raise PermanentError("cancelled")
    return tagged(ticket, context)


def permanent(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Never works for this ticket."""
    raise PermanentError(f"ticket {ticket.id} has a malformed requester")


def defer_an_hour(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Cannot run yet."""
    raise Deferral(datetime.now(UTC) + timedelta(hours=1), "quota")


def flaky(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """An unexpected exception: counts as transient."""
    raise ValueError("warehouse hiccup")


def crash_on_poison(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """The process dies on ticket POISON (every time); other tickets use the warehouse."""
    if ticket.id == "POISON":
        os._exit(13)
    return warehouse_lookup(ticket, context)


def sleepy_warehouse(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """A slow warehouse: the lookup holds a warehouse connection for a while."""
    time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "0.2")))
    return warehouse_lookup(ticket, context)


def slow_query(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """A slow warehouse: each lookup holds a warehouse connection in pg_sleep first."""
    import sqlalchemy as sa

    seconds = float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "1"))
    with context.warehouse.connect() as conn:
        conn.execute(sa.text("SELECT pg_sleep(:s)"), {"s": seconds})
    return warehouse_lookup(ticket, context)


def noop(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """No lookup at all: what the queue and worker runtime cost on their own."""
    return Enrichment(())


def tries_legacy_write(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Attempt a write to the legacy output, then look the ticket up as usual.

    The job id of the result says whether the database refused the legacy write.
    """
    import sqlalchemy as sa
    import sqlalchemy.exc as sa_exc

    try:
        with context.warehouse.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO legacy.ticket_orders VALUES (:t, 'O-shadow-leak', now())"),
                {"t": ticket.id},
            )
        verdict = "legacy-write-ALLOWED"
    except sa_exc.ProgrammingError as exc:
        refused = getattr(exc.orig, "sqlstate", None) == "42501"  # insufficient_privilege
        verdict = "legacy-write-refused" if refused else f"legacy-write-error-{exc.orig}"
    found = warehouse_lookup(ticket, context)
    return Enrichment(found.orders, job_id=verdict, bytes_billed=found.bytes_billed)
