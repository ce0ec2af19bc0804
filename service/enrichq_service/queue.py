"""Queue operations (DESIGN §3) over the named statements of ``sql/queue.sql``.

Every function takes a ``sa.Connection`` and never commits: the caller owns the
transaction. Every write after a claim is fenced by the claim's token and reports which
rows won; a job whose lease was lost is simply absent from the answer, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypedDict
from uuid import UUID

import sqlalchemy as sa

from enrichq_schema import metrics
from enrichq_schema.db import as_records, rerun_lost_races
from enrichq_schema.queries import load
from enrichq_schema.settings import PRIORITY_AGING_SECONDS_DEFAULT
from enrichq_schema.states import (
    KEY_MAX_LENGTH,
    NOTIFY_CHANNEL,
    OWNERLESS_PRIORITY,
    PLAN_PRIORITY,
    Kind,
    Outcome,
    Reason,
    State,
)
from enrichq_schema.text import id_problem
from enrichq_service.errors import ServiceError

if TYPE_CHECKING:
    from enrichq_schema.settings import Settings

SQL = load("enrichq_service", "sql/queue.sql")
PAYLOAD_MAX_BYTES = 64 * 1024
# The advisory-lock space of the claim's per-key try-locks ("enrq" as a 32-bit number):
# pg_locks shows them as classid 0x656E7271, objid the key's hashtext.
KEY_LOCK_SPACE = 0x656E7271
ALL_KINDS: tuple[str, ...] = tuple(k.value for k in Kind)
# Where aging stops: the top plan's level, where rows that waited long enough meet.
TOP_PRIORITY = max(PLAN_PRIORITY.values())
# The claim-order heads one claim evaluates at most besides the pairs it took rows from
# (when many pairs fall due at once, a few claims share the work).
HEADS_DUE_BATCH = 500
# Every head is looked at again after about this long (half to all of it, at random), so a
# plan change or a head no claim could move yet counts within minutes.
HEADS_RECHECK_SECONDS = 300.0


class QueueInputError(ServiceError):
    """The work to enqueue is invalid."""


@dataclass(frozen=True, slots=True)
class EnqueueRequest:
    """One piece of work to enqueue; build it with `build()` to validate it.

    Its priority is its tenant's plan, read when it is claimed (DESIGN §3, fairness).
    """

    key: str
    kind: str = Kind.ENRICH.value
    reason: str = Reason.MANUAL.value
    tenant: str | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)
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
        delay_seconds: float | None = None,
    ) -> EnqueueRequest:
        """A validated request; a bad field raises QueueInputError naming it."""
        if not isinstance(key, str):
            raise QueueInputError("key: must be a string")
        # one rule for ids and tenants wherever they come in (enrichq_schema.text.id_problem):
        # no blank or padded value, no control or format character (they would reach
        # terminals and logs), no byte that was not UTF-8
        for name, value in (("key", key), ("tenant", tenant)):
            if value is not None and (problem := id_problem(value, KEY_MAX_LENGTH)):
                raise QueueInputError(f"{name}: {problem}")
        if kind not in ALL_KINDS:
            raise QueueInputError(f"kind: {kind!r} is not one of {', '.join(Kind)}")
        if reason not in {r.value for r in Reason}:
            raise QueueInputError(f"reason: {reason!r} is not one of {', '.join(Reason)}")
        if delay_seconds is not None and delay_seconds < 0:
            raise QueueInputError("delay_seconds: must not be negative")
        body = dict(payload or {})
        try:
            encoded = json.dumps(body)
        except (TypeError, ValueError) as exc:
            raise QueueInputError(f"payload: not JSON ({exc})") from None
        if len(encoded) > PAYLOAD_MAX_BYTES or "\\u0000" in encoded:
            raise QueueInputError("payload: larger than 64 KiB or contains NUL")
        return cls(key, kind, reason, tenant, body, delay_seconds)


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """What happened to one request: a new row, or merged into the queued one."""

    key: str
    kind: str
    id: int | None
    inserted: bool


@dataclass(frozen=True, slots=True)
class Job:
    """A claimed row: what a handler needs, and the claim token that fences its writes."""

    id: int
    kind: str
    key: str
    tenant: str | None
    reason: str
    payload: Mapping[str, Any]
    attempts: int
    max_attempts: int
    claim_token: UUID
    lease_expires_at: datetime
    created_at: datetime
    last_error: str | None = None  # why the previous attempt ended, if it did
    claimed_at: datetime | None = None  # the database's time of the claim


class SettleAction(StrEnum):
    """What a settle does with one held job (DESIGN §3: complete, retry, fail, defer)."""

    COMPLETE = "complete"
    RETRY = "retry"
    FAIL = "fail"
    DEFER = "defer"


@dataclass(frozen=True, slots=True)
class Settle:
    """One held job and what to do with it: the error of a retry or fail, a defer's time."""

    job: Job
    action: SettleAction
    error: str | None = None
    until: datetime | None = None  # defer only; None = visible again now


