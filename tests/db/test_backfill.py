"""`enrichq backfill` on real PostgreSQL: what it enqueues (every ticket consumers can read
that enrichq never enriched), at which priority, audited, with its progress shown; and the
whole path history → backfill → workers → parity → approve → staged cutover, with the
consumer view losing no ticket."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.db import q
from tests.support.parity_world import add_queue_row, add_ticket, create_sources
from tests.support.settings import make_settings

from enrichq_parity.cutover import VIEW
from enrichq_service import queue
from enrichq_service.cli import main
from enrichq_service.observe import families, read_snapshot
from enrichq_service.queue import EnqueueRequest
from enrichq_service.worker import Worker

NOW = datetime.now(UTC)
RECENT = NOW - timedelta(days=2)
OLD = NOW - timedelta(days=40)


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, db_url: str) -> str:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    return db_url


def build(conn: sa.Connection) -> None:
    """acme: 10 tickets from before the shadow run (legacy rows only), 3 recent ones both
    flows enriched, one whose enrich row is queued; globex: 2 never enriched; and a ticket
    with legacy rows that the mirror lacks."""
    create_sources(conn)
    for i in range(10):
        add_ticket(conn, f"acme-old-{i}", created_at=OLD, legacy=[f"H-acme-{i}"])
    for i in range(3):
        add_ticket(conn, f"acme-new-{i}", created_at=RECENT, legacy=[f"N{i}"], shadow=[f"N{i}"])
    add_ticket(conn, "acme-queued", created_at=RECENT, legacy=["Q1"])
    add_queue_row(conn, "acme-queued", "queued")
    for i in range(2):
        add_ticket(conn, f"globex-{i}", created_at=RECENT, tenant="globex", legacy=[f"G{i}"])
    conn.execute(
        sa.text("INSERT INTO legacy.ticket_orders VALUES ('ghost-1', 'X1', :at)"), {"at": OLD}
    )


def backfill_rows(engine: sa.Engine) -> list[tuple[object, ...]]:
    return q(
        engine,
        "SELECT key, tenant, state FROM enrichq.queue WHERE kind = 'backfill' ORDER BY key",
    )


def test_backfill_enqueues_what_consumers_read_and_enrichq_never_enriched(
    cli: str, db_engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with db_engine.begin() as conn:
        build(conn)
    assert main(["backfill", "--tenant", "acme", "--dry-run"]) == 0
    assert "would enqueue 10 at the lowest priority, 1 already in the queue" in (
        capsys.readouterr().out
    )
    assert backfill_rows(db_engine) == []
    assert q(db_engine, "SELECT count(*) FROM enrichq.audit_log") == [(0,)]

    assert main(["backfill", "--tenant", "acme", "--page-size", "3", "--actor", "carol"]) == 0
    out = capsys.readouterr().out
    assert "14 tickets consumers can read, 11 never enriched; enqueued 10" in out
    assert backfill_rows(db_engine) == [(f"acme-old-{i}", "acme", "queued") for i in range(10)]
    # again: each is queued already, nothing new
    assert main(["backfill", "--tenant", "acme"]) == 0
    assert "enqueued 0 at the lowest priority, 11 already in the queue" in capsys.readouterr().out

    # since two days ago: globex's two (ghost-1 was looked up 40 days ago)
    assert main(["backfill", "--since", f"{RECENT - timedelta(days=1):%Y-%m-%d}"]) == 0
    out = capsys.readouterr().out
    assert "6 tickets consumers can read, 3 never enriched; enqueued 2" in out
    assert "missing from the tickets mirror" not in out
    assert main(["backfill"]) == 0
    out = capsys.readouterr().out
    assert "17 tickets consumers can read, 14 never enriched; enqueued 1" in out  # ghost-1
    assert "1 tickets have legacy rows but are missing from the tickets mirror" in out
    assert [r for r in backfill_rows(db_engine) if not str(r[0]).startswith("acme")] == [
        ("ghost-1", None, "queued"), ("globex-0", "globex", "queued"),
        ("globex-1", "globex", "queued"),
    ]  # fmt: skip
    audit = q(
        db_engine,
        "SELECT command, actor, rows_affected, finished_at IS NOT NULL FROM enrichq.audit_log"
        " ORDER BY id",
    )
    assert audit[0] == ("backfill", "carol", 10, True)
    assert [a[2] for a in audit] == [10, 0, 2, 1]
    # its progress: the backfill rows by state in `status` (and enrichq_queue_rows)
    assert main(["status", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)["counts"]
    assert counts["backfill"]["queued"] == 13
    with db_engine.connect() as conn:
        [rows] = [f for f in families(read_snapshot(conn)) if f.name == "enrichq_queue_rows"]
    shown = {(s.labels["kind"], s.labels["state"]): s.value for s in rows.samples}
    assert shown[("backfill", "queued")] == 13


def test_backfill_progress_is_plain_lines_without_a_terminal(
    cli: str, db_engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with db_engine.begin() as conn:
        build(conn)
    assert main(["backfill", "--tenant", "acme", "--page-size", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["backfill: 10/14 tickets read"]


def test_backfill_of_a_missing_table_is_bad_input(
    cli: str, db_engine: sa.Engine, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    with db_engine.begin() as conn:
        build(conn)
    monkeypatch.setenv("ENRICHQ_TICKETS_TABLE", "helpdesk.nowhere")
    assert main(["backfill"]) == 2
    assert capsys.readouterr().err.strip() == (
        "enrichq: backfill: table helpdesk.nowhere does not exist (ENRICHQ_TICKETS_TABLE); "
        "nothing changed"
    )
    assert backfill_rows(db_engine) == []


def test_backfill_rows_are_claimed_after_every_other_kind(
    db_engine: sa.Engine, db_url: str
) -> None:
    """A backfill row waiting for an hour still comes after a fresh enrich row of a free
    tenant, and after refresh work; alone, it is claimed."""
    settings = make_settings(db_url)
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.tenants (tenant, plan, priority) VALUES ('cheap', 'free', 0)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, visible_at,"
                " max_attempts) VALUES ('backfill', 'T-old', 'acme', -1, 'manual',"
                " now() - interval '1 hour', 5)"
            )
        )
        queue.enqueue(
            conn,
            [
                EnqueueRequest.build(key="T-free", tenant="cheap"),
                EnqueueRequest.build(key="T-refresh", kind="refresh", reason="refresh"),
            ],
            settings=settings,
        )
    order = []
    for _ in range(3):
        with db_engine.begin() as conn:
            (job,) = queue.claim(conn, owner="w-1", limit=1, lease_seconds=30)
            order.append(job.key)
    assert order[-1] == "T-old"
    assert sorted(order[:2]) == ["T-free", "T-refresh"]


def test_history_backfill_parity_approve_cutover_loses_no_ticket(
    cli: str,
    db_engine: sa.Engine,
    db_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The checklist of docs/cutover.md: backfill, let the workers drain it, parity,
    approve, then a tenant: every ticket consumers read before, they read after."""
    with db_engine.begin() as conn:
        build(conn)
        conn.execute(sa.text("DELETE FROM enrichq.queue"))
        conn.execute(sa.text("DELETE FROM legacy.ticket_orders WHERE ticket_id = 'ghost-1'"))
    before = dict(q(db_engine, "SELECT ticket_id, count(*) FROM legacy.ticket_orders GROUP BY 1"))
    assert main(["backfill"]) == 0
    Worker(make_settings(db_url), db_engine).run(drain=True)
    assert backfill_rows(db_engine) == [(k, t, "done") for k, t, _ in backfill_rows(db_engine)]
    assert main(["parity", "--json", str(tmp_path / "p.json")]) == 0
    run_id = json.loads((tmp_path / "p.json").read_text())["run_id"]
    assert main(["parity", "approve", str(run_id), "--by", "alice"]) == 0
    assert main(["cutover", "--tenant", "acme"]) == 0, capsys.readouterr().err
    assert main(["cutover", "--tenant", "globex"]) == 0, capsys.readouterr().err
    after = dict(q(db_engine, f"SELECT ticket_id, count(*) FROM {VIEW} GROUP BY 1"))
    assert after == before


