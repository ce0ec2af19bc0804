"""The fleet-wide warehouse cap (ENRICHQ_WAREHOUSE_MAX_CONCURRENCY, issue 16) with real
`enrichq worker` processes against real PostgreSQL: never more than N warehouse calls at
once across every process; a call that finds no slot in time is deferred with its attempt
given back, never failed, and counted; the slot of a holder killed with SIGKILL is free
again within one lease.

Every call of the probe enricher records its start and end in a folder (monotonic clock,
one clock for every process on Linux), so the overlap is measured from outside the
processes, not taken from enrichq's own bookkeeping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from tests.support.db import execute, q
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.web import free_port
from tests.support.world import add_tickets, enqueue, seeded

from enrichq_service.worker.admission import ADMISSION_LOCK_SPACE as LOCK_SPACE

pytestmark = pytest.mark.slow

PROBE = "tests.support.enrichers:slot_probe"
NS = 1_000_000_000


def counter(port: int, name: str, **labels: str) -> float:
    """A counter's value on one process's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_total" and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                return float(sample.value)
    return 0.0


def answers(port: int) -> bool:
    """Whether a process serves its /metrics yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2):
            return True
    except OSError:
        return False


def calls(folder: Path, *, killed_at: int | None = None) -> list[tuple[int, int, int]]:
    """Every probe call as (pid, start, end); a call whose process was killed ends then."""
    out = []
    for marker in folder.iterdir():
        pid, start = (int(p) for p in marker.name.split("-"))
        text = marker.read_text()
        end = int(text) if text else (killed_at or time.monotonic_ns())
        out.append((pid, start, end))
    return sorted(out, key=lambda c: c[1])


def most_at_once(intervals: list[tuple[int, int, int]]) -> int:
    """The largest number of calls running at the same moment."""
    edges = sorted([(s, 1) for _, s, _ in intervals] + [(e, -1) for _, _, e in intervals])
    running = peak = 0
    for _, step in edges:  # an end sorts before a start at the same instant
        running += step
        peak = max(peak, running)
    return peak


def test_three_workers_never_run_more_warehouse_calls_than_the_cap(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Cap 2; three processes of one lookup each, batches of 3 tickets, calls of 2.5 s:
    the cap is reached only by two processes at once, and the third process's batch finds
    no slot within the 2 s wait and is deferred. (With two lookups a process, one process
    could reach the cap alone and win every later race for the deferred rows: seen in 3
    runs of 4, also before the lookup window and the per-query budget.) The tickets are
    enqueued only once every process answers on its metrics port."""
    keys = seeded(db_engine, 18, enqueued=False)
    started = tmp_path / "calls"
    started.mkdir()
    ports = [free_port() for _ in range(3)]
    workers = [
        spawn(
            ["worker"],
            enrichq_env(
                db_url,
                batch_enricher=PROBE,
                lookup_batch_size=3,
                concurrency=1,
                warehouse_max_concurrency=2,
                lease_seconds=10,
                heartbeat_seconds=2,
                poll_seconds=0.5,
                metrics_port=port,
                ENRICHQ_TEST_SLOW_SECONDS=2.5,
                ENRICHQ_TEST_STARTED_DIR=started,
            ),
            log=tmp_path / f"w{i}.log",
        )
        for i, port in enumerate(ports)
    ]
    try:
        wait_for(lambda: all(answers(p) for p in ports), timeout=60, what="three workers up")
        enqueue(db_engine, keys)
        wait_for(
            lambda: (
                q(db_engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'done'") == [(18,)]
            ),
            timeout=120,
            what="every ticket to be done",
        )
        waits = sum(counter(p, "enrichq_warehouse_slot_waits") for p in ports)
        deferred = sum(counter(p, "enrichq_warehouse_deferrals", reason="cap") for p in ports)
    finally:
        codes = [stop(w) for w in workers]
    assert codes == [0, 0, 0]
    made = calls(started)
    assert len({pid for pid, _, _ in made}) > 1  # the calls came from several processes
    assert most_at_once(made) == 2  # the cap, reached and never passed
    assert waits > 0
    assert deferred > 0
    # deferred, never failed, and every deferral gave its attempt back
    assert q(db_engine, "SELECT state, attempts, count(*) FROM enrichq.queue GROUP BY 1, 2") == [
        ("done", 1, 18)
    ]
    assert q(db_engine, "SELECT count(*) FROM enrichq.lookups_in_flight") == [(0,)]


def test_the_slot_of_a_holder_killed_with_sigkill_is_free_within_one_lease(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Cap 1, lease 4 s. Worker A holds the slot in a call that never ends; worker B is
    refused for as long as A lives (longer than a lease: A's heartbeat keeps its slot);
    A is killed with SIGKILL; B's first call starts within one lease of the kill."""
    lease = 4.0
    seeded(db_engine, 8)
    started = tmp_path / "calls"
    started.mkdir()

    def worker(name: str, seconds: float, port: int) -> subprocess.Popen[bytes]:
        env = enrichq_env(
            db_url,
            batch_enricher=PROBE,
            lookup_batch_size=1,
            concurrency=1,
            warehouse_max_concurrency=1,
            lease_seconds=lease,
            heartbeat_seconds=1,
            poll_seconds=0.5,
            metrics_port=port,
            ENRICHQ_TEST_SLOW_SECONDS=seconds,
            ENRICHQ_TEST_STARTED_DIR=started,
        )
        return spawn(["worker"], env, log=tmp_path / f"{name}.log")

    a = worker("a", 600, 0)
    b_port = free_port()
    b: subprocess.Popen[bytes] | None = None
    try:
        [(_, a_started, _)] = wait_for(lambda: calls(started), timeout=30, what="A's call")
        b = worker("b", 0.2, b_port)
        # A holds its slot for more than a lease; B gets none meanwhile
        while time.monotonic_ns() < a_started + int((lease + 2) * NS):
            assert [pid for pid, _, _ in calls(started)] == [a.pid]
            time.sleep(0.1)
        [(owner, left)] = q(
            db_engine,
            "SELECT owner, extract(epoch FROM expires_at - now())"
            " FROM enrichq.lookups_in_flight WHERE expires_at > now()",
        )
        assert f":{a.pid}:" in owner
        assert 0 < left <= lease
        wait_for(
            lambda: counter(b_port, "enrichq_warehouse_deferrals", reason="cap") > 0,
            timeout=30,
            what="B to be refused a slot",
        )
        assert [pid for pid, _, _ in calls(started)] == [a.pid]
        killed_at = time.monotonic_ns()
        os.kill(a.pid, signal.SIGKILL)
        assert a.wait(10) == -signal.SIGKILL
        first_b = wait_for(
            lambda: [c for c in calls(started, killed_at=killed_at) if c[0] == b.pid],
            timeout=30,
            what="B's first call",
        )[0]
        freed_after = (first_b[1] - killed_at) / NS
        assert 0 < freed_after <= lease + 1.0, freed_after
        # and B goes on under the cap: one call at a time, A's dead call included
        wait_for(
            lambda: (
                q(db_engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'done'") == [(7,)]
            ),
            timeout=60,
            what="B to do every ticket but A's",
        )
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(10)
        if b is not None:
            assert stop(b) == 0
    assert most_at_once(calls(started, killed_at=killed_at)) == 1
    # the dead holder's row went when B was admitted; B's were released by its settles
    assert q(db_engine, "SELECT count(*) FROM enrichq.lookups_in_flight") == [(0,)]


def holding_the_admission_lock(engine: sa.Engine) -> sa.Connection:
    """A connection in a transaction that holds the fleet's admission lock: a holder that
    froze (SIGSTOP) at the worst moment, before its COMMIT."""
    conn = engine.connect()
    conn.begin()
    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:space, 0)"), {"space": LOCK_SPACE})
    return conn


def waiting_for_the_lock(engine: sa.Engine, worker: subprocess.Popen[bytes]) -> list[int]:
    """The backends waiting for an advisory lock; fails at once if the worker exited."""
    assert worker.poll() is None, f"the worker exited {worker.returncode}"
    return [
        pid
        for (pid,) in q(
            engine,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
        )
    ]


def test_a_frozen_lock_holder_and_a_killed_connection_cost_a_wait_never_a_crash(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Cap 1, statement timeout 1 s. The admission lock is held (a frozen holder) for 4 s:
    the worker's admission waits; its connection is terminated once, then its statement
    times out. It retries; once the lock is free the ticket is done on its first attempt
    (it exited 1 and spent the attempt of a job that never ran)."""
    seeded(db_engine, 1)
    worker = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            batch_enricher=PROBE,
            warehouse_max_concurrency=1,
            statement_timeout_seconds=1,
            poll_seconds=0.5,
            ENRICHQ_TEST_SLOW_SECONDS=0.1,
            ENRICHQ_TEST_STARTED_DIR=tmp_path,
        ),
        log=tmp_path / "w.log",
    )
    try:
        holder = holding_the_admission_lock(db_engine)
        try:
            [waiting] = wait_for(
                lambda: waiting_for_the_lock(db_engine, worker), timeout=30, what="a wait"
            )
            q(db_engine, "SELECT pg_terminate_backend(:pid)", pid=waiting)
            wait_for(
                lambda: [p for p in waiting_for_the_lock(db_engine, worker) if p != waiting],
                timeout=30,
                what="the admission to try again",
            )
            time.sleep(3)  # past the statement timeout
            assert worker.poll() is None, (tmp_path / "w.log").read_text()
        finally:
            holder.close()
        wait_for(
            lambda: q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("done", 1)],
            timeout=30,
            what="the ticket to be done",
        )
    finally:
        code = stop(worker)
    assert code == 0, (tmp_path / "w.log").read_text()


OTHER = "other:1:x"  # another holder of the one slot


def one_attempt_and_the_slot_taken(engine: sa.Engine) -> None:
    """One ticket of one attempt, and the cap's one slot held by another holder (until
    the test deletes its row)."""
    seeded(engine, 1)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE enrichq.queue SET max_attempts = 1"))
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.lookups_in_flight"
                " (token, owner, reserved_bytes, started_at, expires_at)"
                " VALUES (gen_random_uuid(), :o, 0, now(), now() + interval '5 min')"
            ),
            {"o": OTHER},
        )


def test_a_job_waiting_for_a_slot_past_its_deadline_is_deferred_with_its_attempt(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Cap 1, taken by another worker's lookup; a one-second attempt deadline (under the
    2 s slot wait) and one attempt. Waiting for the slot is not running: the job is
    deferred each time with its attempt given back, and done once the slot frees (it
    counted as started, spent its one attempt waiting and was dead-lettered, 0 lookups)."""
    one_attempt_and_the_slot_taken(db_engine)
    worker = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            batch_enricher=PROBE,
            warehouse_max_concurrency=1,
            attempt_deadline_seconds=1,
            poll_seconds=0.2,
            ENRICHQ_TEST_SLOW_SECONDS=0.1,
            ENRICHQ_TEST_STARTED_DIR=tmp_path,
        ),
        log=tmp_path / "w.log",
    )
    try:
        time.sleep(4)  # two deadlines, and more, spent waiting for the slot
        assert q(db_engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'dead_letter'") == [
            (0,)
        ]
        execute(db_engine, "DELETE FROM enrichq.lookups_in_flight WHERE owner = :o", o=OTHER)
        wait_for(
            lambda: q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("done", 1)],
            timeout=30,
            what="the ticket to be done on its first attempt",
        )
    finally:
        code = stop(worker)
    assert code == 0
    assert q(db_engine, "SELECT count(*) FROM enrichq.lookup_log") == [(1,)]


