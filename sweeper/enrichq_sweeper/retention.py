"""Retention: delete terminal rows and old bookkeeping past their age (DESIGN §3, prune).

Every delete is a page of at most `batch_size` rows in its own short transaction, chosen
with SKIP LOCKED, so retention never holds many locks nor waits for anybody.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from enrichq_schema.queries import load
from enrichq_schema.settings import EVENT_DEDUPE_HOURS_DEFAULT
from enrichq_sweeper.common import (
    DEFAULT_BATCH_SIZE,
    STATEMENT_TIMEOUT_SECONDS_DEFAULT,
    BatchedPass,
    set_statement_timeout,
    sql,
)

SECONDS_PER_DAY = 86_400.0
SECONDS_PER_HOUR = 3600.0
# Claim counts feed the claim's fairness over the last day; two days leaves a margin.
TENANT_SERVED_RETENTION_SECONDS = 2 * SECONDS_PER_DAY


@dataclass(frozen=True, slots=True)
class PruneResult(BatchedPass):
    """One retention pass: rows deleted per table (queue rows by state)."""

    @property
    def pruned(self) -> int:
        """Queue rows deleted."""
        return self.done + self.failed + self.dead_letter

    done: int = 0
    failed: int = 0
    dead_letter: int = 0
    tenant_served: int = 0
    lookup_log: int = 0
    runs: int = 0
    seen_events: int = 0

    def counts(self) -> dict[str, float]:
        """What the run log records: the rows deleted per table, and their queue total."""
        return {**BatchedPass.counts(self), "pruned": self.pruned}


def _statement(name: str) -> sa.TextClause:
    """A retention statement: the seen-event prune has a file of its own (sql/events.sql)."""
    events = load("enrichq_sweeper", "sql/events.sql")
    return events(name) if name in events else sql()(name)


def run_once(
    engine: sa.Engine,
    *,
    retention_days: float,
    dead_letter_retention_days: float,
    batch_size: int = DEFAULT_BATCH_SIZE,
    now: datetime | None = None,
    statement_timeout_seconds: float = STATEMENT_TIMEOUT_SECONDS_DEFAULT,
    should_stop: Callable[[], bool] | None = None,
    event_dedupe_hours: float = EVENT_DEDUPE_HOURS_DEFAULT,
) -> PruneResult:
    """Delete old terminal queue rows, claim buckets, lookup-log and run-log rows, by pages.

    done/failed rows, lookup-log and run-log rows go after `retention_days`, dead letters
    after `dead_letter_retention_days` (queue rows and runs by when they ended), claim
    buckets after two days, webhook event ids past the dedupe window (`event_dedupe_hours`).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if retention_days <= 0 or dead_letter_retention_days <= 0:
        raise ValueError("retention periods must be positive")
    started = time.perf_counter()
    ages = {
        "retention_prune_finished": retention_days * SECONDS_PER_DAY,
        "retention_prune_dead": dead_letter_retention_days * SECONDS_PER_DAY,
        "retention_prune_tenant_served": TENANT_SERVED_RETENTION_SECONDS,
        "retention_prune_lookup_log": retention_days * SECONDS_PER_DAY,
        "retention_prune_runs": retention_days * SECONDS_PER_DAY,
        "retention_prune_seen_events": event_dedupe_hours * SECONDS_PER_HOUR,
    }
    # Cutoffs are fixed once per pass, so later pages never chase a moving clock.
    with engine.connect() as conn:
        cutoffs = {
            query: conn.execute(
                sql()("retention_cutoff"), {"now": now, "seconds": seconds}
            ).scalar_one()
            for query, seconds in ages.items()
        }
    deleted: Counter[str] = Counter()
    batches = 0
    max_held = 0.0
    stopped = False
    for query, cutoff in cutoffs.items():
        while not stopped:
            if should_stop is not None and should_stop():
                stopped = True
                break
            began = time.perf_counter()
            with engine.begin() as conn:
                set_statement_timeout(conn, statement_timeout_seconds)
                rows = conn.execute(
                    _statement(query), {"cutoff": cutoff, "batch_size": batch_size}
                ).all()
            max_held = max(max_held, time.perf_counter() - began)
            page = sum(int(r.n) for r in rows)
            deleted.update({str(r.what): int(r.n) for r in rows})
            batches += 1 if page else 0
            if page < batch_size:
                break
    # one count per table (per state for the queue), named like the result's fields
    return PruneResult(
        batches=batches,
        duration_seconds=time.perf_counter() - started,
        max_batch_seconds=max_held,
        stopped=stopped,
        **deleted,
    )
