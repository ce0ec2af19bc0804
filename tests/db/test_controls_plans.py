"""The operator controls' statements read open rows or dead letters, never the history.

Like test_queue_plans.py: 200,000 terminal rows (a fifth of them dead letters, so dead
letters are many too), 100,000 done rows newer than every dead letter, and a few hundred
open ones, ANALYZEd. For every filter an operator can give, EXPLAIN shows no sequential
scan of enrichq.queue and only these indexes:

- selecting open rows (cancel): the partial indexes over queued and leased rows;
- selecting dead letters (dlq): the dead-letter partial indexes (never the index over every
  terminal row, which would read the done/failed history too), a ticket's (`--key`) through
  the dead-letter key index;
- the batches and the sample: the primary key (lookups by id), maybe combined with the
  scope's partial indexes, plus the queued-key index for redrive's merge probe.

Each page of a selection reads about a page of rows, however many match; `dlq list` reads
about a page of dead letters, and the sweeper's terminal count reads the finished-row
indexes only (index-only), not the table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.pg import Databases
from tests.support.plans import SCAN_TYPES, explain, scans_of, walk, work

from enrichq_schema.db import create_engine
from enrichq_schema.states import NOTIFY_CHANNEL, DeadReason
from enrichq_service.controls import actions as controls
from enrichq_service.controls import dlq
from enrichq_service.controls.filters import Filter, Scope
from enrichq_sweeper import counts

TERMINAL_ROWS = 200_000
NEWER_DONE_ROWS = 100_000
DEAD_LETTERS = TERMINAL_ROWS // 5
PAGE = 1000

FILL = """
INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, state, visible_at, attempts,
                           max_attempts, finished_at, dead_reason, created_at)
SELECT CASE WHEN g % 10 = 0 THEN 'refresh' ELSE 'enrich' END, 'H-' || g,
       (ARRAY['acme', 'globex', 'initech', NULL])[1 + g % 4], 1, 'created',
       (ARRAY['done', 'done', 'done', 'failed', 'dead_letter'])[1 + g % 5],
       now() - interval '2 days', 1, 5, now() - make_interval(secs => g),
       CASE WHEN g % 5 = 4 THEN (ARRAY['attempts_exhausted', 'superseded'])[1 + g % 2] END,
       now() - interval '3 days'
FROM generate_series(1, :terminal) AS g;

INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, visible_at, max_attempts,
                           created_at)
SELECT CASE WHEN g % 10 = 0 THEN 'refresh' ELSE 'enrich' END, 'Q-' || g,
       (ARRAY['acme', 'globex', 'initech', NULL])[1 + g % 4], 1, 'updated',
       now() + make_interval(secs => (g % 3 - 1) * 300), 5, now() - make_interval(mins => g)
FROM generate_series(1, 300) AS g;

INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, state, visible_at, attempts,
                           max_attempts, lease_owner, lease_expires_at, heartbeat_at)
SELECT 'enrich', 'L-' || g, 'acme', 1, 'updated', 'leased', now() - interval '5 minutes', 1, 5,
       'w-' || (g % 10), now() + interval '1 minute', now()
FROM generate_series(1, 200) AS g;

INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, state, visible_at, attempts,
                           max_attempts, finished_at, created_at)
SELECT 'enrich', 'N-' || g, 'acme', 1, 'updated', 'done', now() - interval '1 hour', 1, 5,
       now() - make_interval(secs => g), now() - interval '1 hour'
FROM generate_series(1, :newer) AS g;
"""

OPEN_INDEXES = {
    "queue_queued_key_uq",
    "queue_claim_idx",
    "queue_leased_key_uq",
    "queue_leased_expiry_idx",
}
DEAD_INDEXES = {"queue_dead_reason_idx", "queue_dead_finished_idx", "queue_dead_key_idx"}
PRIMARY_KEY = "queue_pkey"


@pytest.fixture(scope="module")
def engine(databases: Databases) -> Iterator[sa.Engine]:
    url = databases.clone("control_plans")
    eng = create_engine(url, pool_size=2)
    try:
        with eng.begin() as conn:
            for statement in filter(str.strip, FILL.split(";")):
                conn.execute(
                    sa.text(statement), {"terminal": TERMINAL_ROWS, "newer": NEWER_DONE_ROWS}
                )
        with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE enrichq.queue"))
        yield eng
    finally:
        eng.dispose()
        databases.drop(url)


def plan_of(conn: sa.Connection, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The JSON plan of a controls statement, planned with its parameters (as it runs)."""
    return explain(conn, controls.sql()[name].sql, params)


