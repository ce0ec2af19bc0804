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
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY
from tests.support.commit_cutter import cutting
from tests.support.db import execute, q
from tests.support.enrichers import BAD_FIELDS, BAD_KINDS, SURROGATE
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.settings import make_settings
from tests.support.world import seeded

from enrichq_schema.db import create_engine
from enrichq_service import queue
from enrichq_service.worker import RunResult, Worker
from enrichq_service.worker.admission import Admission
from enrichq_service.worker.heartbeat import Heartbeat
from enrichq_service.worker.lifecycle import Held, Jobs, Phase

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
    "surrogate_error": ("dead_letter", "warehouse said \\udcff and hung up"),
    "unreadable_error": ("dead_letter", "Unreadable: (its message could not be read)"),
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
    assert SURROGATE not in error
    others = q(
        db_engine, "SELECT state, count(*) FROM enrichq.queue WHERE key <> :k GROUP BY 1", k=bad
    )
    assert others == [("done", len(keys) - 1)]
    # nothing of the bad result was written
    assert q(
        db_engine, "SELECT count(*) FROM enrichq.ticket_orders WHERE ticket_id = :k", k=bad
    ) == [(0,)]


# what the bad ticket's own lookup is charged: a result refused for a bad order or job id
# still cost what it billed; a plug-in error or a bill no warehouse sends costs nothing
CHARGED = {"surrogate_order_id": 10, "surrogate_job_id": 10, "surrogate_error": 0, "huge_bytes": 0}


@pytest.mark.parametrize("kind", sorted(CHARGED))
def test_a_bad_outcome_in_a_batch_fails_that_job_and_worker_drain_exits_0(
    db_url: str, db_engine: sa.Engine, tmp_path: Path, kind: str
) -> None:
    """A batch of 20 tickets whose outcomes reach the settler together, one of them holding
    a lone surrogate (what `surrogateescape` decoding makes) or a bill of 2^63-1 bytes:
    `enrichq worker --drain` settles the good ones, fails the bad one alone, charges every
    lookup once, and exits 0."""
    keys = seeded(db_engine, 20)
    bad = keys[7]
    with db_engine.begin() as conn:
        conn.execute(sa.text("UPDATE enrichq.queue SET max_attempts = 1"))
    env = enrichq_env(
        db_url,
        batch_enricher="tests.support.enrichers:bad_in_batch",
        ENRICHQ_TEST_BAD_TICKET=bad,
        ENRICHQ_TEST_BAD_KIND=kind,
    )
    log = tmp_path / "worker.log"
    worker = spawn(["worker", "--drain"], env, log=log)
    try:
        code = worker.wait(120)
    finally:
        stop(worker)
    assert code == 0, log.read_text(errors="replace")
    state, error = q(
        db_engine, "SELECT state, last_error FROM enrichq.queue WHERE key = :k", k=bad
    )[0]
    want_state, names = EXPECTED_FAILURE[kind]
    assert (state, names in error, SURROGATE in error) == (want_state, True, False), error
    others = q(
        db_engine, "SELECT state, count(*) FROM enrichq.queue WHERE key <> :k GROUP BY 1", k=bad
    )
    assert others == [("done", len(keys) - 1)]
    logged = q(db_engine, "SELECT count(*), sum(bytes_billed) FROM enrichq.lookup_log")
    assert logged == [(len(keys), 1000 * (len(keys) - 1) + CHARGED[kind])]
    assert q(db_engine, "SELECT lookups, bytes_billed FROM enrichq.budget_ledger") == logged


def test_a_ledger_at_its_bigint_limit_still_lets_every_settle_of_the_day_through(
    db_url: str, db_engine: sa.Engine
) -> None:
    """Today's ledger a few bytes short of bigint's largest value (what a bill of 2^63-1
    left before bills were bounded): the day's later settles go through, and the ledger
    stays at the largest value, every budget spent."""
    keys = seeded(db_engine, 5)
    top = 2**63 - 1
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.budget_ledger (day, bytes_billed, lookups)"
                " VALUES (CAST(timezone('UTC', now()) AS date), :b, 1)"
            ),
            {"b": top - 10},
        )
    settings = make_settings(db_url, enricher="tests.support.enrichers:tagged")
    result = drain_in_thread(Worker(settings, db_engine), timeout=60)
    assert result is not None
    assert result.stop_reason == "no_work"
    assert q(db_engine, "SELECT state, count(*) FROM enrichq.queue GROUP BY 1") == [
        ("done", len(keys))
    ]
    assert q(db_engine, "SELECT bytes_billed, lookups FROM enrichq.budget_ledger") == [
        (top, 1 + len(keys))
    ]


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


