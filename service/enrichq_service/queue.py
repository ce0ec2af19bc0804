"""Queue operations (DESIGN §3) over the named statements of ``sql/queue.sql``.

Every function takes a ``sa.Connection`` and never commits: the caller owns the
transaction. Every write after a claim is fenced and reports which rows won; a job whose
lease was lost is simply absent from the answer, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from enrichq_schema.db import rerun_lost_races
from enrichq_schema.queries import load
from enrichq_schema.states import (
    KEY_MAX_LENGTH,
    OWNERLESS_PRIORITY,
    Kind,
    Outcome,
    Reason,
    State,
)
from enrichq_schema.text import unsafe_character
from enrichq_service import metrics
from enrichq_service.errors import ServiceError

if TYPE_CHECKING:
    from enrichq_service.settings import Settings

SQL = load("enrichq_service", "sql/queue.sql")
NOTIFY_CHANNEL = "enrichq_queue"
PAYLOAD_MAX_BYTES = 64 * 1024


class QueueInputError(ServiceError):
    """The work to enqueue is invalid."""


@dataclass(frozen=True, slots=True)
class EnqueueRequest:
    """One piece of work to enqueue; build it with `build()` to validate it."""

    key: str
    kind: str = Kind.ENRICH.value
    reason: str = Reason.MANUAL.value
    tenant: str | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)
    priority: int | None = None
    delay_seconds: float | None = None

    @classmethod
    def build(
        cls,
        *,
        key: str,
        kind: str = Kind.ENRICH.value,
        reason: str = Reason.MANUAL.value,
        tenant: str | None = None,
        payload: Mapping[str, Any] | None = None,
        priority: int | None = None,
        delay_seconds: float | None = None,
    ) -> EnqueueRequest:
        """A validated request; a bad field raises QueueInputError naming it."""
        if not isinstance(key, str) or not key.strip():
            raise QueueInputError("key: must be a non-empty string")
        if len(key) > KEY_MAX_LENGTH:
            raise QueueInputError(f"key: longer than {KEY_MAX_LENGTH} characters")
        # control and format characters (NUL, escapes, newlines, zero-width and bidi
        # marks) would reach terminals and logs wherever the key or tenant is shown
        for name, value in (("key", key), ("tenant", tenant)):
            if value is not None and (bad := unsafe_character(value)) is not None:
                raise QueueInputError(
                    f"{name}: must not contain control or format characters ({bad})"
                )
        if kind not in {k.value for k in Kind}:
            raise QueueInputError(f"kind: {kind!r} is not one of {', '.join(Kind)}")
        if reason not in {r.value for r in Reason}:
            raise QueueInputError(f"reason: {reason!r} is not one of {', '.join(Reason)}")
        if tenant is not None and (not tenant or len(tenant) > KEY_MAX_LENGTH):
            raise QueueInputError(f"tenant: must be 1 to {KEY_MAX_LENGTH} characters")
        if priority is not None and not -32768 <= priority <= 32767:
            raise QueueInputError("priority: out of range")
        if delay_seconds is not None and delay_seconds < 0:
            raise QueueInputError("delay_seconds: must not be negative")
        body = dict(payload or {})
        try:
            encoded = json.dumps(body)
        except (TypeError, ValueError) as exc:
            raise QueueInputError(f"payload: not JSON ({exc})") from None
        if len(encoded) > PAYLOAD_MAX_BYTES or "\\u0000" in encoded:
            raise QueueInputError("payload: larger than 64 KiB or contains NUL")
        return cls(key, kind, reason, tenant, body, priority, delay_seconds)


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """What happened to one request: a new row, or merged into the queued one."""

    key: str
    kind: str
    id: int | None
    inserted: bool


@dataclass(frozen=True, slots=True)
class Job:
    """A claimed row: what a handler needs, and the attempt number that fences its writes."""

    id: int
    kind: str
    key: str
    tenant: str | None
    reason: str
    payload: Mapping[str, Any]
    attempts: int
    max_attempts: int
    lease_expires_at: datetime
    created_at: datetime
    last_error: str | None = None  # why the previous attempt ended, if it did


def delay_for(reason: str, settings: Settings) -> float:
    """Visibility delay of a reason: ride out replication lag after ticket events."""
    if reason == Reason.CREATED:
        return settings.delay_created_seconds
    if reason == Reason.UPDATED:
        return settings.delay_updated_seconds
    return 0.0


def enqueue(
    conn: sa.Connection,
    requests: Sequence[EnqueueRequest],
    *,
    settings: Settings,
    now: datetime | None = None,
) -> list[EnqueueResult]:
    """Enqueue a batch in one round trip; a (kind, key) already queued is merged."""
    if not requests:
        return []
    params = {
        "kinds": [r.kind for r in requests],
        "keys": [r.key for r in requests],
        "tenants": [r.tenant for r in requests],
        "reasons": [r.reason for r in requests],
        "payloads": [json.dumps(dict(r.payload)) for r in requests],
        "delays": [
            float(r.delay_seconds if r.delay_seconds is not None else delay_for(r.reason, settings))
            for r in requests
        ],
        "priorities": [r.priority for r in requests],
        "max_attempts": [settings.max_attempts] * len(requests),
        "middle_priority": OWNERLESS_PRIORITY,
        "now": now,
    }
    rows = conn.execute(SQL("queue_enqueue"), params).all()
    results: list[EnqueueResult] = []
    seen: set[int] = set()
    for row in rows:
        # The same key twice in one batch: the first inserts, the second merges into it.
        inserted = row.inserted_id is not None and row.inserted_id not in seen
        row_id = row.inserted_id if row.inserted_id is not None else row.merged_id
        if row.inserted_id is not None:
            seen.add(row.inserted_id)
        results.append(EnqueueResult(row.key, row.kind, row_id, inserted))
        metrics.enqueued_total.labels(row.kind, "inserted" if inserted else "merged").inc()
    unseen = [r for r in results if r.id is None]
    if unseen:
        # Merged into a row a concurrent enqueue committed after our snapshot: a new
        # statement (a new snapshot under READ COMMITTED) finds it.
        found = {
            (r.kind, r.key): r.id
            for r in conn.execute(
                SQL("queue_queued_ids"),
                {"kinds": [r.kind for r in unseen], "keys": [r.key for r in unseen]},
            )
        }
        results = [
            dataclasses.replace(r, id=found.get((r.kind, r.key))) if r.id is None else r
            for r in results
        ]
    return results


def claim(
    conn: sa.Connection,
    *,
    kind: str,
    owner: str,
    limit: int,
    lease_seconds: float,
    now: datetime | None = None,
) -> list[Job]:
    """Lease up to `limit` visible rows of `kind` to `owner` (attempts + 1 at claim time)."""
    if limit <= 0:
        return []
    rows = conn.execute(
        SQL("queue_claim_batch"),
        {
            "kind": kind,
            "owner": owner,
            "limit": limit,
            "lease_seconds": float(lease_seconds),
            "middle_priority": OWNERLESS_PRIORITY,
            "now": now,
        },
    ).all()
    jobs = [
        Job(
            id=r.id,
            kind=r.kind,
            key=r.key,
            tenant=r.tenant,
            reason=r.reason,
            payload=r.payload,
            attempts=r.attempts,
            max_attempts=r.max_attempts,
            lease_expires_at=r.lease_expires_at,
            created_at=r.created_at,
            last_error=r.last_error,
        )
        for r in rows
    ]
    metrics.claims_total.labels(kind).inc(len(jobs))
    metrics.claim_batch_size.labels(kind).observe(len(jobs))
    return jobs


def heartbeat(
    conn: sa.Connection,
    *,
    owner: str,
    jobs: Iterable[Job],
    lease_seconds: float,
    now: datetime | None = None,
) -> set[int]:
    """Extend every lease `owner` holds in one statement; returns the ids it no longer holds."""
    jobs = list(jobs)
    if not jobs:
        return set()
    extended = {
        r.id
        for r in conn.execute(
            SQL("queue_heartbeat"),
            {
                "ids": [j.id for j in jobs],
                "attempts": [j.attempts for j in jobs],
                "owner": owner,
                "lease_seconds": float(lease_seconds),
                "now": now,
            },
        )
    }
    lost = {j.id for j in jobs} - extended
    if lost:
        metrics.heartbeat_lost_leases_total.inc(len(lost))
    return lost


def complete(
    conn: sa.Connection, *, owner: str, jobs: Sequence[Job], now: datetime | None = None
) -> set[int]:
    """Mark held jobs done; returns the ids that won (write only their results, same tx)."""
    if not jobs:
        return set()
    won = {
        r.id
        for r in conn.execute(
            SQL("queue_complete"),
            {
                "ids": [j.id for j in jobs],
                "attempts": [j.attempts for j in jobs],
                "owner": owner,
                "now": now,
            },
        )
    }
    _count_refused("complete", len(jobs) - len(won))
    return won


def fail(
    conn: sa.Connection,
    *,
    owner: str,
    failures: Sequence[tuple[Job, str]],
    now: datetime | None = None,
) -> set[int]:
    """Mark held jobs failed for good (permanent error kept); returns the ids that won."""
    if not failures:
        return set()
    won = {
        r.id
        for r in conn.execute(
            SQL("queue_fail"),
            {
                "ids": [j.id for j, _ in failures],
                "attempts": [j.attempts for j, _ in failures],
                "errors": [_clip(e) for _, e in failures],
                "owner": owner,
                "now": now,
            },
        )
    }
    _count_refused("fail", len(failures) - len(won))
    return won


def retry(
    conn: sa.Connection,
    *,
    owner: str,
    failures: Sequence[tuple[Job, str]],
    backoff_base_seconds: float,
    backoff_cap_seconds: float,
    now: datetime | None = None,
) -> dict[int, Outcome]:
    """Requeue held jobs with backoff after transient errors; spent ones are dead-lettered.

    Returns the outcome (retry or dead_letter) of each job that won.
    """
    if not failures:
        return {}
    params = {
        "ids": [j.id for j, _ in failures],
        "attempts": [j.attempts for j, _ in failures],
        "errors": [_clip(e) for _, e in failures],
        "owner": owner,
        "backoff_base": float(backoff_base_seconds),
        "backoff_cap": float(backoff_cap_seconds),
        "now": now,
    }
    rows = rerun_lost_races(conn, lambda: conn.execute(SQL("queue_retry"), params).all())
    won = {r.id: Outcome.RETRY if r.state == State.QUEUED else Outcome.DEAD_LETTER for r in rows}
    _count_refused("retry", len(failures) - len(won))
    return won


def defer(
    conn: sa.Connection,
    *,
    owner: str,
    deferrals: Sequence[tuple[Job, datetime | None]],
    now: datetime | None = None,
) -> set[int]:
    """Give held jobs back until a time (None = now) without spending their attempt."""
    if not deferrals:
        return set()
    params = {
        "ids": [j.id for j, _ in deferrals],
        "attempts": [j.attempts for j, _ in deferrals],
        "untils": [u for _, u in deferrals],
        "owner": owner,
        "now": now,
    }
    rows = rerun_lost_races(conn, lambda: conn.execute(SQL("queue_defer"), params).all())
    _count_refused("defer", len(deferrals) - len(rows))
    return {r.id for r in rows}


def _count_refused(operation: str, refused: int) -> None:
    if refused > 0:
        metrics.fenced_writes_refused_total.labels(operation).inc(refused)


def _clip(error: str, limit: int = 4000) -> str:
    """Errors are kept on the row, but never unbounded."""
    return error if len(error) <= limit else error[: limit - 1] + "…"
