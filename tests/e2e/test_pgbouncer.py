"""enrichq behind a real PgBouncer 1.18 in transaction pooling: `worker`, `sweep` and
`serve` as processes, end to end; a session-mode setting behind it fails fast; a database
that refuses every connection stops `worker --drain` with its error."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.db import insert_expired_leases, q
from tests.support.pgbouncer import PgBouncer
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.settings import make_settings
from tests.support.web import answers, event, free_port, post_event
from tests.support.world import seeded

from enrichq_service import queue, seed
from enrichq_service.queue import EnqueueRequest

pytestmark = pytest.mark.slow

TRANSACTION = {"pool_mode": "transaction"}
FAST = {"lease_seconds": 3, "heartbeat_seconds": 0.5, "poll_seconds": 0.2}
SECRET = "pgbouncer-e2e-secret"
EXPECTED_ORDERS = (
    "SELECT t.id, o.order_id FROM helpdesk.tickets t"
    " JOIN warehouse.customers c ON lower(c.email) = lower(t.requester_email)"
    " JOIN warehouse.orders o ON o.customer_id = c.customer_id"
)
ADVISORY = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
LISTENING = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND query = 'LISTEN enrichq_queue'"
)


def one_line_error(proc_log: Path) -> str:
    lines = [line for line in proc_log.read_text().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


def test_two_workers_drain_through_pgbouncer_in_transaction_mode(
    db_url: str, db_engine: sa.Engine, pgbouncer: PgBouncer, tmp_path: Path
) -> None:
    seeded(db_engine, 200)
    env = enrichq_env(pgbouncer.url_of(db_url), **TRANSACTION, **FAST, concurrency=8)
    workers = [spawn(["worker", "--drain"], env, log=tmp_path / f"w{i}.log") for i in range(2)]
    for w in workers:
        assert w.wait(180) == 0, (tmp_path / "w0.log").read_text()[-3000:]
    assert q(db_engine, "SELECT state, count(*) FROM enrichq.queue GROUP BY 1") == [("done", 200)]
    assert set(q(db_engine, "SELECT ticket_id, order_id FROM enrichq.ticket_orders")) == set(
        q(db_engine, EXPECTED_ORDERS)
    )
    assert q(
        db_engine, "SELECT count(*), count(DISTINCT ticket_id) FROM enrichq.ticket_enrichments"
    ) == [(200, 200)]
    runs = q(db_engine, "SELECT stop_reason, error FROM enrichq.runs WHERE component = 'worker'")
    assert runs == [("no_work", None), ("no_work", None)]


def test_transaction_mode_listens_only_on_the_listen_url(
    db_url: str, db_engine: sa.Engine, pgbouncer: PgBouncer, tmp_path: Path
) -> None:
    """Without ENRICHQ_LISTEN_DATABASE_URL nothing LISTENs (polling alone, and work is still
    found); with it, the LISTEN connection is the direct one and a NOTIFY wakes the worker."""
    [key] = seeded(db_engine, 1)
    bounced = pgbouncer.url_of(db_url)
    polling = spawn(
        ["worker"], enrichq_env(bounced, **TRANSACTION, **FAST), log=tmp_path / "poll.log"
    )
    try:
        done = "SELECT count(*) FROM enrichq.queue WHERE state = 'done'"
        wait_for(lambda: q(db_engine, done) == [(1,)], timeout=60, what="the ticket done")
        assert q(db_engine, LISTENING) == [(0,)]
    finally:
        assert stop(polling) == 0
    listening = spawn(
        ["worker"],
        enrichq_env(
            bounced,
            **TRANSACTION,
            lease_seconds=3,
            heartbeat_seconds=0.5,
            poll_seconds=30,
            listen_database_url=db_url,
        ),
        log=tmp_path / "listen.log",
    )
    try:
        wait_for(lambda: q(db_engine, LISTENING) == [(1,)], timeout=30, what="the direct LISTEN")
        with db_engine.begin() as conn:
            queue.enqueue(conn, [EnqueueRequest.build(key=key)], settings=make_settings(None))
        # the poll is 30 s away: only the notification can make it this quick
        wait_for(lambda: q(db_engine, done) == [(2,)], timeout=20, what="a NOTIFY to wake it")
    finally:
        assert stop(listening) == 0


def lease_owner(engine: sa.Engine) -> str | None:
    """host:pid of the sweeper that leads (a lease owner is host:pid:random)."""
    rows = q(engine, "SELECT owner FROM enrichq.leader_leases WHERE expires_at > now()")
    return str(rows[0][0]).rsplit(":", 1)[0] if rows else None


def test_sweepers_lead_by_a_lease_row_and_take_over_when_the_leader_dies(
    db_url: str, db_engine: sa.Engine, pgbouncer: PgBouncer, tmp_path: Path
) -> None:
    with db_engine.begin() as conn:
        seed.create_external_tables(conn)  # the refresh pass reads the ticket mirror
    env = enrichq_env(pgbouncer.url_of(db_url), **TRANSACTION, sweep_interval_seconds=0.2)
    sweepers = [spawn(["sweep"], env, log=tmp_path / f"s{i}.log") for i in range(2)]
    try:
        owner = wait_for(lambda: lease_owner(db_engine), timeout=30, what="a leader")
        pids = {f"{socket.gethostname()}:{s.pid}": s for s in sweepers}
        assert owner in pids
        # no session advisory lock: nothing of the sort is held on the server
        assert q(db_engine, ADVISORY) == [(0,)]
        insert_expired_leases(db_engine, ["A-1", "A-2"])
        leased = "SELECT count(*) FROM enrichq.queue WHERE state = 'leased'"
        wait_for(lambda: q(db_engine, leased) == [(0,)], timeout=30, what="recovery")
        leader = pids.pop(owner)
        leader.kill()
        leader.wait(10)
        (survivor,) = pids
        wait_for(lambda: lease_owner(db_engine) == survivor, timeout=30, what="the takeover")
        insert_expired_leases(db_engine, ["B-1"])
        wait_for(lambda: q(db_engine, leased) == [(0,)], timeout=30, what="recovery again")
        assert q(db_engine, "SELECT key, state FROM enrichq.queue ORDER BY key") == [
            ("A-1", "queued"),
            ("A-2", "queued"),
            ("B-1", "queued"),
        ]
    finally:
        for s in sweepers:
            stop(s)
    # the survivor gave its lease up on SIGTERM, so a new sweeper would lead at once
    assert q(db_engine, "SELECT count(*) FROM enrichq.leader_leases") == [(0,)]


def test_serve_takes_a_signed_event_through_pgbouncer(
    db_url: str, db_engine: sa.Engine, pgbouncer: PgBouncer, tmp_path: Path
) -> None:
    with db_engine.begin() as conn:
        seed.seed_world(conn, tickets=5)
        ticket = conn.execute(sa.text("SELECT min(id) FROM helpdesk.tickets")).scalar_one()
    port = free_port()
    serve = spawn(
        ["serve"],
        enrichq_env(
            pgbouncer.url_of(db_url),
            **TRANSACTION,
            **FAST,
            http_host="127.0.0.1",
            http_port=port,
            webhook_secret=SECRET,
            delay_created_seconds=0,
        ),
        log=tmp_path / "serve.log",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(f"{base}/readyz"), timeout=60, what="/readyz")
        response = post_event(base, SECRET, event(ticket, tenant="acme"))
        assert response.status_code == 202, response.text
        done = "SELECT count(*) FROM enrichq.ticket_enrichments WHERE ticket_id = :t"
        wait_for(lambda: q(db_engine, done, t=ticket) == [(1,)], timeout=60, what="enriched")
    finally:
        assert stop(serve) == 0


@pytest.mark.parametrize("command", [["worker", "--drain"], ["sweep"], ["serve"]])
def test_session_mode_behind_a_transaction_pooler_fails_fast(
    command: list[str], db_url: str, pgbouncer: PgBouncer, tmp_path: Path
) -> None:
    env = enrichq_env(pgbouncer.url_of(db_url), http_port=free_port(), http_host="127.0.0.1")
    proc = spawn(command, env, log=tmp_path / "out.log")
    assert proc.wait(60) == 2
    line = one_line_error(tmp_path / "out.log")
    assert "ENRICHQ_POOL_MODE is session" in line
    assert "set ENRICHQ_POOL_MODE=transaction" in line


def test_a_listen_url_through_the_pooler_is_refused(
    db_url: str, pgbouncer: PgBouncer, tmp_path: Path
) -> None:
    bounced = pgbouncer.url_of(db_url)
    env = enrichq_env(bounced, **TRANSACTION, listen_database_url=bounced)
    proc = spawn(["worker", "--drain"], env, log=tmp_path / "out.log")
    assert proc.wait(60) == 2
    assert "ENRICHQ_LISTEN_DATABASE_URL leads to a transaction pooler" in one_line_error(
        tmp_path / "out.log"
    )


def test_drain_exits_with_the_error_when_every_connection_is_refused(
    db_url: str, pgbouncer: PgBouncer, tmp_path: Path
) -> None:
    """PgBouncer 1.18 refuses the `options` startup parameter (enrichq no longer sends it,
    a URL may); nothing listening refuses outright. Either way: one line, exit 1, at once."""
    refused_by_pgbouncer = pgbouncer.url_of(db_url) + "?options=-c%20work_mem%3D8MB"
    nothing_there = f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere"
    for i, url in enumerate([refused_by_pgbouncer, nothing_there]):
        log = tmp_path / f"out{i}.log"
        proc = spawn(["worker", "--drain"], enrichq_env(url, **TRANSACTION), log=log)
        assert proc.wait(60) == 1
        line = one_line_error(log)
        assert line.startswith("enrichq: database unavailable:")
    assert "unsupported startup parameter: options" in (tmp_path / "out0.log").read_text()
