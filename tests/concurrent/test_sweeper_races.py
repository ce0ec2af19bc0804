"""Lease recovery racing other transactions: a worker settling the row the sweeper is about to
write, and an enqueue of the key the sweeper is about to put back in the queue."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from tests.support.procs import wait_for

from enrichq_schema.tables import queue
from enrichq_sweeper import recovery

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
DEADLINE_SECONDS = 30.0

WAITING = sa.text(
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


def expired(conn: sa.Connection, key: str) -> int:
    return int(
        conn.execute(
            sa.insert(queue)
            .values(
                kind="enrich",
                key=key,
                reason="created",
                state="leased",
                attempts=1,
                max_attempts=5,
                lease_owner="w-old",
                lease_expires_at=T0 - timedelta(seconds=5),
            )
            .returning(queue.c.id)
        ).scalar_one()
    )


def get(engine: sa.Engine, row_id: int) -> sa.Row[tuple[object, ...]]:
    with engine.connect() as conn:
        return conn.execute(sa.select(queue).where(queue.c.id == row_id)).one()


def wait_until_blocked(engine: sa.Engine, job: Future[recovery.BatchOutcome]) -> None:
    """Wait until some session of this database waits for a lock (the sweeper's batch)."""

    def blocked() -> bool:
        with engine.connect() as conn:
            if conn.execute(WAITING).scalar_one():
                return True
        if job.done():
            job.result()
            pytest.fail("the sweeper's batch finished without waiting for the other transaction")
        return False

    wait_for(
        blocked,
        timeout=DEADLINE_SECONDS,
        interval=0.02,
        what="the sweeper's batch to wait for the other transaction",
    )


def sweep_in_thread(engine: sa.Engine) -> tuple[ThreadPoolExecutor, Future[recovery.BatchOutcome]]:
    """Scan and recover one page in a thread; scanned before the function returns."""
    scanned = threading.Event()

    def run() -> recovery.BatchOutcome:
        with engine.begin() as conn:
            page = recovery.scan(conn, after_id=0, batch_size=100, now=T0)
            scanned.set()
            return recovery.recover_batch(conn, page, now=T0)

    pool = ThreadPoolExecutor(max_workers=1)
    job = pool.submit(run)
    if not scanned.wait(DEADLINE_SECONDS):
        pytest.fail("the sweeper never scanned")
    return pool, job


def run_race(
    db_engine: sa.Engine, other: Callable[[sa.Connection], object]
) -> recovery.BatchOutcome:
    """`other` writes in an open transaction; the sweeper's batch runs into it and waits;
    `other` commits; the batch finishes."""
    with db_engine.connect() as conn:
        tx = conn.begin()
        other(conn)
        pool, job = sweep_in_thread(db_engine)
        try:
            wait_until_blocked(db_engine, job)
            tx.commit()
            return job.result(timeout=DEADLINE_SECONDS)
        finally:
            if tx.is_active:
                tx.rollback()
            pool.shutdown(wait=True)


def test_a_worker_settling_the_row_while_the_batch_waits_wins(db_engine: sa.Engine) -> None:
    with db_engine.begin() as conn:
        settled = expired(conn, "T-1")
        other = expired(conn, "T-2")

    def worker_completes(conn: sa.Connection) -> None:
        # the lease ran out while the worker was writing; its fenced write got there first
        conn.execute(
            sa.update(queue)
            .where(queue.c.id == settled)
            .values(state="done", finished_at=T0, lease_owner=None, lease_expires_at=None)
        )

    outcome = run_race(db_engine, worker_completes)
    assert get(db_engine, settled).state == "done"
    assert get(db_engine, settled).last_error is None
    # the page's other expired row is still recovered
    assert outcome.promoted == (other,)


def test_an_enqueue_committed_during_the_batch_supersedes_instead_of_failing(
    db_engine: sa.Engine,
) -> None:
    with db_engine.begin() as conn:
        lost = expired(conn, "T-1")
    fresh: list[int] = []

    def enqueue(conn: sa.Connection) -> None:
        fresh.append(
            int(
                conn.execute(
                    sa.insert(queue)
                    .values(kind="enrich", key="T-1", reason="updated", max_attempts=5)
                    .returning(queue.c.id)
                ).scalar_one()
            )
        )

    outcome = run_race(db_engine, enqueue)
    [queued_id] = fresh
    assert outcome.promoted == ()
    assert outcome.superseded == ((lost, queued_id),)
    row = get(db_engine, lost)
    assert (row.state, row.dead_reason, row.superseded_by) == (
        "dead_letter",
        "superseded",
        queued_id,
    )
    assert get(db_engine, queued_id).state == "queued"


def test_a_whole_pass_whose_write_loses_an_enqueue_race_does_the_page_again(
    db_engine: sa.Engine,
) -> None:
    """run_once writes a page without a savepoint: the violation rolls the page back, and
    the page is done again from a scan that sees the new queued row."""
    with db_engine.begin() as conn:
        lost = expired(conn, "T-1")
        other = expired(conn, "T-2")
    with db_engine.connect() as conn:
        tx = conn.begin()
        [queued_id] = conn.execute(
            sa.insert(queue)
            .values(kind="enrich", key="T-1", reason="updated", max_attempts=5)
            .returning(queue.c.id)
        ).scalars()
        pool = ThreadPoolExecutor(max_workers=1)
        job = pool.submit(lambda: recovery.run_once(db_engine, now=T0, gave_up_hook=None))
        try:
            # the pass's promotion of T-1 waits on the uncommitted queued row's index entry
            def waiting() -> bool:
                with db_engine.connect() as probe:
                    return bool(probe.execute(WAITING).scalar_one())

            wait_for(waiting, timeout=DEADLINE_SECONDS, interval=0.02, what="the pass to wait")
            tx.commit()
            result = job.result(timeout=DEADLINE_SECONDS)
        finally:
            if tx.is_active:
                tx.rollback()
            pool.shutdown(wait=True)
    assert (result.promoted, result.superseded) == (1, 1)
    row = get(db_engine, lost)
    assert (row.state, row.superseded_by) == ("dead_letter", queued_id)
    assert get(db_engine, other).state == "queued"