def test_an_attempt_admitted_late_still_has_its_whole_deadline_to_run(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Cap 1, taken by another holder until half a second after the claim; a one-second
    attempt deadline, a call of 0.8 s, one attempt. The deadline bounds running, which
    begins at the admission: the job is done on its attempt. (It counted from the claim:
    the call was abandoned 0.5 s in, 'attempt deadline of 1 s exceeded', and the ticket
    dead-lettered; the fault harness's seed 10007 dead-lettered a ticket so, with the
    deadline in place of its own error.)"""
    one_attempt_and_the_slot_taken(db_engine)
    worker = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            batch_enricher=PROBE,
            warehouse_max_concurrency=1,
            attempt_deadline_seconds=1,
            poll_seconds=0.2,
            ENRICHQ_TEST_SLOW_SECONDS=0.8,
            ENRICHQ_TEST_STARTED_DIR=tmp_path,
        ),
        log=tmp_path / "w.log",
    )
    try:
        wait_for(
            lambda: q(db_engine, "SELECT state FROM enrichq.queue") == [("leased",)],
            interval=0.01,
            what="the claim",
        )
        time.sleep(0.5)
        execute(db_engine, "DELETE FROM enrichq.lookups_in_flight WHERE owner = :o", o=OTHER)
        wait_for(
            lambda: q(db_engine, "SELECT state FROM enrichq.queue") != [("leased",)],
            timeout=30,
            what="the attempt to end",
        )
        assert q(db_engine, "SELECT state, attempts, last_error FROM enrichq.queue") == [
            ("done", 1, None)
        ]
    finally:
        code = stop(worker)
    assert code == 0


def test_an_abandoned_lookup_that_keeps_running_keeps_its_slot(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Cap 1, lease 3 s, a one-second attempt deadline, calls of 12 s deaf to cancellation.
    The first ticket's attempt is abandoned (retried a minute later): the worker holds no
    job, but its lookup still runs. A second ticket, enqueued well after a lease, waits for
    that lookup to end (its slot expired, the heartbeat having nothing else to extend, and
    the second call ran beside the first 6 s in)."""
    [first] = seeded(db_engine, 1)
    started = tmp_path / "calls"
    started.mkdir()
    worker = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            batch_enricher=PROBE,
            lookup_batch_size=1,
            warehouse_max_concurrency=1,
            attempt_deadline_seconds=1,
            lease_seconds=3,
            heartbeat_seconds=0.5,
            backoff_base_seconds=60,
            backoff_cap_seconds=60,
            poll_seconds=0.2,
            ENRICHQ_TEST_SLOW_SECONDS=12,
            ENRICHQ_TEST_STARTED_DIR=started,
        ),
        log=tmp_path / "w.log",
    )
    try:
        [(_, first_started, _)] = wait_for(lambda: calls(started), timeout=30, what="a call")
        wait_for(
            lambda: (
                q(db_engine, "SELECT state FROM enrichq.queue WHERE key = :k", k=first)
                == [("queued",)]
            ),
            timeout=30,
            what="the first attempt to be abandoned",
        )
        while time.monotonic_ns() < first_started + 6 * NS:  # two leases into the call
            time.sleep(0.1)
        with db_engine.begin() as conn:
            add_tickets(conn, ["SECOND"])
            enqueue(conn, ["SECOND"])
        wait_for(lambda: len(calls(started)) == 2, timeout=60, what="the second call")
        made = wait_for(
            lambda: calls(started) if all(m.read_text() for m in started.iterdir()) else None,
            timeout=60,
            what="both calls to end",
        )
        assert q(db_engine, "SELECT attempts FROM enrichq.queue WHERE key = 'SECOND'") == [(1,)]
    finally:
        stop(worker)
    [(_, _, first_ended), (_, second_started, _)] = made
    assert second_started >= first_ended, (second_started - first_ended) / NS


