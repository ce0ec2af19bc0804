"""The sweeper's periodic statements cost what they act on, not the size of the history.

A database that has run for a while: 200,000 dead letters (most of them superseded), a few
done rows past retention, 250,000 lookup-log rows, a run log and a year of claim buckets,
all ANALYZEd. Each statement is run under EXPLAIN ANALYZE (rolled back) and must read
about one page of rows through an index, never the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.pg import Databases
from tests.support.plans import explain, scans_of, walk, work

from enrichq_schema.db import create_engine
from enrichq_schema.queries import load
from enrichq_schema.states import KEY_MAX_LENGTH, OWNERLESS_PRIORITY
from enrichq_sweeper import reconcile
from enrichq_sweeper.refresh import ENRICHED_BEFORE_SECONDS, UPDATED_WITHIN_SECONDS

SWEEPER_SQL = load("enrichq_sweeper", "sql/sweeper.sql")
DEAD_LETTERS = 200_000
LOG_ROWS = 250_000
PAGE = 1000
T0 = datetime(2026, 6, 1, tzinfo=UTC)

FILL = [
    # dead letters over 90 days, most superseded, some past the 90-day retention
    """
    INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts, finished_at,
                               dead_reason)
    SELECT 'enrich', 'D-' || g, 'updated', 'dead_letter', 1, 5,
           CAST(:t0 AS timestamptz) - make_interval(mins => g % 140000),
           CASE WHEN g % 10 = 0 THEN 'attempts_exhausted' ELSE 'superseded' END
    FROM generate_series(1, :dead) AS g
    """,
    # done rows: a few thousand, some past the 30-day retention
    """
    INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts, finished_at)
    SELECT 'enrich', 'F-' || g, 'updated', 'done', 1, 5,
           CAST(:t0 AS timestamptz) - make_interval(hours => g % 1000)
    FROM generate_series(1, 5000) AS g
    """,
    """
    INSERT INTO enrichq.lookup_log (queue_id, ticket_id, attempt, duration_ms, status, created_at)
    SELECT g, 'F-' || g, 1, 1.0, 'ok', CAST(:t0 AS timestamptz) - make_interval(mins => g % 60000)
    FROM generate_series(1, :log) AS g
    """,
    """
    INSERT INTO enrichq.runs (component, owner, started_at, finished_at, stop_reason)
    SELECT 'sweeper', 'h:1', CAST(:t0 AS timestamptz) - make_interval(mins => g),
           CAST(:t0 AS timestamptz) - make_interval(mins => g), 'no_work'
    FROM generate_series(1, 50000) AS g
    """,
    """
    INSERT INTO enrichq.tenant_served (kind, tenant, bucket, served)
    SELECT 'enrich', 't-' || t, date_trunc('hour', CAST(:t0 AS timestamptz))
           - make_interval(hours => h), 1
    FROM generate_series(1, 30) AS t, generate_series(0, 24 * 60) AS h
    """,
    # the help desk: 50,000 tickets updated in the last week, enriched two days ago
    """
    CREATE SCHEMA helpdesk;
    """,
    """
    CREATE TABLE helpdesk.tickets (id text PRIMARY KEY, requester_email text, tenant text,
                                   created_at timestamptz, updated_at timestamptz)
    """,
    """
    CREATE INDEX ON helpdesk.tickets (updated_at, id)
    """,
    """
    INSERT INTO helpdesk.tickets (id, updated_at)
    SELECT 'T-' || g, CAST(:t0 AS timestamptz) - make_interval(secs => g * 10)
    FROM generate_series(1, 50000) AS g
    """,
    """
    INSERT INTO enrichq.ticket_enrichments (ticket_id, enriched_at, order_count, queue_id)
    SELECT 'T-' || g, CAST(:t0 AS timestamptz) - interval '2 days', 0, 1
    FROM generate_series(1, 50000) AS g
    """,
]


@dataclass(frozen=True)
class History:
    engine: sa.Engine


@pytest.fixture(scope="module")
def history(databases: Databases) -> Iterator[History]:
    url = databases.clone("sweeper_plans")
    engine = create_engine(url, pool_size=2)
    try:
        with engine.begin() as conn:
            for statement in FILL:
                conn.execute(sa.text(statement), {"t0": T0, "dead": DEAD_LETTERS, "log": LOG_ROWS})
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE"))
        yield History(engine)
    finally:
        engine.dispose()
        databases.drop(url)


def analyzed(history: History, name: str, params: dict[str, Any]) -> dict[str, Any]:
    # refresh names the tickets table in its text, as refresh.py puts it in
    sql = SWEEPER_SQL[name].sql.replace("{tickets_table}", "helpdesk.tickets")
    with history.engine.connect() as conn, conn.begin() as tx:
        plan = explain(conn, sql, params, analyze=True)
        tx.rollback()
    return plan


def rows_read(plan: dict[str, Any], relation: str) -> float:
    rows, _ = work(plan, lambda index: True, relation=relation)
    return rows


def assert_no_seq_scan(plan: dict[str, Any], relation: str) -> None:
    seq = [n for n in scans_of(plan, relation) if n["Node Type"] == "Seq Scan"]
    assert not seq, f"sequential scan of {relation}"


@pytest.mark.parametrize(
    ("statement", "relation", "cutoff"),
    [
        # done/failed past 30 days: a few hundred, beside 200,000 dead letters
        ("retention_prune_finished", "queue", T0 - timedelta(days=30)),
        ("retention_prune_dead", "queue", T0 - timedelta(days=90)),
        ("retention_prune_lookup_log", "lookup_log", T0 - timedelta(days=30)),
        ("retention_prune_runs", "runs", T0 - timedelta(days=30)),
        ("retention_prune_tenant_served", "tenant_served", T0 - timedelta(days=2)),
    ],
)
def test_a_prune_page_reads_about_the_rows_it_deletes(
    history: History, statement: str, relation: str, cutoff: datetime
) -> None:
    plan = analyzed(history, statement, {"cutoff": cutoff, "batch_size": PAGE})
    assert_no_seq_scan(plan, relation)
    deleted = next(n for n in walk(plan) if n["Node Type"] == "ModifyTable")["Actual Rows"]
    read = rows_read(plan, relation)
    # every matching row is deleted: the scan reads the page and no more (a doomed row is
    # read once to pick it and once to delete it)
    assert read <= 2 * PAGE + 1, f"{statement} read {read:.0f} rows to delete {deleted}"


def test_the_refresh_page_reads_one_page_of_recent_tickets(history: History) -> None:
    plan = analyzed(
        history,
        "refresh_enqueue_page",
        {
            "now": T0,
            "priority": OWNERLESS_PRIORITY,
            "max_attempts": 5,
            "updated_within_seconds": UPDATED_WITHIN_SECONDS,
            "enriched_before_seconds": ENRICHED_BEFORE_SECONDS,
            "key_max_length": KEY_MAX_LENGTH,
            "after_updated_at": datetime.min.replace(tzinfo=UTC),
            "after_id": "",
            "batch_size": PAGE,
        },
    )
    for relation in ("tickets", "ticket_enrichments", "queue"):
        assert_no_seq_scan(plan, relation)
    assert rows_read(plan, "tickets") <= PAGE
    inserted = next(n for n in walk(plan) if n["Node Type"] == "ModifyTable")["Actual Rows"]
    assert inserted == PAGE  # one statement never enqueues more than a page


def test_the_reconcile_page_reads_one_page_of_recent_tickets(history: History) -> None:
    """Half the week's tickets changed after their lookup (due), beside 200,000 dead letters:
    a page reads a page of the mirror through its (updated_at, id) index, and the queue and
    the lookups only by key."""
    params = {
        "now": T0,
        "priority": OWNERLESS_PRIORITY,
        "max_attempts": 5,
        "updated_within_seconds": reconcile.UPDATED_WITHIN_SECONDS,
        "quiet_seconds": 600.0,
        "key_max_length": KEY_MAX_LENGTH,
        # the tickets changed since their lookup (two days ago)
        "after_updated_at": T0 - timedelta(days=2, seconds=-1),
        "after_id": "",
        "batch_size": PAGE,
    }
    plan = analyzed(history, "reconcile_enqueue_page", params)
    for relation in ("tickets", "ticket_enrichments", "queue"):
        assert_no_seq_scan(plan, relation)
    assert rows_read(plan, "tickets") <= PAGE
    inserted = next(n for n in walk(plan) if n["Node Type"] == "ModifyTable")["Actual Rows"]
    assert inserted == PAGE  # one statement never enqueues more than a page


def test_the_terminal_count_is_covered_by_the_finished_row_indexes(history: History) -> None:
    """Everything the count groups by is in the two finished-row indexes: it can be an
    index-only scan (which the planner picks unless nearly the whole table is terminal, as
    this fixture's dead letters are; then a sequential scan is the cheaper read)."""
    sql = SWEEPER_SQL["counts_refresh"].sql
    with history.engine.connect() as conn, conn.begin() as tx:
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        plan = explain(conn, sql, {"now": T0}, analyze=True)
        tx.rollback()
    scans = scans_of(plan, "queue")
    assert scans
    assert {n["Node Type"] for n in scans} == {"Index Only Scan"}, scans
    assert {n["Index Name"] for n in scans} == {"queue_finished_idx", "queue_dead_finished_idx"}
