"""Lease recovery: expired leases back to the queue, or to the dead letters, a page per
transaction."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa

from enrichq_schema.db import as_record
from enrichq_schema.process import PluginError, load_callable
from enrichq_schema.states import LEASE_EXPIRED_ERROR, NOTIFY_CHANNEL
from enrichq_sweeper.common import (
    DEFAULT_BATCH_SIZE,
    STATEMENT_TIMEOUT_SECONDS_DEFAULT,
    BatchedPass,
    retry_races,
    set_statement_timeout,
    sql,
)
from enrichq_sweeper.errors import HookError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Expired:
    """One expired lease as the scan saw it."""

    id: int
    kind: str
    key: str
    attempts: int
    max_attempts: int


@dataclass(frozen=True, slots=True)
class GaveUp:
    """A row whose attempts were spent when its lease expired: what the gave-up hook gets."""

    id: int
    kind: str
    key: str
    tenant: str | None
    attempts: int
    max_attempts: int
    lease_owner: str
    lease_expires_at: datetime
    payload: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What one page's write did: promoted ids, (superseded id, by id) pairs, spent rows."""

    promoted: tuple[int, ...] = ()
    superseded: tuple[tuple[int, int], ...] = ()
    exhausted: tuple[GaveUp, ...] = ()
    promoted_kinds: frozenset[str] = field(default_factory=frozenset)

    @property
    def rows(self) -> int:
        """Rows this write changed."""
        return len(self.promoted) + len(self.superseded) + len(self.exhausted)


@dataclass(frozen=True, slots=True)
class RecoveryResult(BatchedPass):
    """One pass of lease recovery: what became of the expired leases it found."""

    promoted: int = 0
    superseded: int = 0
    exhausted: int = 0
    max_batch_rows: int = 0
    hook_errors: int = 0

    @property
    def recovered(self) -> int:
        """Expired leases this pass dealt with, whatever became of them."""
        return self.promoted + self.superseded + self.exhausted


GaveUpHook = Callable[[Sequence[GaveUp]], None]


def log_gave_up(rows: Sequence[GaveUp]) -> None:
    """The default gave-up hook: one warning per row (the pass counts them in the metrics)."""
    for row in rows:
        log.warning(
            "gave up on %s %s (queue id %d) after %d/%d attempts; last lease %s expired at %s",
            row.kind,
            row.key,
            row.id,
            row.attempts,
            row.max_attempts,
            row.lease_owner,
            row.lease_expires_at.isoformat(),
        )
    log.warning("gave up on %d row(s) whose attempts were spent", len(rows))


def load_hook(path: str) -> GaveUpHook:
    """The callable named by `path` ("package.module:function"); HookError if there is none."""
    try:
        return cast(GaveUpHook, load_callable(path))
    except PluginError as exc:
        raise HookError(f"gave-up hook {exc}") from None


def scan(
    conn: sa.Connection, *, after_id: int, batch_size: int, now: datetime | None = None
) -> list[Expired]:
    """Up to `batch_size` expired leases with id above `after_id`, lowest id first."""
    rows = conn.execute(
        sql()("recovery_scan"), {"after_id": after_id, "batch_size": batch_size, "now": now}
    ).all()
    return [Expired(*r) for r in rows]


@dataclass(frozen=True, slots=True)
class ExpiredPage:
    """A page of expired leases as a pass needs it: ids in the lock order, the cursor."""

    ids: tuple[int, ...]  # (key, kind, id) in byte order, as `lock_order` sorts
    last_id: int  # the highest id of the page (0 when empty)


def scan_page(
    conn: sa.Connection, *, after_id: int, batch_size: int, now: datetime | None = None
) -> ExpiredPage:
    """The page `scan` reads, in one row: no object per lease, no sort in Python."""
    ids, last_id, _ = conn.execute(
        sql()("recovery_scan_page"),
        {"after_id": after_id, "batch_size": batch_size, "now": now},
    ).one()
    return ExpiredPage(tuple(ids or ()), int(last_id or 0))


def lock_order(row: Expired) -> tuple[bytes, bytes, int]:
    """The global lock order of queue rows, (key, kind, id) in byte order (sql/queue.sql)."""
    return row.key.encode(), row.kind.encode(), row.id


def recover_batch(
    conn: sa.Connection,
    page: Sequence[Expired],
    *,
    now: datetime | None = None,
    rerun_lost_races: bool = True,
) -> BatchOutcome:
    """Recover the rows of `page` that are still expired leases; the caller commits.

    A row settled or extended by its worker since the scan is left alone. An enqueue of
    one of the keys that commits during the statement makes it run again (in a savepoint),
    never a violation of the queued-key index; with `rerun_lost_races=False` there is no
    savepoint (two round trips fewer) and that violation reaches the caller, whose
    transaction is then spent: `run_once` rolls it back and does the page again.
    """
    if not page:
        return BatchOutcome()
    ordered = [e.id for e in sorted(page, key=lock_order)]
    return _write(conn, ordered, now=now, rerun_lost_races=rerun_lost_races)


