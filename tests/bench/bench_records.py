"""Rows to records: `enrichq_schema.db.as_record` and `as_records` against a record built
field by field.

The claim turns the rows it returns into `Job`s with `as_records` (one column match for
the whole result), on the worker's hot path; this measures the three ways over the same
rows of a real claim's columns (UUID, timestamptz and jsonb values from Postgres), side by
side in one process.

    python -m tests.bench.bench_records [--rows 50] [--rounds 2000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from enrichq_schema.db import as_record, as_records, create_engine
from enrichq_service import queue
from enrichq_service.queue import EnqueueRequest, Job
from tests.bench.common import print_table, scratch_database
from tests.support.settings import make_settings

# the claim's columns (queue_claim_batch returns these), read from freshly enqueued rows
CLAIMED = sa.text(
    "SELECT id, kind, key, tenant, reason, payload, attempts, max_attempts,"
    " gen_random_uuid() AS claim_token, now() AS lease_expires_at, created_at, last_error,"
    " now() AS claimed_at FROM enrichq.queue ORDER BY id"
)


def by_hand(r: Any) -> Job:
    return Job(
        id=r.id,
        kind=r.kind,
        key=r.key,
        tenant=r.tenant,
        reason=r.reason,
        payload=r.payload,
        attempts=r.attempts,
        max_attempts=r.max_attempts,
        claim_token=r.claim_token,
        lease_expires_at=r.lease_expires_at,
        created_at=r.created_at,
        last_error=r.last_error,
        claimed_at=r.claimed_at,
    )


def best_per_row(build: Callable[[Any], Job], rows: Sequence[Any], rounds: int) -> float:
    """Microseconds per row, the best of five timings of `rounds` passes over `rows`."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(rounds):
            for r in rows:
                build(r)
        best = min(best, time.perf_counter() - started)
    return best / (rounds * len(rows)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50, help="rows of one claim batch")
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    with scratch_database("records") as url:
        engine = create_engine(url)
        settings = make_settings(url)
        with engine.begin() as conn:
            requests = [EnqueueRequest.build(key=f"T-{i}", tenant="acme") for i in range(args.rows)]
            queue.enqueue(conn, requests, settings=settings)
            frozen = conn.execute(CLAIMED).freeze()
        engine.dispose()
    rows = frozen().all()
    assert [by_hand(r) for r in rows] == [as_record(Job, r) for r in rows]
    assert as_records(Job, frozen()) == [by_hand(r) for r in rows]
    hand = best_per_row(by_hand, rows, args.rounds)
    record = best_per_row(lambda r: as_record(Job, r), rows, args.rounds)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(args.rounds):
            as_records(Job, frozen())
        best = min(best, time.perf_counter() - started)
    records = best / (args.rounds * len(rows)) * 1e6
    print_table(
        f"a claim's rows to Jobs ({len(rows)} rows, best of 5 x {args.rounds:,} passes)",
        ["way", "µs per row", "x by hand"],
        [
            ["field by field", hand, 1.0],
            ["as_record, a row at a time", record, record / hand],
            ["as_records, the claim's whole result", records, records / hand],
        ],
    )


if __name__ == "__main__":
    main()