def test_lookups_that_bill_nothing_run_side_by_side_under_a_budget(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """A budget, no cap, calls of 1 s that bill 0 bytes, four slots: once the first call's
    0 bytes are on the ledger, the cost is known (nothing) and calls run four at a time,
    no wait labelled `cap` (they ran one at a time: an average of 0 read as unknown)."""
    seeded(db_engine, 12)
    started = tmp_path / "calls"
    started.mkdir()
    port = free_port()
    worker = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            batch_enricher=PROBE,
            lookup_batch_size=1,
            concurrency=4,
            daily_bytes_budget=10**9,
            poll_seconds=0.2,
            metrics_port=port,
            ENRICHQ_TEST_SLOW_SECONDS=1,
            ENRICHQ_TEST_STARTED_DIR=started,
        ),
        log=tmp_path / "w.log",
    )
    try:
        wait_for(
            lambda: (
                q(db_engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'done'") == [(12,)]
            ),
            timeout=60,
            what="every ticket to be done",
        )
        capped = counter(port, "enrichq_warehouse_deferrals", reason="cap")
    finally:
        assert stop(worker) == 0
    assert most_at_once(calls(started)) == 4
    assert capped == 0
    assert q(db_engine, "SELECT bytes_billed, lookups FROM enrichq.budget_ledger") == [(0, 12)]


def warehouse_sleeps(engine: sa.Engine) -> list[tuple[int, float]]:
    """The warehouse queries running now (a plug-in's pg_sleep): (backend pid, seconds)."""
    return [
        (pid, float(seconds))
        for pid, seconds in q(
            engine,
            "SELECT pid, extract(epoch FROM now() - query_start) FROM pg_stat_activity"
            " WHERE datname = current_database() AND state = 'active'"
            " AND application_name = 'enrichq-warehouse' AND query LIKE '%pg_sleep%'",
        )
    ]


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_a_plug_ins_warehouse_query_does_not_outlive_its_slot(
    db_url: str, db_engine: sa.Engine, tmp_path: Path, fault: str
) -> None:
    """Cap 1, lease 4 s, a 3 s attempt deadline, a plug-in whose own warehouse query sleeps
    600 s deaf to cancellation. The worker is killed with SIGKILL, or frozen with SIGSTOP,
    while the query runs: the worker's slot expires within a lease, so the query must be
    gone by then, or another worker's lookup would run beside it. Killed: the server ends
    a query whose client is gone. Frozen: the query's statement timeout (the attempt
    deadline) ends it, within the slot's life. (Before: the query ran on for its 600 s,
    and the fuzz harness saw 3 queries at once under a cap of 2, seed 8049.)"""
    lease, deadline = 4.0, 3.0
    seeded(db_engine, 1)
    worker = spawn(
        ["worker"],
        enrichq_env(
            db_url,
            enricher="tests.support.enrichers:slow_query",
            concurrency=1,
            warehouse_max_concurrency=1,
            lease_seconds=lease,
            heartbeat_seconds=1,
            attempt_deadline_seconds=deadline,
            poll_seconds=0.5,
            ENRICHQ_TEST_SLOW_SECONDS=600,
        ),
        log=tmp_path / "w.log",
    )
    try:
        [(backend, _)] = wait_for(
            lambda: warehouse_sleeps(db_engine), timeout=30, what="the plug-in's query"
        )
        [(expires_in,)] = q(
            db_engine,
            "SELECT extract(epoch FROM max(expires_at) - now()) FROM enrichq.lookups_in_flight",
        )
        struck = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
        wait_for(
            lambda: backend not in [pid for pid, _ in warehouse_sleeps(db_engine)],
            timeout=30,
            interval=0.1,
            what="the query to end",
        )
        gone_after = time.monotonic() - struck
        # the slot lives at least until then: the lease from its admission, or its last
        # heartbeat, which can only come later
        assert gone_after < float(expires_in), (gone_after, expires_in)
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()
            worker.wait(10)