def backoff_seconds(
    attempts: int, *, base_seconds: float, cap_seconds: float, draw: Callable[[], float]
) -> float:
    """Seconds a retried job waits before it is visible again: capped exponential backoff
    with half-to-full jitter, min(cap, base·2^attempts)·(0.5 + draw()/2), draw() in [0, 1)."""
    full = min(cap_seconds, base_seconds * 2.0 ** min(attempts, _LARGEST_EXPONENT))
    return full * (0.5 + draw() / 2)


_LARGEST_EXPONENT = 1000  # 2.0**1024 overflows; any cap is reached long before


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
    """Enqueue a batch in one round trip; a (kind, key) already queued is merged.

    Event work becomes visible at the lookup window's next boundary after its delay
    (`ENRICHQ_LOOKUP_WINDOW_SECONDS`); manual and redriven work when its delay ends."""
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
        "max_attempts": [settings.max_attempts] * len(requests),
        "middle_priority": OWNERLESS_PRIORITY,
        "channel": NOTIFY_CHANNEL,
        "window_seconds": float(settings.lookup_window_seconds),
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
    kinds: Sequence[str] = ALL_KINDS,
    owner: str,
    limit: int,
    lease_seconds: float,
    aging_seconds: float = PRIORITY_AGING_SECONDS_DEFAULT,
    now: datetime | None = None,
) -> list[Job]:
    """Lease up to `limit` visible rows of `kinds` to `owner` (attempts + 1 at claim time).

    Raises IntegrityError on the leased-key index in the rare race where another claim of
    one of the keys committed after this statement's snapshot; the caller claims again in
    a new transaction (whose snapshot sees that lease).
    """
    if limit <= 0:
        return []
    kinds = list(kinds)
    refresh_heads(conn, kinds=kinds, pairs=(), aging_seconds=aging_seconds, now=now)
    jobs = as_records(
        Job,
        conn.execute(
            SQL("queue_claim_batch"),
            {
                "kinds": kinds,
                "owner": owner,
                "limit": limit,
                "lease_seconds": float(lease_seconds),
                "key_lock_space": KEY_LOCK_SPACE,
                "now": now,
            },
        ),
    )
    if jobs:
        # their oldest rows and their served counts moved: evaluated now, not when next due
        pairs = sorted({(j.kind, j.tenant or "") for j in jobs})
        refresh_heads(conn, kinds=kinds, pairs=pairs, aging_seconds=aging_seconds, now=now)
    for kind in {j.kind for j in jobs}:
        n = sum(j.kind == kind for j in jobs)
        metrics.claims_total.labels(kind).inc(n)
        metrics.claim_batch_size.labels(kind).observe(n)
    return jobs


