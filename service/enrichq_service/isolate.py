"""Run one enrichment in a child process, so that a crash costs only that job an attempt.

A job whose previous attempt ended with its lease expiring may be a poison pill: its
enrichment may have killed the worker, and with it every job in flight beside it. After
recovery those jobs become visible together and would be claimed together again. So such
a "suspect" is enriched in a child process: if the child dies, the worker survives, the
job is retried (and dead-lettered once its attempts are spent), and its neighbours are
untouched. Suspects are rare, so the child's start-up cost is paid rarely.

The parent sends the settings and the ticket as JSON on stdin; the child answers one JSON
object on stdout: the enrichment, or the kind of error the enricher raised.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from decimal import Decimal
from typing import Any

from enrichq_schema.settings import Settings
from enrichq_schema.states import LEASE_EXPIRED_ERROR
from enrichq_service.enrich import EnrichContext, EnricherChoice, Enrichment, Order, Ticket
from enrichq_service.errors import Deferral, PermanentError, TransientError

CHILD_DIED = "isolated enrichment process died"


def is_suspect(attempts: int, last_error: str | None) -> bool:
    """Did this job's previous attempt end with its process vanishing?"""
    error = last_error or ""
    return attempts > 1 and (error == LEASE_EXPIRED_ERROR or CHILD_DIED in error)


def enrich_in_child(
    settings: Settings, warehouse_url: str, ticket: Ticket, *, timeout: float
) -> Enrichment:
    """Run the configured enricher for `ticket` in a fresh process; raise what it raised."""
    request = {
        "settings": json.loads(settings.model_dump_json()),
        "warehouse_url": warehouse_url,
        "ticket": {
            "id": ticket.id,
            "requester_email": ticket.requester_email,
            "tenant": ticket.tenant,
            "created_at": _iso(ticket.created_at),
            "updated_at": _iso(ticket.updated_at),
        },
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "enrichq_service.isolate"],
            input=json.dumps(request).encode(),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise TransientError(f"isolated enrichment ran past {timeout:g} s") from None
    if proc.returncode != 0:
        raise TransientError(
            f"{CHILD_DIED} (exit {proc.returncode}); the previous attempt lost its process too"
        )
    answer = json.loads(proc.stdout)
    error = answer.get("error")
    if error == "permanent":
        raise PermanentError(answer["message"])
    if error == "defer":
        raise Deferral(datetime.fromisoformat(answer["until"]), answer["message"])
    if error == "transient":
        raise TransientError(answer["message"])
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


def _enrich_one(choice: EnricherChoice, ticket: Ticket, context: EnrichContext) -> object:
    """One ticket's result from a per-ticket or a batch enricher (its exception raised)."""
    if choice.per_ticket is not None:
        return choice.per_ticket(ticket, context)
    assert choice.batch is not None
    outcome = choice.batch([ticket], context).get(ticket.id)
    if outcome is None:
        raise TransientError("the batch enricher returned nothing for this ticket")
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _child() -> int:
    """The child's side: read the request, run the enricher, write the answer."""
    from enrichq_schema.connections import warehouse_engine
    from enrichq_service.enrich import choose, validate

    request = json.loads(sys.stdin.buffer.read())
    settings = Settings.model_validate(request["settings"])
    t = request["ticket"]
    ticket = Ticket(
        t["id"],
        t["requester_email"],
        t["tenant"],
        datetime.fromisoformat(t["created_at"]) if t["created_at"] else None,
        datetime.fromisoformat(t["updated_at"]) if t["updated_at"] else None,
    )
    # the worker's pool mode and network timeouts, as for every enrichq engine
    warehouse = warehouse_engine(
        settings, request["warehouse_url"], application_name="enrichq-isolated", pool_size=1
    )
    answer: dict[str, Any]
    try:
        result = validate(_enrich_one(choose(settings), ticket, EnrichContext(settings, warehouse)))
        answer = {
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
    except PermanentError as exc:
        answer = {"error": "permanent", "message": str(exc)}
    except Deferral as exc:
        answer = {"error": "defer", "message": str(exc), "until": exc.until.isoformat()}
    except Exception as exc:
        answer = {"error": "transient", "message": f"{type(exc).__name__}: {exc}"}
    finally:
        warehouse.dispose()
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
