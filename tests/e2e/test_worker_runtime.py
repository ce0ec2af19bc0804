"""The worker runtime's promises under bad results, hung plug-ins, lost replies and budgets.

Each test drives a real worker (in this process, or `enrichq worker` processes) against
real PostgreSQL into the situation that broke a promise (issue 13), and holds it to it:
one bad result fails that job alone and the worker goes on; an attempt that never started
never spends an attempt; every lookup that ran is logged and charged exactly once; the
fleet overspends its daily budget by at most one lookup per worker; lookup times come from
the database clock; a heartbeat never calls a settled job lost.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY
from tests.support.commit_cutter import cutting
from tests.support.db import q
from tests.support.enrichers import BAD_FIELDS, BAD_KINDS
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.settings import make_settings
from tests.support.world import seeded

from enrichq_schema.db import create_engine
from enrichq_service.worker import RunResult, Worker

pytestmark = pytest.mark.slow


@contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    """`worker.run()` on a thread for the block; stopped and joined after it."""
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop.set()
        thread.join(30)


def drain_in_thread(worker: Worker, *, timeout: float) -> RunResult | None:
    """`worker.run(drain=True)` on a thread; its result, or None (and stopped) if it did
    not finish on its own within `timeout` seconds."""
    out: list[RunResult] = []
    thread = threading.Thread(target=lambda: out.append(worker.run(drain=True)), daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        worker.stop.set()
        thread.join(30)
        return None
    return out[0]


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- 1. one bad result fails its job alone; the worker goes on and drains

EXPECTED_FAILURE = {
    **{kind: ("failed", field) for kind, field in BAD_FIELDS.items()},
    # not a result but an error text: kept, its NUL made printable, and retried as usual
    "nul_error": ("dead_letter", "warehouse said \\x00 and hung up"),
}


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_one_bad_result_fails_that_job_and_the_worker_drains(
    db_url: str, db_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    keys = seeded(db_engine, 30)
    bad = keys[7]
    monkeypatch.setenv("ENRICHQ_TEST_BAD_TICKET", bad)
    monkeypatch.setenv("ENRICHQ_TEST_BAD_KIND", kind)
    with db_engine.begin() as conn:
        conn.execute(sa.text("UPDATE enrichq.queue SET max_attempts = 1"))
    settings = make_settings(db_url, enricher="tests.support.enrichers:bad_result", concurrency=4)
    result = drain_in_thread(Worker(settings, db_engine), timeout=60)
    assert result is not None, "the worker never finished draining"
    assert result.stop_reason == "no_work"
    state, error = q(
        db_engine, "SELECT state, last_error FROM enrichq.queue WHERE key = :k", k=bad
    )[0]
    want_state, names = EXPECTED_FAILURE[kind]
    assert state == want_state
    assert names in error
    assert "\x00" not in error
    others = q(
        db_engine, "SELECT state, count(*) FROM enrichq.queue WHERE key <> :k GROUP BY 1", k=bad
    )
    assert others == [("done", len(keys) - 1)]
    # nothing of the bad result was written
    assert q(
        db_engine, "SELECT count(*) FROM enrichq.ticket_orders WHERE ticket_id = :k", k=bad
    ) == [(0,)]


# -- 2. an attempt that never started never spends an attempt; abandoned work never runs


def test_jobs_behind_hung_plug_ins_never_lose_attempts(
    db_url: str, db_engine: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four tickets whose lookups hang, deaf to cancellation, and eight good ones; two
    slots and a one-second attempt deadline. A good ticket is claimed only when it can start
    at once, so every one of them ends done on its first attempt, with one lookup."""
    hung = ("H-1", "H-2", "H-3", "H-4")
    keys = seeded(db_engine, 8, extra=hung)
    started = tmp_path / "started"
    started.mkdir()
    monkeypatch.setenv("ENRICHQ_TEST_STARTED_DIR", str(started))
    monkeypatch.setenv("ENRICHQ_TEST_SLOW_SECONDS", "12")
    with db_engine.begin() as conn:
        conn.execute(sa.text("UPDATE enrichq.queue SET max_attempts = 2"))
    settings = make_settings(
        db_url,
        enricher="tests.support.enrichers:hang_on_h",
        concurrency=2,
        attempt_deadline_seconds=1,
        backoff_base_seconds=30,
        backoff_cap_seconds=30,
        shutdown_grace_seconds=0,
    )
    good = [k for k in keys if not k.startswith("H")]
    with running(Worker(settings, db_engine)):
        wait_for(
            lambda: (
                q(
                    db_engine,
                    "SELECT count(*) FROM enrichq.queue WHERE key = ANY(:k) AND state = 'done'",
                    k=good,
                )
                == [(len(good),)]
            ),
            timeout=90,
            what="every good ticket to be done",
        )
    starts: dict[str, int] = {}
    for marker in started.iterdir():
        key = marker.name.rsplit(".", 1)[0]
        starts[key] = starts.get(key, 0) + 1
    rows = q(
        db_engine,
        "SELECT key, attempts FROM enrichq.queue WHERE key = ANY(:k) AND state = 'done'",
        k=good,
    )
    assert sorted(rows) == [(k, 1) for k in sorted(good)]
    assert {k: starts.get(k, 0) for k in good} == dict.fromkeys(good, 1)
    # a hung ticket's attempts are spent by attempts that started, never by waiting
    for key, attempts in q(
        db_engine, "SELECT key, attempts FROM enrichq.queue WHERE key = ANY(:k)", k=list(hung)
    ):
        assert attempts <= starts.get(key, 0), (key, attempts, starts.get(key))