def refresh_heads(
    conn: sa.Connection,
    *,
    kinds: Sequence[str],
    pairs: Sequence[tuple[str, str]],
    aging_seconds: float,
    now: datetime | None = None,
) -> int:
    """Evaluate the claim-order heads of `pairs` (kind, tenant or '') and the due heads of
    `kinds` again (never waiting for one another transaction holds); how many it did."""
    return int(
        conn.execute(
            SQL("queue_heads_refresh"),
            {
                "kinds": list(kinds),
                "pair_kinds": [k for k, _ in pairs],
                "pair_tenants": [t for _, t in pairs],
                "aging_seconds": float(aging_seconds),
                "top_priority": TOP_PRIORITY,
                "middle_priority": OWNERLESS_PRIORITY,
                "due_batch": HEADS_DUE_BATCH,
                "recheck_seconds": HEADS_RECHECK_SECONDS,
                "now": now,
            },
        ).scalar_one()
    )


def heartbeat(
    conn: sa.Connection,
    *,
    owner: str,
    jobs: Iterable[Job],
    lease_seconds: float,
    now: datetime | None = None,
) -> set[int]:
    """Extend every lease `owner` holds in one statement; returns the ids it did not extend.

    A missing id may be a lease lost, or a job whose settle committed meanwhile: the caller
    tells them apart (and counts only the first as lost)."""
    jobs = list(jobs)
    if not jobs:
        return set()
    extended = {
        r.id
        for r in conn.execute(
            SQL("queue_heartbeat"),
            {
                "ids": [j.id for j in jobs],
                "tokens": [j.claim_token for j in jobs],
                "owner": owner,
                "lease_seconds": float(lease_seconds),
                "now": now,
            },
        )
    }
    return {j.id for j in jobs} - extended


def leases_not_held(
    conn: sa.Connection, *, owner: str, held_ids: Iterable[int], now: datetime | None = None
) -> list[Job]:
    """The live leases of `owner` that are not among `held_ids`: what a claim whose COMMIT
    reply was lost leased to it (the claim committed; the worker never heard of it)."""
    params = {"owner": owner, "held_ids": sorted(held_ids), "now": now}
    return as_records(Job, conn.execute(SQL("queue_leases_not_held"), params))


def settle(
    conn: sa.Connection,
    *,
    owner: str,
    settles: Sequence[Settle],
    backoff_base_seconds: float,
    backoff_cap_seconds: float,
    now: datetime | None = None,
    draw: Callable[[], float] = random.random,
) -> dict[int, Outcome]:
    """Settle held jobs in one statement, each by its action; the outcome of each that won.

    Write the results of the completes that won in the same transaction. A retry or defer
    that meets an enqueue of its key committed after the statement's snapshot runs again
    (in a savepoint, so only then does the group pay for one).
    """
    if not settles:
        return {}
    base, cap = backoff_base_seconds, backoff_cap_seconds
    params = {
        "ids": [s.job.id for s in settles],
        "tokens": [s.job.claim_token for s in settles],
        "actions": [s.action.value for s in settles],
        "errors": [None if s.error is None else _clip(s.error) for s in settles],
        "untils": [s.until for s in settles],
        "delays": [
            backoff_seconds(s.job.attempts, base_seconds=base, cap_seconds=cap, draw=draw)
            if s.action is SettleAction.RETRY
            else None
            for s in settles
        ],
        "owner": owner,
        "now": now,
    }

    def run() -> Sequence[sa.Row[Any]]:
        return conn.execute(SQL("queue_settle"), params).all()

    requeues = any(s.action in _REQUEUES for s in settles)
    rows = rerun_lost_races(conn, run) if requeues else run()
    actions = {s.job.id: s.action for s in settles}
    won = {r.id: _outcome(actions[r.id], r.state) for r in rows}
    for action in SettleAction:
        asked = sum(s.action is action for s in settles)
        _count_refused(action.value, asked - sum(actions[i] is action for i in won))
    return won


_REQUEUES = frozenset({SettleAction.RETRY, SettleAction.DEFER})


def _outcome(action: SettleAction, state: str) -> Outcome:
    """What a won settle did, as the outcome metrics count it."""
    if action is SettleAction.COMPLETE:
        return Outcome.DONE
    if action is SettleAction.FAIL:
        return Outcome.FAILED
    if action is SettleAction.DEFER:
        return Outcome.DEFERRED  # queued again, or superseded by the key's queued row
    return Outcome.RETRY if state == State.QUEUED else Outcome.DEAD_LETTER


