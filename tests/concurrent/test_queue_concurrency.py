"""The queue under real concurrency: many processes claiming, many sessions racing one key."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from tests.support.claimer import ClaimReport, claim_until_empty
from tests.support.procs import wait_for
from tests.support.settings import make_settings
from tests.support.threads import run_together

from enrichq_schema.db import create_engine
from enrichq_schema.errors import constraint_name
from enrichq_schema.settings import Settings
from enrichq_schema.tables import QUEUED_KEY_INDEX
from enrichq_service import queue
from enrichq_service.queue import EnqueueRequest, EnqueueResult

REPO = Path(__file__).resolve().parents[2]
PROCESSES = 8
ROWS = 20_000
BATCHES = (1, 4, 16, 25, 32, 50, 64, 100)
RETRY_EVERY = 97  # ids divisible by this are retried once, so some rows get a second attempt
T = TypeVar("T")


def count_states(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT state, count(*) AS n FROM enrichq.queue GROUP BY state")
        )
        return {row.state: row.n for row in rows}


# -- (a) eight processes drain 20,000 rows


def test_eight_processes_never_share_a_row_and_finish_each_once(
    db_url: str, db_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_settings(db_url, max_attempts=3)
    with db_engine.begin() as conn:
        results = queue.enqueue(
            conn, [EnqueueRequest.build(key=f"T-{i}") for i in range(ROWS)], settings=cfg
        )
    ids = {r.id for r in results if r.id is not None}
    assert len(ids) == ROWS

    monkeypatch.syspath_prepend(str(REPO))  # spawned children import tests.support.claimer
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(PROCESSES)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=claim_until_empty,
            kwargs={
                "url": db_url,
                "owner": f"w{n}",
                # batch sizes 1 to 100: small batches interleave, large ones overlap SKIP LOCKED
                "batch": BATCHES[n],
                "retry_every": RETRY_EVERY,
                "start": start,
                "out": out,
            },
        )
        for n in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    reports: list[ClaimReport] = []
    try:
        for _ in procs:
            reports.append(out.get(timeout=120))
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    assert [r.error for r in reports] == [None] * PROCESSES

    # every (row, attempt) was handed to exactly one owner, once
    claims = Counter(c for r in reports for c in r.claims)
    assert max(claims.values()) == 1, [c for c, n in claims.items() if n > 1][:10]
    owners_of = Counter((row_id, attempt) for r in reports for row_id, attempt in set(r.claims))
    assert set(owners_of.values()) == {1}
    # attempts are 1, then 2 after the one retry
    attempts_by_row: dict[int, set[int]] = {}
    for row_id, attempt in claims:
        attempts_by_row.setdefault(row_id, set()).add(attempt)
    retried = {row_id for r in reports for row_id, _ in r.retried}
    assert retried == {i for i in ids if i % RETRY_EVERY == 0}
    assert all(attempts_by_row[i] == ({1, 2} if i in retried else {1}) for i in ids)
    # every row was completed exactly once, and the table agrees
    completed = Counter(row_id for r in reports for row_id, _ in r.completed)
    assert set(completed) == ids
    assert max(completed.values()) == 1
    assert count_states(db_engine) == {"done": ROWS}
    with db_engine.connect() as conn:
        stored = {
            row.id: row.attempts
            for row in conn.execute(sa.text("SELECT id, attempts FROM enrichq.queue"))
        }
    assert stored == {i: max(a) for i, a in attempts_by_row.items()}
    # the work really was shared
    assert sum(1 for r in reports if r.claims) >= 2


# -- (b) fifty sessions enqueue one ticket at once


def test_fifty_concurrent_enqueues_of_one_ticket_leave_one_queued_row(
    db_url: str, settings: Settings
) -> None:
    engine = create_engine(db_url, pool_size=50)
    try:

        def enqueue_once() -> EnqueueResult:
            with engine.begin() as conn:
                [result] = queue.enqueue(
                    conn, [EnqueueRequest.build(key="T-1", reason="updated")], settings=settings
                )
                return result

        # warm the pool: every call gets its own, already open connection
        with engine.connect(), engine.connect():
            pass
        results = run_together([enqueue_once] * 50)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == []
        outcomes = [r for r in results if isinstance(r, EnqueueResult)]
        assert sum(r.inserted for r in outcomes) == 1
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT id, state FROM enrichq.queue WHERE key = 'T-1'")
            ).all()
        assert len(rows) == 1
        assert rows[0].state == "queued"
        [inserted] = [r for r in outcomes if r.inserted]
        assert inserted.id == rows[0].id
    finally:
        engine.dispose()


def test_a_merge_that_waited_for_the_insert_reports_the_row_it_merged_into(
    db_url: str, settings: Settings
) -> None:
    """An enqueue that blocks on an uncommitted insert of its key merges into that row once it
    commits, and must say which row: the contract is "the id it inserted or merged into"."""
    engine = create_engine(db_url, pool_size=2)
    second = create_engine(db_url, pool_size=1, application_name="enrichq-merge-second")
    try:
        with engine.connect() as first:
            tx = first.begin()
            [inserted] = queue.enqueue(first, [EnqueueRequest.build(key="T-1")], settings=settings)
            assert inserted.inserted

            def second_enqueue() -> EnqueueResult:
                with second.begin() as conn:
                    [result] = queue.enqueue(
                        conn, [EnqueueRequest.build(key="T-1")], settings=settings
                    )
                    return result

            def second_is_waiting() -> bool:
                # a transaction of its own per look: pg_stat_activity is a snapshot per transaction
                with engine.connect() as watcher:
                    waiting = watcher.execute(
                        sa.text(
                            "SELECT count(*) FROM pg_stat_activity"
                            " WHERE application_name = 'enrichq-merge-second'"
                            "   AND wait_event_type = 'Lock'"
                        )
                    ).scalar_one()
                return bool(waiting == 1)

            outcome: list[EnqueueResult | BaseException] = []
            thread = threading.Thread(target=lambda: outcome.extend(run_together([second_enqueue])))
            thread.start()
            # the second enqueue waits for the first transaction (its conflicting insert)
            wait_for(second_is_waiting)
            tx.commit()
            thread.join(30)
        [merged] = outcome
        assert isinstance(merged, EnqueueResult)
        assert not merged.inserted
        assert merged.id == inserted.id
    finally:
        engine.dispose()
        second.dispose()


# -- (c) retries and defers race enqueues of the same key


KEYS = 20
ROUNDS = 15


def test_retries_and_defers_racing_enqueues_never_fail_nor_double_queue(db_url: str) -> None:
    cfg = make_settings(db_url, max_attempts=4)
    engine = create_engine(db_url, pool_size=2 * KEYS)
    superseding_reruns = Counter[str]()

    @sa.event.listens_for(engine, "handle_error")
    def count_reruns(context: sa.engine.ExceptionContext) -> None:
        if isinstance(context.sqlalchemy_exception, sa_exc.IntegrityError):
            superseding_reruns[constraint_name(context.sqlalchemy_exception) or "?"] += 1

    keys = [f"T-{k}" for k in range(KEYS)]
    outcomes: Counter[str] = Counter()
    try:
        with engine.begin() as conn:
            queue.enqueue(conn, [EnqueueRequest.build(key=k) for k in keys], settings=cfg)
        for round_no in range(ROUNDS):
            with engine.begin() as conn:
                jobs = queue.claim(conn, kinds=("enrich",), owner="w", limit=KEYS, lease_seconds=60)
            assert sorted(j.key for j in jobs) == sorted(keys), f"round {round_no}"

            def settle(job: queue.Job, use_defer: bool) -> str:
                with engine.begin() as conn:
                    if use_defer:
                        won = queue.defer(conn, owner="w", deferrals=[(job, None)])
                        return "deferred" if won else "lost"
                    outcome = queue.retry(
                        conn,
                        owner="w",
                        failures=[(job, "flaky")],
                        backoff_base_seconds=0,
                        backoff_cap_seconds=0,
                    )
                    return str(outcome.get(job.id, "lost"))

            def enqueue(key: str) -> str:
                with engine.begin() as conn:
                    [result] = queue.enqueue(conn, [EnqueueRequest.build(key=key)], settings=cfg)
                    return "inserted" if result.inserted else "merged"

            calls: list[Callable[[], str]] = []
            for n, job in enumerate(jobs):
                use_defer = (n + round_no) % 2 == 0
                calls.append(lambda job=job, d=use_defer: settle(job, d))  # type: ignore[misc]  # default-bound loop variables
                calls.append(lambda key=job.key: enqueue(key))  # type: ignore[misc]  # default-bound loop variable
            results = run_together(calls)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert errors == [], f"round {round_no}: {errors[:3]}"
            outcomes.update(str(r) for r in results)
            assert "lost" not in outcomes

            with engine.connect() as conn:
                queued = conn.execute(
                    sa.text(
                        "SELECT key, count(*) FROM enrichq.queue WHERE state = 'queued'"
                        " GROUP BY key ORDER BY key"
                    )
                ).all()
                bad_supersedes = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM enrichq.queue AS d"
                        " LEFT JOIN enrichq.queue AS w ON w.id = d.superseded_by"
                        " WHERE d.dead_reason = 'superseded'"
                        "   AND (w.id IS NULL OR w.key <> d.key OR w.id = d.id)"
                    )
                ).scalar_one()
            assert [(k, n) for k, n in queued] == [(k, 1) for k in sorted(keys)], round_no
            assert bad_supersedes == 0
            assert count_states(engine).get("leased", 0) == 0
        # both sides of the race were seen: the settle first (the enqueue merged into it) and
        # the enqueue first (the settled row was superseded by the new one)
        with engine.connect() as conn:
            superseded = conn.execute(
                sa.text("SELECT count(*) FROM enrichq.queue WHERE dead_reason = 'superseded'")
            ).scalar_one()
        assert outcomes["merged"] > 0
        assert superseded > 0
        # the settle statements met the queued-key race (a row inserted after their snapshot)
        # and re-ran instead of failing; no other constraint was ever violated
        assert superseding_reruns[QUEUED_KEY_INDEX] > 0
        assert set(superseding_reruns) == {QUEUED_KEY_INDEX}
    finally:
        engine.dispose()