SLOW_ORDERS = """
CREATE FUNCTION warehouse.ten_seconds_later() RETURNS boolean LANGUAGE plpgsql VOLATILE AS
$$ BEGIN PERFORM pg_sleep(10); RETURN true; END $$;
CREATE VIEW warehouse.slow_orders AS
SELECT o.* FROM warehouse.orders AS o WHERE warehouse.ten_seconds_later()
"""


def test_the_built_in_lookup_stops_at_the_attempt_deadline(
    db_url: str, db_engine: sa.Engine
) -> None:
    """A warehouse query slower than the attempt is cut by a statement timeout of the
    attempt's remaining time: nothing keeps running on the warehouse after the deadline."""
    keys = seeded(db_engine, 3)
    with db_engine.begin() as conn:
        conn.execute(sa.text(SLOW_ORDERS))
        conn.execute(sa.text("UPDATE enrichq.queue SET max_attempts = 1"))
    settings = make_settings(
        db_url,
        orders_table="warehouse.slow_orders",
        attempt_deadline_seconds=1.5,
        concurrency=3,
    )
    result = drain_in_thread(Worker(settings, db_engine), timeout=30)
    assert result is not None
    rows = q(db_engine, "SELECT state, last_error FROM enrichq.queue ORDER BY key")
    assert len(rows) == len(keys)
    assert all(state == "dead_letter" for state, _ in rows), rows
    # the statement timeout and the runtime's own deadline race; either way the query is
    # cancelled on the warehouse, which is what the next assertion checks
    assert all(
        "statement timeout" in (error or "") or "deadline" in (error or "") for _, error in rows
    ), rows
    sleeping = q(
        db_engine,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND state = 'active' AND query LIKE '%slow_orders%' AND pid <> pg_backend_pid()",
    )
    assert sleeping == [(0,)]


# -- 3 and 4. every lookup that ran is logged and charged, exactly once


def test_a_lost_commit_reply_charges_once_and_counts_done(
    db_url: str, db_engine: sa.Engine
) -> None:
    """The settle's COMMIT reaches the server, its reply never reaches the worker."""
    seeded(db_engine, 1)
    with cutting(db_url, b"INSERT INTO enrichq.ticket_orders") as (proxied, cutter):
        engine = create_engine(proxied, pool_size=2)
        try:
            settings = make_settings(proxied, enricher="tests.support.enrichers:tagged")
            result = drain_in_thread(Worker(settings, engine), timeout=60)
        finally:
            engine.dispose()
    assert cutter.cut == 1
    assert result is not None
    assert q(db_engine, "SELECT state FROM enrichq.queue") == [("done",)]
    assert q(db_engine, "SELECT count(*), sum(bytes_billed) FROM enrichq.lookup_log") == [(1, 1000)]
    assert q(db_engine, "SELECT bytes_billed, lookups FROM enrichq.budget_ledger") == [(1000, 1)]
    assert (result.counts["done"], result.counts["lost"]) == (1, 0)


