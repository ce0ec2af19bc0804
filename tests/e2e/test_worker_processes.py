"""Worker processes under kill -9, SIGSTOP, SIGTERM and a database restart."""

from __future__ import annotations

import math
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.db import execute, q
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.world import seeded

from enrichq_schema.db import create_engine, ensure_database, migrate
from enrichq_schema.states import LEASE_EXPIRED_ERROR
from enrichq_sweeper import recovery

pytestmark = pytest.mark.slow

FAST_LEASE = {"lease_seconds": 2, "heartbeat_seconds": 0.5, "poll_seconds": 0.2}


@pytest.fixture
def markers() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="enrichq-started-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def expired(engine: sa.Engine) -> bool:
    return bool(
        q(engine, "SELECT 1 FROM enrichq.queue WHERE state = 'leased' AND lease_expires_at < now()")
    )


def test_kill_9_mid_enrichment_then_recovery_enriches_exactly_once(
    db_url: str, db_engine: sa.Engine, markers: Path, tmp_path: Path
) -> None:
    [key] = seeded(db_engine, 1)
    env = enrichq_env(
        db_url,
        enricher="tests.support.enrichers:slow",
        ENRICHQ_TEST_SLOW_SECONDS=60,
        ENRICHQ_TEST_STARTED_DIR=markers,
        ENRICHQ_TEST_TAG="A",
        **FAST_LEASE,
    )
    victim = spawn(["worker"], env, log=tmp_path / "a.log")
    wait_for((markers / key).exists, what="the handler to start")
    victim.kill()
    victim.wait(10)
    wait_for(lambda: expired(db_engine), what="the lease to expire")
    assert recovery.run_once(db_engine).promoted == 1

    rescuer = spawn(
        ["worker", "--drain"],
        enrichq_env(db_url, enricher="tests.support.enrichers:tagged", ENRICHQ_TEST_TAG="B"),
        log=tmp_path / "b.log",
    )
    assert rescuer.wait(60) == 0
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("done", 2)]
    assert q(db_engine, "SELECT order_id FROM enrichq.ticket_orders") == [(f"O-{key}-B",)]
    # the killed worker never settled: one lookup was logged, by the rescuer
    assert q(db_engine, "SELECT job_id FROM enrichq.lookup_log") == [("job-B",)]


def test_frozen_worker_past_its_lease_is_fenced_out(
    db_url: str, db_engine: sa.Engine, markers: Path, tmp_path: Path
) -> None:
    [key] = seeded(db_engine, 1)
    frozen = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:slow",
            ENRICHQ_TEST_SLOW_SECONDS=1,
            ENRICHQ_TEST_STARTED_DIR=markers,
            ENRICHQ_TEST_TAG="A",
            **FAST_LEASE,
        ),
        log=tmp_path / "a.log",
    )
    try:
        wait_for((markers / key).exists, what="the handler to start")
        os.kill(frozen.pid, signal.SIGSTOP)
        wait_for(lambda: expired(db_engine), what="the frozen worker's lease to expire")
        assert recovery.run_once(db_engine).promoted == 1
        other = spawn(
            ["worker", "--drain"],
            enrichq_env(db_url, enricher="tests.support.enrichers:tagged", ENRICHQ_TEST_TAG="B"),
            log=tmp_path / "b.log",
        )
        assert other.wait(60) == 0
        assert q(db_engine, "SELECT order_id FROM enrichq.ticket_orders") == [(f"O-{key}-B",)]
        os.kill(frozen.pid, signal.SIGCONT)
        # the frozen worker wakes up, finishes its lookup and tries to settle: refused
        wait_for(
            lambda: q(db_engine, "SELECT 1 FROM enrichq.lookup_log WHERE job_id = 'job-A'"),
            what="the frozen worker's late lookup",
        )
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
        assert stop(frozen) == 0
    assert q(db_engine, "SELECT order_id FROM enrichq.ticket_orders") == [(f"O-{key}-B",)]
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("done", 2)]
    assert q(db_engine, "SELECT queue_id FROM enrichq.ticket_enrichments") == q(
        db_engine, "SELECT id FROM enrichq.queue"
    )