def queue_reads(plan: dict[str, Any]) -> tuple[list[str], set[str]]:
    """The scan node types that read enrichq.queue, and the indexes they use."""
    scans = [
        n for n in walk(plan) if n["Node Type"] in SCAN_TYPES and n.get("Relation Name") == "queue"
    ]
    used = {n["Index Name"] for n in scans if "Index Name" in n}
    for heap in (n for n in scans if n["Node Type"] == "Bitmap Heap Scan"):
        used |= {n["Index Name"] for n in walk(heap) if n["Node Type"] == "Bitmap Index Scan"}
    return [n["Node Type"] for n in scans], used


CRITERIA = [
    {"all_rows": True},
    {"tenant": "acme"},
    {"kind": "refresh"},
    {"keys": ["Q-3", "L-7", "H-9"]},
    {"ids": [5, 200_100, 200_350]},
    {"older_than": "2h"},
    {"reason": "updated", "tenant": "globex", "older_than": "30m"},
]


FIRST_PAGE = {"after_kind": None, "after_key": None, "after_id": None, "page_size": PAGE}
OPEN_PAGES = ("controls_page_queued", "controls_page_leased")


@pytest.mark.parametrize("name", OPEN_PAGES)
@pytest.mark.parametrize("criteria", CRITERIA, ids=json.dumps)
def test_selecting_open_rows_reads_only_the_open_row_indexes(
    engine: sa.Engine, criteria: dict[str, Any], name: str
) -> None:
    flt = Filter.build(Scope.OPEN, **criteria)
    with engine.connect() as conn:
        types, used = queue_reads(plan_of(conn, name, {**flt.params(), **FIRST_PAGE, "now": None}))
    assert "Seq Scan" not in types
    allowed = OPEN_INDEXES | ({PRIMARY_KEY} if flt.ids else set())
    assert used, "no index read"
    assert used <= allowed, f"reads history through {used - allowed}"


DEAD_CRITERIA = [
    {"all_rows": True},
    {"reason": "superseded"},
    {"tenant": "acme"},
    {"older_than": "1d"},
    {"reason": "attempts_exhausted", "older_than": "7d"},
    {"keys": ["H-4", "H-9"]},
    {"ids": [4, 9, 14]},
]


@pytest.mark.parametrize("criteria", DEAD_CRITERIA, ids=json.dumps)
def test_selecting_dead_letters_reads_only_the_dead_letter_index(
    engine: sa.Engine, criteria: dict[str, Any]
) -> None:
    flt = Filter.build(Scope.DEAD, **criteria)
    with engine.connect() as conn:
        types, used = queue_reads(
            plan_of(conn, "controls_page_dead", {**flt.params(), **FIRST_PAGE, "now": None})
        )
    assert "Seq Scan" not in types
    allowed = DEAD_INDEXES | ({PRIMARY_KEY} if flt.ids else set())
    assert used, "no index read"
    assert used <= allowed, f"reads history through {used - allowed}"


def rows_read(engine: sa.Engine, sql: str, params: dict[str, Any]) -> float:
    """Rows of enrichq.queue that `sql` reads (kept or filtered away), run under EXPLAIN
    ANALYZE and rolled back."""
    with engine.connect() as conn, conn.begin() as tx:
        plan = explain(conn, sql, params, analyze=True)
        tx.rollback()
    return work(plan, lambda name: True)[0]


@pytest.mark.parametrize("verb", ["redrive", "discard"])
def test_the_dlq_verbs_by_key_read_that_tickets_dead_letters_only(
    engine: sa.Engine, verb: str
) -> None:
    flt = Filter.build(Scope.DEAD, keys=["H-4", "H-9"])
    read = rows_read(
        engine,
        controls.sql()["controls_page_dead"].sql,
        {**flt.params(), **FIRST_PAGE, "now": None},
    )
    assert read <= 10, f"{read} rows read for two tickets' dead letters"