def test_a_claim_whose_reply_was_lost_gives_its_rows_back_with_their_attempt(
    db_url: str, db_engine: sa.Engine
) -> None:
    """The claim's COMMIT reaches the server, its reply never reaches the worker: the rows
    it leased are given back as soon as the worker reaches the database again, with the
    attempt the claim counted, not left leased until the lease expires."""
    seeded(db_engine, 1)
    # the claim is the one statement that counts claims per tenant
    with cutting(db_url, b"INSERT INTO enrichq.tenant_served") as (proxied, cutter):
        engine = create_engine(proxied, pool_size=2)
        try:
            settings = make_settings(proxied, lease_seconds=120)
            result = drain_in_thread(Worker(settings, engine), timeout=60)
        finally:
            engine.dispose()
    assert cutter.cut == 1
    assert result is not None
    # given back (attempts 1 -> 0), claimed again (-> 1), done, all within one drain
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("done", 1)]
    assert result.counts["done"] == 1


def test_a_lookup_that_finishes_after_its_attempt_was_abandoned_is_logged_and_charged(
    db_url: str, db_engine: sa.Engine
) -> None:
    seeded(db_engine, 1)
    settings = make_settings(
        db_url,
        enricher="tests.support.enrichers:past_the_deadline",
        attempt_deadline_seconds=1,
        backoff_base_seconds=60,
        backoff_cap_seconds=60,
    )
    with running(Worker(settings, db_engine)):
        wait_for(
            lambda: q(db_engine, "SELECT count(*) FROM enrichq.lookup_log") == [(1,)],
            timeout=30,
            what="the late lookup to be logged",
        )
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("queued", 1)]
    assert q(db_engine, "SELECT bytes_billed FROM enrichq.budget_ledger") == [(10**9,)]
    assert q(db_engine, "SELECT count(*) FROM enrichq.ticket_orders") == [(0,)]


# -- 5. the daily budget: at most one lookup per worker beyond it


