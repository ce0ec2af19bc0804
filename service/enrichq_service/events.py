"""Ingest of help-desk events, safe to redeliver (POST /v1/events): an event id seen within
ENRICHQ_EVENT_DEDUPE_HOURS is acknowledged as a duplicate and enqueues nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from enrichq_schema.queries import load
from enrichq_schema.settings import Settings
from enrichq_service import queue
from enrichq_service.errors import ServiceError

SQL = load("enrichq_service", "sql/events.sql")
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event to enqueue: the help desk's event id (None: not deduplicated) and the
    validated request it becomes."""

    event_id: str | None
    request: queue.EnqueueRequest


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """What became of one delivered event.

    `duplicate`: its id was seen within the window, nothing was enqueued, and `id` is the
    row the first delivery went into (None if unknown). Otherwise `inserted` says whether
    it made a new queued row or merged into the one queued already (`id`).
    """

    key: str
    id: int | None
    inserted: bool
    duplicate: bool = False


def duplicates(event_ids: Sequence[str | None], fresh: set[str]) -> list[bool]:
    """Which deliveries are duplicates: an id not `fresh` (seen within the window), or an id
    that occurs earlier in the same request. Events without an id never are."""
    seen_here: set[str] = set()
    out: list[bool] = []
    for event_id in event_ids:
        if event_id is None:
            out.append(False)
            continue
        out.append(event_id not in fresh or event_id in seen_here)
        seen_here.add(event_id)
    return out


def enqueue(
    conn: sa.Connection,
    deliveries: Sequence[Delivery],
    *,
    settings: Settings,
    now: datetime | None = None,
) -> list[DeliveryResult]:
    """Enqueue every delivery that is not a redelivery, in the caller's transaction."""
    ids = sorted({d.event_id for d in deliveries if d.event_id is not None})
    fresh: set[str] = set()
    if ids:
        window = settings.event_dedupe_hours * SECONDS_PER_HOUR
        fresh = set(
            conn.execute(
                SQL("events_mark_seen"), {"ids": ids, "window_seconds": window, "now": now}
            ).scalars()
        )
    dup = duplicates([d.event_id for d in deliveries], fresh)
    wanted = [d for d, is_dup in zip(deliveries, dup, strict=True) if not is_dup]
    results = iter(queue.enqueue(conn, [d.request for d in wanted], settings=settings, now=now))
    went_into: dict[str, int | None] = {}
    outcomes: list[DeliveryResult | None] = []
    for delivery, is_dup in zip(deliveries, dup, strict=True):
        if is_dup:
            outcomes.append(None)  # filled in below, once the first deliveries are known
            continue
        result = next(results)
        outcomes.append(DeliveryResult(result.key, result.id, result.inserted))
        if delivery.event_id is not None:
            went_into[delivery.event_id] = result.id
    if went_into:
        conn.execute(
            SQL("events_remember"),
            {"ids": list(went_into), "queue_ids": list(went_into.values())},
        )
    dup_ids = sorted(
        {d.event_id for d, is_dup in zip(deliveries, dup, strict=True) if is_dup and d.event_id}
    )
    if dup_ids:
        stored: dict[str, int | None] = {
            r.event_id: r.queue_id for r in conn.execute(SQL("events_queue_ids"), {"ids": dup_ids})
        }
        went_into = {**stored, **went_into}
    return [
        o
        if o is not None
        else DeliveryResult(d.request.key, went_into.get(d.event_id or ""), False, duplicate=True)
        for o, d in zip(outcomes, deliveries, strict=True)
    ]


class DuplicateKey(ServiceError):
    """A JSON object names one key twice."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def duplicate_key(body: bytes) -> str | None:
    """The first key that an object of the JSON `body` names twice, or None (also when
    `body` is not JSON: that is the parser's to say). Two parsers can take different ones
    of the two values (the last wins in Python, the first in others), so such a body is
    refused rather than read one way here and another way by the help desk."""
    try:
        json.loads(body, object_pairs_hook=_refuse_duplicates)
    except DuplicateKey as exc:
        return exc.key
    except (ValueError, RecursionError):
        return None
    return None
