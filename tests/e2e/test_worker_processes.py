"""Worker processes under kill -9, SIGSTOP, SIGTERM and a database restart."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.db import execute, q
from tests.support.enrichers import BASE_EXCEPTIONS, STDOUT_NOISE
from tests.support.procs import REPO, enrichq_env, spawn, stop, wait_for
from tests.support.world import seeded

from enrichq_schema.db import create_engine, ensure_database, migrate
from enrichq_schema.states import LEASE_EXPIRED_ERROR
from enrichq_service.cli import main
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
    from enrichq_service.embedded_postgres import EmbeddedPostgres

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


# -- plug-ins that misbehave towards their process, and stops signalled to the group


def make_suspects(engine: sa.Engine, *, max_attempts: int = 3) -> None:
    """Every queued row a suspect: its first attempt's lease expired."""
    execute(
        engine,
        "UPDATE enrichq.queue SET attempts = 1, max_attempts = :m, last_error = :e",
        m=max_attempts,
        e=LEASE_EXPIRED_ERROR,
    )


@pytest.mark.parametrize("kind", BASE_EXCEPTIONS)
def test_a_plug_in_raising_a_base_exception_costs_only_its_own_ticket(
    db_url: str, db_engine: sa.Engine, tmp_path: Path, kind: str
) -> None:
    # a library's asyncio.CancelledError, KeyboardInterrupt or SystemExit is the error of
    # the ticket whose call raised it: the worker neither stops nor retries its neighbours
    keys = seeded(db_engine, 6, extra=("B-1",))
    execute(db_engine, "UPDATE enrichq.queue SET max_attempts = 3")
    worker = spawn(
        ["worker", "--drain"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:raises_base_exception",
            ENRICHQ_TEST_BASE_KIND=kind,
            concurrency=4,
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
        ),
        log=tmp_path / "w.log",
    )
    assert worker.wait(120) == 0, (tmp_path / "w.log").read_text()
    good = [k for k in keys if k != "B-1"]
    assert q(
        db_engine,
        "SELECT state, attempts, count(*) FROM enrichq.queue WHERE key = ANY(:k) GROUP BY 1, 2",
        k=good,
    ) == [("done", 1, len(good))]
    [(state, reason, attempts, error)] = q(
        db_engine,
        "SELECT state, dead_reason, attempts, last_error FROM enrichq.queue WHERE key = 'B-1'",
    )
    assert (state, reason, attempts) == ("dead_letter", "attempts_exhausted", 3)
    name = {"cancelled": "CancelledError", "keyboard_interrupt": "KeyboardInterrupt"}
    assert name.get(kind, "SystemExit") in error
    assert q(db_engine, "SELECT stop_reason FROM enrichq.runs") == [("no_work",)]


