"""Run enrichments in a child process, so that a crash costs only the job that caused it.

A job whose previous attempt ended with its lease expiring may be a poison pill: its
enrichment may have killed the worker, and with it every job in flight beside it. After
recovery those jobs become visible together and would be claimed together again. So the
suspects of a unit are enriched in a child process, all of them in one: if the child dies,
their tickets are split in two halves, each tried in a child of its own, and so on until
the child that dies holds one ticket alone. That ticket's attempt fails (it is retried,
and dead-lettered once its attempts are spent); every other suspect gets its outcome in
the same attempt. A unit with no poison pill costs one child; one with a poison pill among
n suspects costs at most 1 + 2 * ceil(log2 n).

Suspects are not rare: after a database outage longer than a lease every job that was in
flight comes back one, though no process died. One child per suspect, one after another,
made that recovery cost a process start-up per job, long enough under load for the leases
to lapse again and the queue to stall; one child per unit costs about one more lookup.

A child has until the attempt's deadline, and is killed as soon as every job it enriches
is abandoned or lost (`EnrichContext.interruptible`).

The parent sends the settings, the time left and the tickets as JSON on stdin; the child
answers one JSON object on stdout: each ticket's enrichment, or the kind of error the
enricher gave for it.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from enrichq_schema.connections import warehouse_engine
from enrichq_schema.settings import Settings
from enrichq_schema.states import LEASE_EXPIRED_ERROR
from enrichq_service.enrich import (
    EnrichContext,
    Enrichment,
    Order,
    Ticket,
    choose,
    enrich_all,
    validate,
)
from enrichq_service.errors import Deferral, PermanentError, TransientError

log = logging.getLogger(__name__)

CHILD_DIED = "isolated enrichment process died"
CANCELLED = "isolated enrichment stopped: its attempt was abandoned or its lease lost"
# the least time a child is given, even past the deadline: enough to start and answer
MIN_CHILD_SECONDS = 1.0

Outcomes = dict[str, Enrichment | BaseException]


def is_suspect(attempts: int, last_error: str | None) -> bool:
    """Did this job's previous attempt end with its process vanishing?"""
    error = last_error or ""
    return attempts > 1 and (error == LEASE_EXPIRED_ERROR or CHILD_DIED in error)


def enrich_in_child(context: EnrichContext, tickets: Sequence[Ticket]) -> Outcomes:
    """Each ticket's outcome by ticket id, from the configured enricher run in child
    processes: one for them all, its tickets halved each time a child dies."""
    if not tickets:
        return {}
    try:
        return _run_child(context, tickets)
    except _ChildDied as died:
        if len(tickets) == 1:
            return {
                tickets[0].id: TransientError(
                    f"{CHILD_DIED} (exit {died.code}); the previous attempt lost its process too"
                )
            }
        log.warning(
            "an isolated enrichment of %d tickets died (exit %d): each half gets a process "
            "of its own",
            len(tickets),
            died.code,
        )
        half = len(tickets) // 2
        return {
            **enrich_in_child(context, tickets[:half]),
            **enrich_in_child(context, tickets[half:]),
        }


class _ChildDied(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _run_child(context: EnrichContext, tickets: Sequence[Ticket]) -> Outcomes:
    """The outcomes of one child that enriches `tickets`; _ChildDied if it dies on its own."""
    seconds = context.remaining_seconds()
    timeout = None if seconds is None else max(MIN_CHILD_SECONDS, seconds)
    request = {
        "settings": json.loads(context.settings.model_dump_json()),
        "warehouse_url": context.warehouse.url.render_as_string(hide_password=False),
        "seconds": timeout,
        "tickets": [_ticket_json(t) for t in tickets],
    }
    # stderr is the worker's: whatever a dying child says lands in the worker's log
    proc = subprocess.Popen(
        [sys.executable, "-m", "enrichq_service.isolate"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        proc.kill()

    try:
        with context.interruptible(stop):
            out, _ = proc.communicate(json.dumps(request).encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return _each(tickets, TransientError(f"isolated enrichment ran past {timeout:g} s"))
    if stopped.is_set():
        return _each(tickets, TransientError(CANCELLED))
    if proc.returncode != 0:
        raise _ChildDied(proc.returncode)
    answers = json.loads(out)["outcomes"]
    return {t.id: _outcome(answers[t.id]) for t in tickets}


def _each(tickets: Sequence[Ticket], error: BaseException) -> Outcomes:
    return {t.id: error for t in tickets}


def _outcome(answer: dict[str, Any]) -> Enrichment | BaseException:
    """A ticket's outcome from the child's answer for it."""
    error = answer.get("error")
    if error == "permanent":
        return PermanentError(answer["message"])
    if error == "defer":
        return Deferral(datetime.fromisoformat(answer["until"]), answer["message"])
    if error == "transient":
        return TransientError(answer["message"])
    return Enrichment(
        tuple(
            Order(
                o["order_id"],
                o.get("customer_id"),
                datetime.fromisoformat(o["placed_at"]) if o.get("placed_at") else None,
                Decimal(o["total"]) if o.get("total") is not None else None,
            )
            for o in answer["orders"]
        ),
        job_id=answer.get("job_id"),
        bytes_billed=int(answer.get("bytes_billed", 0)),
    )


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _ticket_json(ticket: Ticket) -> dict[str, Any]:
    return {
        "id": ticket.id,
        "requester_email": ticket.requester_email,
        "tenant": ticket.tenant,
        "created_at": _iso(ticket.created_at),
        "updated_at": _iso(ticket.updated_at),
    }


def _ticket(t: dict[str, Any]) -> Ticket:
    return Ticket(
        t["id"],
        t["requester_email"],
        t["tenant"],
        datetime.fromisoformat(t["created_at"]) if t["created_at"] else None,
        datetime.fromisoformat(t["updated_at"]) if t["updated_at"] else None,
    )


def _answer(outcome: object) -> dict[str, Any]:
    """The child's answer for one ticket: its validated enrichment, or its error's kind."""
    if isinstance(outcome, Deferral):
        return {"error": "defer", "message": str(outcome), "until": outcome.until.isoformat()}
    if isinstance(outcome, PermanentError):
        return {"error": "permanent", "message": str(outcome)}
    if isinstance(outcome, BaseException):
        return {"error": "transient", "message": f"{type(outcome).__name__}: {outcome}"}
    try:
        result = validate(outcome)
    except PermanentError as exc:
        return {"error": "permanent", "message": str(exc)}
    return {
        "orders": [
            {
                "order_id": o.order_id,
                "customer_id": o.customer_id,
                "placed_at": _iso(o.placed_at),
                "total": None if o.total is None else str(o.total),
            }
            for o in result.orders
        ],
        "job_id": result.job_id,
        "bytes_billed": result.bytes_billed,
    }


def _child() -> int:
    """The child's side: read the request, run the enricher, write the answer."""
    request = json.loads(sys.stdin.buffer.read())
    settings = Settings.model_validate(request["settings"])
    seconds = request["seconds"]
    deadline = None if seconds is None else time.monotonic() + seconds
    # the worker's pool mode and network timeouts, as for every enrichq engine
    warehouse = warehouse_engine(
        settings, request["warehouse_url"], application_name="enrichq-isolated", pool_size=1
    )
    try:
        outcomes = enrich_all(
            choose(settings),
            [_ticket(t) for t in request["tickets"]],
            EnrichContext(settings, warehouse, deadline=deadline),
        )
    finally:
        warehouse.dispose()
    sys.stdout.write(json.dumps({"outcomes": {k: _answer(v) for k, v in outcomes.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