def test_sigterm_finishes_in_flight_work_and_exits_0(
    db_url: str, db_engine: sa.Engine, markers: Path, tmp_path: Path
) -> None:
    seeded(db_engine, 5)
    worker = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:slow",
            ENRICHQ_TEST_SLOW_SECONDS=1.5,
            ENRICHQ_TEST_STARTED_DIR=markers,
            concurrency=2,
            **FAST_LEASE,
        ),
        log=tmp_path / "w.log",
    )
    wait_for(lambda: len(list(markers.iterdir())) == 2, what="two handlers to start")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    states = dict(q(db_engine, "SELECT state, count(*) FROM enrichq.queue GROUP BY 1"))
    assert states == {"done": 2, "queued": 3}
    assert q(db_engine, "SELECT DISTINCT attempts FROM enrichq.queue WHERE state = 'queued'") == [
        (0,)
    ]
    assert q(db_engine, "SELECT stop_reason, counts->>'done' FROM enrichq.runs") == [
        ("shutdown", "2")
    ]


def test_time_budget_stops_claiming(db_url: str, db_engine: sa.Engine, tmp_path: Path) -> None:
    seeded(db_engine, 30)
    worker = spawn(
        ["worker", "--time-budget", "1"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:slow",
            ENRICHQ_TEST_SLOW_SECONDS=0.4,
            concurrency=1,
        ),
        log=tmp_path / "w.log",
    )
    assert worker.wait(60) == 0
    [(reason, done)] = q(db_engine, "SELECT stop_reason, (counts->>'done')::int FROM enrichq.runs")
    assert reason == "time_budget"
    assert 1 <= done < 30
    assert q(db_engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'leased'") == [(0,)]


@pytest.fixture
def own_server() -> Iterator[tuple[Any, str]]:
    """An embedded PostgreSQL this test may restart without disturbing any other test."""
    from enrichq_schema.postgres_supervisor import EmbeddedPostgres

    base = Path(tempfile.mkdtemp(prefix="enrichq-restart-", dir="/tmp"))
    base.chmod(0o711)
    server = EmbeddedPostgres(base, port=5433)
    admin = server.start()
    try:
        url = ensure_database(admin, "enrichq")
        migrate(url)
        yield server, url
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_database_restart_while_two_workers_drain(
    own_server: tuple[Any, str], tmp_path: Path
) -> None:
    server, url = own_server
    engine = create_engine(url)
    try:
        seeded(engine, 2000)
        env = enrichq_env(url, lease_seconds=10, heartbeat_seconds=2, poll_seconds=0.5)
        workers = [spawn(["worker"], env, log=tmp_path / f"w{i}.log") for i in range(2)]
        # both running (their runs logged) before the restart: under load one of them may
        # still be starting when the other has done 300, and would log no run at all
        runs = "SELECT count(*) FROM enrichq.runs WHERE component = 'worker'"
        wait_for(lambda: q(engine, runs)[0][0] == 2, timeout=120, what="both workers running")
        done = "SELECT count(*) FROM enrichq.queue WHERE state = 'done'"
        wait_for(lambda: q(engine, done)[0][0] >= 300, timeout=120, what="300 done")
        server.stop()
        server.start()

        # leases that expired during the outage are the sweeper's to recover
        def all_done() -> bool:
            recovery.run_once(engine)
            return bool(q(engine, done)[0][0] == 2000)

        wait_for(all_done, timeout=180, interval=0.5, what="all 2,000 tickets done")
        for w in workers:
            assert stop(w) == 0
        assert q(engine, "SELECT count(*) FROM enrichq.ticket_enrichments") == [(2000,)]
        expected = q(
            engine,
            "SELECT count(*) FROM helpdesk.tickets t "
            "JOIN warehouse.customers c ON lower(c.email) = lower(t.requester_email) "
            "JOIN warehouse.orders o ON o.customer_id = c.customer_id",
        )
        assert q(engine, "SELECT count(*) FROM enrichq.ticket_orders") == expected
        assert q(engine, "SELECT count(*) FROM enrichq.runs WHERE stop_reason = 'shutdown'") == [
            (2,)
        ]
    finally:
        engine.dispose()


def test_a_suspect_that_crashes_its_process_costs_only_its_own_attempt(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    keys = seeded(db_engine, 5)
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO helpdesk.tickets (id, requester_email) VALUES ('POISON', 'x@y.z');"
                "INSERT INTO enrichq.queue (kind, key, reason, attempts, max_attempts, last_error)"
                " VALUES ('enrich', 'POISON', 'manual', 1, 3, 'lease expired')"
            )
        )
    worker = spawn(
        ["worker", "--drain"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:crash_on_poison",
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
        ),
        log=tmp_path / "w.log",
    )
    # the poison's enrichment runs in a child process each time: the worker survives it
    assert worker.wait(120) == 0
    assert q(
        db_engine, "SELECT state, dead_reason, attempts FROM enrichq.queue WHERE key = 'POISON'"
    ) == [("dead_letter", "attempts_exhausted", 3)]
    assert (
        "isolated enrichment process died"
        in q(db_engine, "SELECT last_error FROM enrichq.queue WHERE key = 'POISON'")[0][0]
    )
    assert q(
        db_engine,
        "SELECT count(*) FROM enrichq.queue WHERE state = 'done' AND attempts = 1 AND key = ANY(:k)",
        k=keys,
    ) == [(5,)]