def test_two_workers_overspend_the_daily_budget_by_at_most_one_lookup_each(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Budget 100 bytes, 2 workers, concurrency 4 each, 60 bytes a lookup."""
    seeded(db_engine, 40)
    env = enrichq_env(
        db_url,
        enricher="tests.support.enrichers:sixty_bytes",
        daily_bytes_budget=100,
        concurrency=4,
        ENRICHQ_TEST_SLOW_SECONDS=0.5,
    )
    workers = [spawn(["worker", "--drain"], env, log=tmp_path / f"w{i}.log") for i in range(2)]
    codes = [w.wait(120) for w in workers]
    assert codes == [0, 0], [(tmp_path / f"w{i}.log").read_text() for i in range(2)]
    [(billed, lookups)] = q(db_engine, "SELECT bytes_billed, lookups FROM enrichq.budget_ledger")
    assert billed <= 100 + 2 * 60, f"{billed} bytes charged against a budget of 100"
    assert billed == 60 * lookups
    assert q(db_engine, "SELECT sum(bytes_billed) FROM enrichq.lookup_log") == [(billed,)]
    # the rest was given back until the reset, attempts unchanged
    deferred = q(
        db_engine, "SELECT count(*), max(attempts) FROM enrichq.queue WHERE state = 'queued'"
    )
    assert deferred == [(40 - lookups, 0)]


# -- 6. lookup times come from the database clock, at the lookup's start


def test_looked_up_at_is_the_database_time_the_lookup_started(
    db_url: str, db_engine: sa.Engine
) -> None:
    seeded(db_engine, 1)
    settings = make_settings(db_url, enricher="tests.support.enrichers:two_seconds")
    [(before_the_claim,)] = q(db_engine, "SELECT clock_timestamp()")
    assert drain_in_thread(Worker(settings, db_engine), timeout=30) is not None
    [(finished,)] = q(db_engine, "SELECT finished_at FROM enrichq.queue")
    [(looked_up_at,)] = q(db_engine, "SELECT DISTINCT looked_up_at FROM enrichq.ticket_orders")
    [(enriched_at,)] = q(db_engine, "SELECT enriched_at FROM enrichq.ticket_enrichments")
    assert looked_up_at == enriched_at
    # the lookup took two seconds: its start is well before the settle's commit
    assert (finished - looked_up_at).total_seconds() >= 1.5
    assert looked_up_at >= before_the_claim


# -- 7. a job whose settle commits first is not a lost lease


def test_settled_jobs_are_never_counted_as_lost_leases(db_url: str, db_engine: sa.Engine) -> None:
    seeded(db_engine, 1500)
    settings = make_settings(
        db_url,
        enricher="tests.support.enrichers:noop",
        lease_seconds=2,
        heartbeat_seconds=0.05,
        concurrency=8,
    )
    lost_before = sample("enrichq_heartbeat_lost_leases_total")
    refused_before = sum(
        sample("enrichq_fenced_writes_refused_total", operation=op)
        for op in ("complete", "retry", "fail", "defer")
    )
    result = drain_in_thread(Worker(settings, db_engine), timeout=60)
    assert result is not None
    assert result.counts["done"] == 1500
    refused = (
        sum(
            sample("enrichq_fenced_writes_refused_total", operation=op)
            for op in ("complete", "retry", "fail", "defer")
        )
        - refused_before
    )
    assert refused == 0  # no lease was really lost
    assert sample("enrichq_heartbeat_lost_leases_total") - lost_before == 0


# -- 8. a lookup still running when the worker stops is logged and charged all the same


@pytest.mark.parametrize("stop_by", ["sigterm", "time_budget"])
def test_a_lookup_that_finishes_during_shutdown_is_logged_and_charged(
    db_url: str, db_engine: sa.Engine, tmp_path: Path, stop_by: str
) -> None:
    """The plug-in ignores cancellation and returns 3 s after the stop, long past the grace
    period: its lookup is logged and charged once, and its warehouse slot released."""
    [key] = seeded(db_engine, 1)
    started = tmp_path / "started"
    started.mkdir()
    log = tmp_path / "w.log"
    args = ["worker", "--time-budget", "1"] if stop_by == "time_budget" else ["worker"]
    worker = spawn(
        args,
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:ignores_cancellation",
            ENRICHQ_TEST_SLOW_SECONDS=4,
            ENRICHQ_TEST_STARTED_DIR=started,
            warehouse_max_concurrency=1,
            shutdown_grace_seconds=0.5,
        ),
        log=log,
    )
    try:
        wait_for((started / key).exists, what="the lookup to start")
        if stop_by == "sigterm":
            worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, log.read_text()
    finally:
        stop(worker)
    assert q(db_engine, "SELECT job_id, bytes_billed, status FROM enrichq.lookup_log") == [
        (f"late-{key}", 500, "ok")
    ]
    assert q(db_engine, "SELECT bytes_billed, lookups FROM enrichq.budget_ledger") == [(500, 1)]
    assert q(db_engine, "SELECT count(*) FROM enrichq.lookups_in_flight") == [(0,)]
    # the attempt itself was given up at the end of the grace: retried, its result unwritten
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("queued", 1)]
    assert q(db_engine, "SELECT count(*) FROM enrichq.ticket_orders") == [(0,)]


def test_a_lookup_that_outlives_the_stop_is_recorded_as_ran_at_an_unknown_cost(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """The plug-in hangs, deaf to cancellation, for ten minutes: the worker does not wait
    for it. Its lookup is recorded as run, its cost unknown, and its slot is released."""
    [key] = seeded(db_engine, 1)
    started = tmp_path / "started"
    started.mkdir()
    log = tmp_path / "w.log"
    worker = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:ignores_cancellation",
            ENRICHQ_TEST_SLOW_SECONDS=600,
            ENRICHQ_TEST_STARTED_DIR=started,
            warehouse_max_concurrency=1,
            shutdown_grace_seconds=0.5,
        ),
        log=log,
    )
    try:
        wait_for((started / key).exists, what="the lookup to start")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, log.read_text()
    finally:
        stop(worker)
    [(status, error)] = q(db_engine, "SELECT status, error FROM enrichq.lookup_log")
    assert status == "error"
    assert "its cost is unknown" in error
    assert q(db_engine, "SELECT lookups FROM enrichq.budget_ledger") == [(1,)]
    assert q(db_engine, "SELECT count(*) FROM enrichq.lookups_in_flight") == [(0,)]
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("queued", 1)]