def test_a_batch_plug_in_raising_a_base_exception_costs_only_its_own_ticket(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    # the batch call that raises it is enriched again in child processes, halved until
    # the ticket that causes it is alone: the tickets beside it are done in this attempt
    keys = seeded(db_engine, 6, extra=("B-1",))
    execute(db_engine, "UPDATE enrichq.queue SET max_attempts = 2")
    worker = spawn(
        ["worker", "--drain"],
        enrichq_env(
            db_url,
            batch_enricher="tests.support.enrichers:raises_base_exception_batch",
            ENRICHQ_TEST_BASE_KIND="keyboard_interrupt",
            lookup_batch_size=10,
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
        ),
        log=tmp_path / "w.log",
    )
    assert worker.wait(120) == 0, (tmp_path / "w.log").read_text()
    good = [k for k in keys if k != "B-1"]
    assert q(
        db_engine,
        "SELECT state, attempts, count(*) FROM enrichq.queue WHERE key = ANY(:k) GROUP BY 1, 2",
        k=good,
    ) == [("done", 1, len(good))]
    [(state, attempts, error)] = q(
        db_engine, "SELECT state, attempts, last_error FROM enrichq.queue WHERE key = 'B-1'"
    )
    assert (state, attempts) == ("dead_letter", 2)
    assert "KeyboardInterrupt" in error


def test_a_suspect_whose_plug_in_prints_to_stdout_is_enriched_and_charged(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    # the isolated child's answer travels on a channel of its own: a plug-in's prints go to
    # the worker's log, and the suspects get their results and their charge
    seeded(db_engine, 3)
    make_suspects(db_engine)
    log = tmp_path / "w.log"
    worker = spawn(
        ["worker", "--drain"],
        enrichq_env(db_url, enricher="tests.support.enrichers:prints_to_stdout"),
        log=log,
    )
    assert worker.wait(120) == 0, log.read_text()
    assert q(db_engine, "SELECT state, attempts, count(*) FROM enrichq.queue GROUP BY 1, 2") == [
        ("done", 2, 3)
    ]
    assert q(db_engine, "SELECT count(*), sum(bytes_billed) FROM enrichq.lookup_log") == [(3, 3000)]
    assert q(db_engine, "SELECT bytes_billed FROM enrichq.budget_ledger") == [(3000,)]
    assert STDOUT_NOISE in log.read_text()


def spawn_group_leader(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`enrichq ARGS` in a process group of its own (as under systemd or in a terminal),
    so that a signal to the group reaches it and its children, not the test."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "enrichq_service", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_graceful_stop_signalled_to_the_process_group_lets_isolated_children_finish(
    db_url: str, db_engine: sa.Engine, markers: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    # systemd's KillMode=control-group, Ctrl-C in a terminal, `docker stop` of a shell
    # entrypoint: the isolated child gets the signal too, and must finish within the grace
    [key] = seeded(db_engine, 1)
    make_suspects(db_engine)
    log = tmp_path / "w.log"
    worker = spawn_group_leader(
        ["worker"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:slow",
            ENRICHQ_TEST_SLOW_SECONDS=2,
            ENRICHQ_TEST_STARTED_DIR=markers,
            shutdown_grace_seconds=30,
        ),
        log,
    )
    try:
        started = markers / key
        pid = wait_for(
            lambda: started.read_text() if started.exists() else None,
            what="the isolated child to start",
        )
        child = int(pid)
        assert child != worker.pid
        os.killpg(worker.pid, signum)
        assert worker.wait(60) == 0, log.read_text()
    finally:
        stop(worker)
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("done", 2)]
    assert q(db_engine, "SELECT stop_reason FROM enrichq.runs") == [("shutdown",)]


def test_a_killed_isolated_childs_query_ends_before_its_warehouse_slot_is_released(
    db_url: str, db_engine: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cap 1: the operator cancels a suspect whose isolated child is in a long warehouse
    # query; the child is killed, and its query must not run on once its slot is free
    [key] = seeded(db_engine, 1)
    make_suspects(db_engine)
    log = tmp_path / "w.log"
    worker = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:slow_query",
            ENRICHQ_TEST_SLOW_SECONDS=600,
            warehouse_max_concurrency=1,
            lease_seconds=4,
            heartbeat_seconds=0.5,
            poll_seconds=0.2,
        ),
        log=log,
    )
    in_flight = "SELECT count(*) FROM enrichq.lookups_in_flight"
    try:
        wait_for(lambda: isolated_sleepers(db_engine), timeout=60, what="the child's query")
        assert q(db_engine, in_flight) == [(1,)]
        monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
        assert main(["cancel", "--key", key, "--actor", "ops"]) == 0
        wait_for(lambda: q(db_engine, in_flight) == [(0,)], what="the slot to be released")
        assert isolated_sleepers(db_engine) == 0
    finally:
        assert stop(worker) == 0, log.read_text()
    assert q(db_engine, "SELECT state, dead_reason FROM enrichq.queue") == [
        ("dead_letter", "cancelled")
    ]


def isolated_sleepers(engine: sa.Engine) -> int:
    """Queries of isolated children running on the server now."""
    [(n,)] = q(
        engine,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'enrichq-isolated%' AND state = 'active'"
        " AND query LIKE '%pg_sleep%'",
    )
    return int(n)


def _poison_suspect(engine: sa.Engine) -> list[str]:
    """Five good tickets, and POISON as a suspect (its first attempt's lease expired), with
    4 attempts: its last runs isolated only if its process vanished the time before."""
    keys = seeded(engine, 5)
    execute(engine, "INSERT INTO helpdesk.tickets (id, requester_email) VALUES ('POISON', 'x@y.z')")
    execute(
        engine,
        "INSERT INTO enrichq.queue (kind, key, reason, attempts, max_attempts, last_error)"
        " VALUES ('enrich', 'POISON', 'manual', 1, 4, :e)",
        e=LEASE_EXPIRED_ERROR,
    )
    return keys


def _poison_isolated_to_the_end(engine: sa.Engine, markers: Path, keys: list[str]) -> None:
    """POISON hung in its child once and exited its (child) process twice, then was
    dead-lettered; the good tickets were done at their first attempt."""
    state, reason, attempts, last_error = q(
        engine,
        "SELECT state, dead_reason, attempts, last_error FROM enrichq.queue WHERE key = 'POISON'",
    )[0]
    assert (state, reason, attempts) == ("dead_letter", "attempts_exhausted", 4)
    assert "isolated enrichment process died" in last_error
    assert sorted(p.name for p in markers.iterdir()) == ["POISON.0", "POISON.1", "POISON.2"]
    assert q(
        engine,
        "SELECT count(*) FROM enrichq.queue WHERE state = 'done' AND attempts = 1 AND key = ANY(:k)",
        k=keys,
    ) == [(5,)]


def test_a_suspect_stopped_by_its_deadline_in_a_child_stays_a_suspect(
    db_url: str, db_engine: sa.Engine, markers: Path, tmp_path: Path
) -> None:
    """A suspect whose isolated attempt hangs past the attempt's deadline is retried as a
    suspect again: the worker's own deadline (which lands before the child's, or beside it)
    stopped it before its innocence was shown. Run in the worker's process instead, its
    next attempt, which exits its process, took the worker and every job beside it."""
    keys = _poison_suspect(db_engine)
    worker = spawn(
        ["worker", "--drain"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:hangs_then_exits",
            ENRICHQ_TEST_STARTED_DIR=markers,
            attempt_deadline_seconds=2,
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
        ),
        log=tmp_path / "w.log",
    )
    assert worker.wait(120) == 0, (tmp_path / "w.log").read_text()[-2000:]
    _poison_isolated_to_the_end(db_engine, markers, keys)


def test_a_suspect_stopped_in_a_child_by_a_shutdown_stays_a_suspect(
    db_url: str, db_engine: sa.Engine, markers: Path, tmp_path: Path
) -> None:
    """The same when the worker stops (SIGTERM, a short grace) while the suspect hangs in
    its child: the next worker runs it in a child again, and survives its exit."""
    keys = _poison_suspect(db_engine)
    env = enrichq_env(
        db_url,
        enricher="tests.support.enrichers:hangs_then_exits",
        ENRICHQ_TEST_STARTED_DIR=markers,
        shutdown_grace_seconds=1,
        backoff_base_seconds=0,
        backoff_cap_seconds=0,
    )
    first = spawn(["worker"], env, log=tmp_path / "w1.log")
    wait_for((markers / "POISON.0").exists, what="POISON's first start")
    assert stop(first) == 0
    assert (
        "shut down mid-attempt while isolated"
        in q(db_engine, "SELECT last_error FROM enrichq.queue WHERE key = 'POISON'")[0][0]
    )
    second = spawn(["worker", "--drain"], env, log=tmp_path / "w2.log")
    assert second.wait(120) == 0, (tmp_path / "w2.log").read_text()[-2000:]
    _poison_isolated_to_the_end(db_engine, markers, keys)


def test_an_isolated_child_ends_once_it_has_answered(
    db_url: str, db_engine: sa.Engine, markers: Path, tmp_path: Path
) -> None:
    """A suspect's plug-in answers at once (a lookup billing 777 bytes) and leaves a thread
    running for two minutes. Its child ends as soon as it has answered: the result lands
    at this attempt, charged once. Before, the child waited for that thread (Python's exit
    does) past the attempt's deadline, where it was killed and its answer dropped: each
    attempt logged as an error of 0 bytes, and the ticket dead-lettered."""
    [key] = seeded(db_engine, 1)
    execute(
        db_engine,
        "UPDATE enrichq.queue SET attempts = 1, max_attempts = 3, last_error = :e",
        e=LEASE_EXPIRED_ERROR,
    )
    worker = spawn(
        ["worker", "--drain"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:answers_then_lingers",
            ENRICHQ_TEST_STARTED_DIR=markers,
            ENRICHQ_TEST_SLOW_SECONDS=120,
            attempt_deadline_seconds=2,
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
        ),
        log=tmp_path / "w.log",
    )
    assert worker.wait(60) == 0, (tmp_path / "w.log").read_text()[-2000:]
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("done", 2)]
    assert q(db_engine, "SELECT status, bytes_billed, job_id FROM enrichq.lookup_log") == [
        ("ok", 777, f"job-{key}")
    ]
    assert q(db_engine, "SELECT count(*) FROM enrichq.ticket_orders") == [(1,)]


def test_a_suspect_that_cannot_answer_in_a_child_in_time_runs_in_process_at_its_last_attempt(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """A suspect whose child never answers within the attempt's deadline (found by the
    fault harness: batches of 50 suspects under a 1.5 s deadline, each attempt stopped in
    its child, all 8 spent) stays a suspect but for its last attempt, which runs in the
    worker's process: a good ticket slow to isolate is done, not dead-lettered."""
    [key] = seeded(db_engine, 1)
    execute(
        db_engine,
        "UPDATE enrichq.queue SET attempts = 1, max_attempts = 3, last_error = :e",
        e=LEASE_EXPIRED_ERROR,
    )
    worker = spawn(
        ["worker", "--drain"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:slow_in_a_child",
            ENRICHQ_TEST_SLOW_SECONDS=120,
            attempt_deadline_seconds=2,
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
        ),
        log=tmp_path / "w.log",
    )
    assert worker.wait(120) == 0, (tmp_path / "w.log").read_text()[-2000:]
    assert q(db_engine, "SELECT key, state, attempts FROM enrichq.queue") == [(key, "done", 3)]
    assert q(
        db_engine, "SELECT count(*) FROM enrichq.ticket_orders WHERE ticket_id = :k", k=key
    ) == [(1,)]