@pytest.mark.parametrize(
    ("name", "scope", "criteria"),
    [
        ("controls_page_dead", Scope.DEAD, {"all_rows": True}),
        ("controls_page_dead", Scope.DEAD, {"reason": "superseded"}),
        ("controls_page_queued", Scope.OPEN, {"all_rows": True}),
    ],
)
def test_a_page_of_a_selection_reads_about_a_page_however_many_match(
    engine: sa.Engine, name: str, scope: Scope, criteria: dict[str, Any]
) -> None:
    """A selection is read in pages, each one statement that reads a page of rows (and
    those its filter skips), so no statement grows with the matches: one statement over
    every match would outlast the statement timeout past a few million of them."""
    flt = Filter.build(scope, **criteria)
    page = 100
    read = rows_read(
        engine,
        controls.sql()[name].sql,
        {**flt.params(), **FIRST_PAGE, "page_size": page, "now": None},
    )
    matches = DEAD_LETTERS if scope is Scope.DEAD else 300
    assert read <= 2 * page + 1 < matches, f"{read} rows read for a page of {page}"


def test_dlq_list_reads_a_page_of_dead_letters_not_the_history(engine: sa.Engine) -> None:
    """The newest dead letters are older than 100,000 done rows: walking ids down from the
    newest reads them all before the first dead letter."""
    from enrichq_service.controls.actions import sql as controls_sql

    limit = 50
    read = rows_read(
        engine,
        controls_sql()["dlq_list"].sql,
        {"limit": limit, "reasons": [r.value for r in DeadReason]},
    )
    assert read <= 5 * limit, f"{read} rows read to list {limit} dead letters"
    with engine.connect() as conn:
        listed = dlq.list_dead(conn, limit=limit)
        newest = conn.execute(
            sa.text(
                "SELECT id FROM enrichq.queue WHERE state = 'dead_letter' ORDER BY id DESC LIMIT 50"
            )
        ).scalars()
        assert [d.id for d in listed] == list(newest)


def test_the_terminal_count_reads_the_finished_row_indexes_not_the_table(
    engine: sa.Engine,
) -> None:
    """What `counts.run_once` sends, replayed with the count under EXPLAIN ANALYZE: index-only
    over the two finished-row indexes, though nearly every row of this table is terminal."""
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, *args: Any) -> None:
        sent.append((statement, params))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        counts.run_once(engine, statement_timeout_seconds=30)
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    count_sql = counts_statement()
    [at] = [i for i, (statement, _) in enumerate(sent) if "queue_counts" in statement]
    with engine.connect() as conn, conn.begin() as tx:
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]  # psycopg
        for statement, params in sent[:at]:
            cursor.execute(statement, params)
        plan = explain(conn, count_sql, {"now": None}, analyze=True)
        tx.rollback()
    scans = scans_of(plan, "queue")
    assert {n["Node Type"] for n in scans} == {"Index Only Scan"}, [n["Node Type"] for n in scans]
    assert {n["Index Name"] for n in scans} == {"queue_finished_idx", "queue_dead_finished_idx"}


def counts_statement() -> str:
    from enrichq_sweeper.common import sql as sweeper_sql

    return sweeper_sql()["counts_refresh"].sql


def batch_ids(engine: sa.Engine, scope: Scope) -> tuple[list[int], list[int]]:
    flt = Filter.build(scope, all_rows=True)
    with engine.connect() as conn:
        selection = controls.select(conn, flt)
    n = 1000 if scope is Scope.DEAD else 500
    return list(selection.ids[:n]), list(selection.winners[:n])


@pytest.mark.parametrize(
    ("name", "scope"),
    [
        ("controls_cancel_batch", Scope.OPEN),
        ("controls_discard_batch", Scope.DEAD),
        ("controls_redrive_batch", Scope.DEAD),
        ("controls_sample", Scope.OPEN),
    ],
)
def test_a_batch_finds_its_rows_by_id(engine: sa.Engine, name: str, scope: Scope) -> None:
    ids, winners = batch_ids(engine, scope)
    flt = Filter.build(scope, tenant="acme")
    params = {
        **flt.params(),
        "batch_ids": ids,
        "winners": winners,
        "channel": NOTIFY_CHANNEL,
        "now": None,
        "started": None,
    }
    if name == "controls_sample":
        params = {"ids": ids[:10]}
    with engine.connect() as conn:
        types, used = queue_reads(plan_of(conn, name, params))
    assert "Seq Scan" not in types
    allowed = {PRIMARY_KEY} | (OPEN_INDEXES if scope is Scope.OPEN else DEAD_INDEXES)
    if name == "controls_redrive_batch":
        allowed.add("queue_queued_key_uq")
    assert PRIMARY_KEY in used
    assert used <= allowed, f"unexpected indexes {used - allowed}"