def read_back(conn: sa.Connection, settles: Sequence[Settle]) -> dict[int, Outcome]:
    """What settles whose COMMIT may have been lost did: the outcome of each one the rows
    show committed (the others are left out: their lease was lost, or they never ran)."""
    if not settles:
        return {}
    rows = {
        r.id: r for r in conn.execute(SQL("queue_read_back"), {"ids": [s.job.id for s in settles]})
    }
    found = {s.job.id: committed(s, rows.get(s.job.id)) for s in settles}
    return {i: o for i, o in found.items() if o is not None}


def committed(settle: Settle, row: Any) -> Outcome | None:
    """The outcome `settle` had if `row` (the queue row now, or None) shows it committed.

    The claim token on the row is still this claim's only if no later claim took the row;
    then the row's state, error and attempts tell the settle's own write from the sweeper's
    recovery of the expired lease (last error 'lease expired', attempts unchanged)."""
    job = settle.job
    if row is None or row.claim_token != job.claim_token or row.state == State.LEASED:
        return None
    action = settle.action
    if action is SettleAction.COMPLETE:
        return Outcome.DONE if row.state == State.DONE else None
    if action is SettleAction.FAIL:
        return Outcome.FAILED if row.state == State.FAILED else None
    if action is SettleAction.DEFER:
        given_back = row.attempts == max(job.attempts - 1, 0)
        return Outcome.DEFERRED if given_back and row.state != State.DONE else None
    if row.last_error != (None if settle.error is None else _clip(settle.error)):
        return None
    return Outcome.RETRY if row.state == State.QUEUED else Outcome.DEAD_LETTER


def complete(
    conn: sa.Connection, *, owner: str, jobs: Sequence[Job], now: datetime | None = None
) -> set[int]:
    """Mark held jobs done; returns the ids that won (write only their results, same tx)."""
    settles = [Settle(j, SettleAction.COMPLETE) for j in jobs]
    return set(settle(conn, owner=owner, settles=settles, **_NO_RETRIES, now=now))


def fail(
    conn: sa.Connection,
    *,
    owner: str,
    failures: Sequence[tuple[Job, str]],
    now: datetime | None = None,
) -> set[int]:
    """Mark held jobs failed for good (permanent error kept); returns the ids that won."""
    settles = [Settle(j, SettleAction.FAIL, error=e) for j, e in failures]
    return set(settle(conn, owner=owner, settles=settles, **_NO_RETRIES, now=now))


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
    return settle(
        conn,
        owner=owner,
        settles=[Settle(j, SettleAction.RETRY, error=e) for j, e in failures],
        backoff_base_seconds=backoff_base_seconds,
        backoff_cap_seconds=backoff_cap_seconds,
        now=now,
    )


def defer(
    conn: sa.Connection,
    *,
    owner: str,
    deferrals: Sequence[tuple[Job, datetime | None]],
    now: datetime | None = None,
) -> set[int]:
    """Give held jobs back until a time (None = now) without spending their attempt."""
    settles = [Settle(j, SettleAction.DEFER, until=u) for j, u in deferrals]
    return set(settle(conn, owner=owner, settles=settles, **_NO_RETRIES, now=now))


class _NoBackoff(TypedDict):
    backoff_base_seconds: float
    backoff_cap_seconds: float


# complete, fail and defer retry nothing: no backoff to compute
_NO_RETRIES: _NoBackoff = {"backoff_base_seconds": 0.0, "backoff_cap_seconds": 0.0}


def _count_refused(operation: str, refused: int) -> None:
    if refused > 0:
        metrics.fenced_writes_refused_total.labels(operation).inc(refused)


def _clip(error: str, limit: int = 4000) -> str:
    """Errors are kept on the row, but never unbounded."""
    return error if len(error) <= limit else error[: limit - 1] + "…"