def suspects_drained(
    db_url: str, engine: sa.Engine, markers: Path, logs: Path, *, tickets: int, poison: bool
) -> list[str]:
    """Seed and enqueue `tickets` as suspects (their first attempt's lease expired, as after
    a database outage or a crash), and ticket POISON as one too if asked; then one worker
    drains the queue with a batch enricher that records its process per ticket. Every row
    is visible at start, so one claim takes them all, in one unit. The keys, POISON aside."""
    keys = seeded(engine, tickets)
    suspect = {"e": LEASE_EXPIRED_ERROR}
    execute(
        engine,
        "UPDATE enrichq.queue SET attempts = 1, max_attempts = 3, last_error = :e",
        **suspect,
    )
    if poison:
        execute(
            engine, "INSERT INTO helpdesk.tickets (id, requester_email) VALUES ('POISON', 'x@y.z')"
        )
        execute(
            engine,
            "INSERT INTO enrichq.queue (kind, key, reason, attempts, max_attempts, last_error)"
            " VALUES ('enrich', 'POISON', 'manual', 1, 3, :e)",
            **suspect,
        )
    worker = spawn(
        ["worker", "--drain"],
        enrichq_env(
            db_url,
            batch_enricher="tests.support.enrichers:marks_its_process",
            ENRICHQ_TEST_STARTED_DIR=markers,
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
        ),
        log=logs / "w.log",
    )
    assert worker.wait(120) == 0
    return keys


def processes(markers: Path, keys: list[str]) -> set[str]:
    """The processes that enriched any of `keys`."""
    return {pid for k in keys for pid in (markers / k).read_text().split()}


def test_a_unit_of_suspects_is_enriched_in_one_child_process(
    db_url: str, db_engine: sa.Engine, markers: Path, tmp_path: Path
) -> None:
    # after a database outage longer than a lease, every job that was in flight comes back
    # a suspect: enriching each in a process of its own stalled the queue
    keys = suspects_drained(db_url, db_engine, markers, tmp_path, tickets=30, poison=False)

    assert q(db_engine, "SELECT state, attempts, count(*) FROM enrichq.queue GROUP BY 1, 2") == [
        ("done", 2, 30)
    ]
    assert len(processes(markers, keys)) == 1


def test_a_poison_among_suspects_is_found_by_halving_and_fails_alone(
    db_url: str, db_engine: sa.Engine, markers: Path, tmp_path: Path
) -> None:
    keys = suspects_drained(db_url, db_engine, markers, tmp_path, tickets=24, poison=True)

    assert q(
        db_engine,
        "SELECT count(*) FROM enrichq.queue WHERE state = 'done' AND attempts = 2"
        " AND key = ANY(:k)",
        k=keys,
    ) == [(24,)]
    [(state, reason, attempts, error)] = q(
        db_engine,
        "SELECT state, dead_reason, attempts, last_error FROM enrichq.queue WHERE key = 'POISON'",
    )
    assert (state, reason, attempts) == ("dead_letter", "attempts_exhausted", 3)
    assert "isolated enrichment process died" in error
    # a child that dies has its tickets split in two halves, each in a child of its own:
    # the 25 suspects take 1 + 2 * ceil(log2(25)) = 11 children, not one each; all but the
    # last (POISON alone) enriched some of the 24 others
    assert len(processes(markers, keys)) <= 2 * math.ceil(math.log2(25))