def test_two_workers_overspend_by_at_most_one_batch_query_each(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Batch lookups: budget 50,000 bytes, 2 workers of concurrency 4, batches of 10 tickets,
    10,000 bytes a query (1,000 a ticket). The admission must reserve what a query costs,
    not what a lookup-log row (a ticket) does, or it lets 10 times too many queries run:
    the bound is 50,000 + 2 x 10,000."""
    seeded(db_engine, 400)
    env = enrichq_env(
        db_url,
        batch_enricher="tests.support.enrichers:priced_batch",
        lookup_batch_size=10,
        daily_bytes_budget=50_000,
        concurrency=4,
        ENRICHQ_TEST_SLOW_SECONDS=0.5,
        ENRICHQ_TEST_QUERY_BYTES=10_000,
    )
    workers = [spawn(["worker", "--drain"], env, log=tmp_path / f"w{i}.log") for i in range(2)]
    codes = [w.wait(120) for w in workers]
    assert codes == [0, 0], [(tmp_path / f"w{i}.log").read_text() for i in range(2)]
    [(billed,)] = q(db_engine, "SELECT bytes_billed FROM enrichq.budget_ledger")
    assert billed <= 50_000 + 2 * 10_000, f"{billed} bytes charged against a budget of 50,000"
    assert q(db_engine, "SELECT sum(bytes_billed) FROM enrichq.lookup_log") == [(billed,)]
    assert q(db_engine, "SELECT count(*) FROM enrichq.lookups_in_flight") == [(0,)]


def test_two_workers_overspend_by_at_most_one_lookup_each_when_costs_rise(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Yesterday a lookup cost 20,000 bytes on average; today each costs 40,000. Budget
    100,000, 2 workers of concurrency 4: reserving yesterday's average lets 8 lookups
    run at once at twice what they reserved; the bound is 100,000 + 2 x 40,000."""
    seeded(db_engine, 40)
    execute(
        db_engine,
        "INSERT INTO enrichq.budget_ledger (day, bytes_billed, lookups)"
        " VALUES (CAST(timezone('UTC', now()) AS date) - 1, 200000, 10)",
    )
    env = enrichq_env(
        db_url,
        enricher="tests.support.enrichers:priced",
        daily_bytes_budget=100_000,
        concurrency=4,
        ENRICHQ_TEST_SLOW_SECONDS=0.5,
        ENRICHQ_TEST_QUERY_BYTES=40_000,
    )
    workers = [spawn(["worker", "--drain"], env, log=tmp_path / f"w{i}.log") for i in range(2)]
    codes = [w.wait(120) for w in workers]
    assert codes == [0, 0], [(tmp_path / f"w{i}.log").read_text() for i in range(2)]
    [(billed,)] = q(
        db_engine,
        "SELECT bytes_billed FROM enrichq.budget_ledger"
        " WHERE day = CAST(timezone('UTC', now()) AS date)",
    )
    assert billed <= 100_000 + 2 * 40_000, f"{billed} bytes charged against a budget of 100,000"


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


# -- 8. a row claimed again is another job: an old claim's report never touches it


def _claim_one(engine: sa.Engine, owner: str) -> Held:
    with engine.begin() as conn:
        [job] = queue.claim(conn, owner=owner, limit=1, lease_seconds=30)
    return Held(job, None, float("inf"))


def _lease_of(engine: sa.Engine) -> tuple[uuid.UUID, datetime]:
    [(token, expires)] = q(engine, "SELECT claim_token, lease_expires_at FROM enrichq.queue")
    return token, expires


def test_a_stale_heartbeat_does_not_lose_the_rows_newer_claim(
    db_url: str, db_engine: sa.Engine
) -> None:
    """The heartbeat takes its snapshot of the held jobs; before its statement runs, the
    old claim is deferred to now, settled, and the row claimed again by this worker. The
    statement misses the old claim: that claim is gone, the new one is not lost (it was,
    matched by id: its handler stopped, no heartbeat, its result refused)."""
    seeded(db_engine, 1)
    owner = "w:1:reclaim"
    lost: list[Held] = []
    jobs = Jobs(on_lost=lost.append)
    settings = make_settings(db_url)
    heartbeat = Heartbeat(db_engine, settings, owner, jobs, Admission(db_engine, settings, owner))
    old = _claim_one(db_engine, owner)
    jobs.add([old])
    newer: list[Held] = []
    fired = threading.Event()

    def reclaim_before_the_heartbeat(
        conn: sa.Connection, cursor: object, statement: str, *args: object
    ) -> None:
        if "FROM held, clock" not in statement or fired.is_set():  # the heartbeat's statement
            return
        fired.set()
        assert jobs.hand_off(old, finished=False)
        with db_engine.begin() as other:
            assert queue.defer(other, owner=owner, deferrals=[(old.job, None)]) == {old.id}
        jobs.settled([old])
        newer.append(_claim_one(db_engine, owner))
        jobs.add(newer)

    sa.event.listen(db_engine, "before_cursor_execute", reclaim_before_the_heartbeat)
    try:
        heartbeat.beat()
    finally:
        sa.event.remove(db_engine, "before_cursor_execute", reclaim_before_the_heartbeat)
    [new] = newer
    assert new.id == old.id
    assert new.job.claim_token != old.job.claim_token
    assert lost == []
    assert new.phase is Phase.CLAIMED
    assert jobs.heartbeat_jobs() == [new]
    _, before = _lease_of(db_engine)
    heartbeat.beat()
    token, after = _lease_of(db_engine)
    assert token == new.job.claim_token
    assert after > before  # the new claim's lease is extended


def test_the_old_claims_settle_does_not_drop_the_rows_newer_claim(
    db_url: str, db_engine: sa.Engine
) -> None:
    """The old claim's defer commits; the row is claimed again before the settler reports
    the old claim settled. That report lets the old claim go, not the new one (it popped
    the new one by id: no heartbeat, its lease lapsed, its result was refused)."""
    seeded(db_engine, 1)
    owner = "w:1:reclaim"
    jobs = Jobs()
    settings = make_settings(db_url)
    heartbeat = Heartbeat(db_engine, settings, owner, jobs, Admission(db_engine, settings, owner))
    old = _claim_one(db_engine, owner)
    jobs.add([old])
    assert jobs.hand_off(old, finished=False)
    with db_engine.begin() as conn:
        queue.defer(conn, owner=owner, deferrals=[(old.job, None)])
    new = _claim_one(db_engine, owner)
    jobs.add([new])
    jobs.settled([old])  # the settler's report, after the new claim
    assert jobs.unsettled() == [new]
    _, before = _lease_of(db_engine)
    heartbeat.beat()
    token, after = _lease_of(db_engine)
    assert token == new.job.claim_token
    assert after > before


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