@pytest.mark.parametrize("phase", ["backfill_mirror_page", "backfill_legacy_page"])
def test_a_backfill_page_reads_its_tickets_by_index(
    db_engine: sa.Engine, db_url: str, phase: str
) -> None:
    """With 20,000 tickets and their legacy rows analyzed, a page (after a cursor in the
    middle) walks its table by an index (the mirror by its primary key, the legacy table by
    its ticket_id index), never a scan of the whole table and a sort: a backfill's cost
    follows its pages, not the history. (Probing the other table is the planner's choice by
    size: at 20,000 a hash of the mirror, at millions index probes.)"""
    from tests.support.plans import explain, walk

    from enrichq_sweeper.backfill import _statements

    with db_engine.begin() as conn:
        create_sources(conn)
        conn.execute(
            sa.text(
                "INSERT INTO helpdesk.tickets SELECT 'T-' || lpad(g::text, 6, '0'),"
                " 'x@example.com', 'tenant-' || (g % 20), now() - interval '40 days', now()"
                " FROM generate_series(1, 20000) AS g"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO legacy.ticket_orders SELECT 'T-' || lpad(g::text, 6, '0'),"
                " 'O-' || g, now() - interval '40 days' FROM generate_series(1, 20000) AS g"
            )
        )
    with db_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
    settings = make_settings(db_url)
    with db_engine.connect() as conn:
        statement = _statements(conn, settings)[phase]
        plan = explain(
            conn,
            str(statement),
            {
                "after": "T-010000", "tenant": None, "since": None, "page_size": 1000,
                "priority": -1, "max_attempts": 5, "key_max_length": 200, "dry_run": True,
                "now": None,
            },
        )  # fmt: skip
        conn.rollback()
    scans = {
        (str(n["Relation Name"]), str(n["Node Type"])) for n in walk(plan) if "Relation Name" in n
    }
    walked = "tickets" if phase == "backfill_mirror_page" else "ticket_orders"
    kinds = {kind for name, kind in scans if name == walked}
    assert kinds, scans
    assert kinds <= {"Index Scan", "Index Only Scan"}, scans