def _write(
    conn: sa.Connection, ids: Sequence[int], *, now: datetime | None, rerun_lost_races: bool
) -> BatchOutcome:
    """`recover_batch` of the rows `ids`, given in the lock order."""
    params = {
        "ids": list(ids),
        "lease_expired": LEASE_EXPIRED_ERROR,
        "channel": NOTIFY_CHANNEL,
        "now": now,
    }

    def write() -> Sequence[sa.Row[Any]]:
        return conn.execute(sql()("recovery_recover_batch"), params).all()

    rows = retry_races(conn, write) if rerun_lost_races else write()
    promoted: list[int] = []
    superseded: list[tuple[int, int]] = []
    exhausted: list[GaveUp] = []
    kinds: set[str] = set()
    for r in rows:
        if r.action == "promote":
            promoted.append(r.id)
            kinds.add(r.kind)
        elif r.action == "supersede":
            superseded.append((r.id, r.winner))
        else:
            exhausted.append(as_record(GaveUp, r))
    return BatchOutcome(tuple(promoted), tuple(superseded), tuple(exhausted), frozenset(kinds))


def _recover_page(
    conn: sa.Connection, page: ExpiredPage, now: datetime | None, *, savepoint: bool
) -> BatchOutcome | None:
    """`recover_batch`, without a savepoint unless asked; None (and the transaction rolled
    back) when an enqueue committed during the write took a key's queued slot: the caller
    does the page again, from a new scan that sees that row (with a savepoint then, so a
    key enqueued over and over cannot keep the page from finishing)."""
    if savepoint:
        return _write(conn, page.ids, now=now, rerun_lost_races=True)
    import sqlalchemy.exc as sa_exc

    from enrichq_schema.errors import constraint_name
    from enrichq_schema.tables import QUEUED_KEY_INDEX

    try:
        return _write(conn, page.ids, now=now, rerun_lost_races=False)
    except sa_exc.IntegrityError as exc:
        if constraint_name(exc) != QUEUED_KEY_INDEX:
            raise
        conn.rollback()
        return None


def run_once(
    engine: sa.Engine,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    now: datetime | None = None,
    gave_up_hook: GaveUpHook | None = log_gave_up,
    statement_timeout_seconds: float = STATEMENT_TIMEOUT_SECONDS_DEFAULT,
    should_stop: Callable[[], bool] | None = None,
) -> RecoveryResult:
    """One recovery pass over every expired lease, one transaction per page of `batch_size`.

    A page's write covers all expired rows of the page's keys, so a transaction changes at
    most `batch_size` keys' worth of rows (a key has few leases: claims never lease a key
    whose lease is live). Spent rows go to `gave_up_hook` after their page commits, so at
    most once: a crash in between loses the call, and the rows wait in the dead letters
    (`enrichq dlq list --reason attempts_exhausted`). A hook that raises is logged and
    counted, and the pass goes on (the rows are dead already).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    started = time.perf_counter()
    promoted = superseded = exhausted = batches = max_rows = hook_errors = 0
    max_held = 0.0
    stopped = lost_race = False
    after_id = 0
    # one connection for the whole pass: no pool checkout (and its liveness ping) per page
    with engine.connect() as conn:
        while True:
            if should_stop is not None and should_stop():
                stopped = True
                break
            with conn.begin():
                set_statement_timeout(conn, statement_timeout_seconds)
                page = scan_page(conn, after_id=after_id, batch_size=batch_size, now=now)
                if not page.ids:
                    break
                locked_at = time.perf_counter()
                outcome = _recover_page(conn, page, now, savepoint=lost_race)
            lost_race = outcome is None
            if outcome is None:
                continue  # an enqueue won the race for a key: the page again, from its scan
            # from the write's first lock to the commit that released them
            max_held = max(max_held, time.perf_counter() - locked_at)
            batches += 1
            max_rows = max(max_rows, outcome.rows)
            promoted += len(outcome.promoted)
            superseded += len(outcome.superseded)
            exhausted += len(outcome.exhausted)
            if outcome.exhausted and gave_up_hook is not None:
                try:
                    gave_up_hook(outcome.exhausted)
                except Exception:
                    hook_errors += 1
                    ids = ", ".join(str(g.id) for g in outcome.exhausted)
                    log.exception("the gave-up hook failed for queue ids %s", ids)
            after_id = page.last_id
            if len(page.ids) < batch_size:
                break
    return RecoveryResult(
        promoted=promoted,
        superseded=superseded,
        exhausted=exhausted,
        batches=batches,
        duration_seconds=time.perf_counter() - started,
        max_batch_seconds=max_held,
        max_batch_rows=max_rows,
        hook_errors=hook_errors,
        stopped=stopped,
    )
