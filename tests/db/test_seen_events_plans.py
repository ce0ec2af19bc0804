"""The dedupe table's prune reads only the ids it deletes, however many are kept (EXPLAIN).

200,000 event ids, half past the window: one page of the prune walks
seen_events_seen_at_idx from its oldest end and stops after the page, and deletes by
primary key, never scanning the table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from tests.support.pg import Databases
from tests.support.plans import walk

from enrichq_schema.db import create_engine
from enrichq_schema.queries import load

ROWS = 200_000
PAGE = 1000
PRUNE = load("enrichq_sweeper", "sql/events.sql")["retention_prune_seen_events"].sql


@pytest.fixture(scope="module")
def engine(databases: Databases) -> Iterator[sa.Engine]:
    url = databases.clone("seen_plans")
    eng = create_engine(url, pool_size=1)
    try:
        with eng.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO enrichq.seen_events (event_id, seen_at, queue_id)"
                    " SELECT 'evt-' || g, now() - make_interval(mins => g % 2880), g"
                    " FROM generate_series(1, :n) AS g"
                ),
                {"n": ROWS},
            )
        with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE enrichq.seen_events"))
        yield eng
    finally:
        eng.dispose()
        databases.drop(url)


def test_a_prune_page_reads_the_seen_at_index_and_only_one_page(engine: sa.Engine) -> None:
    with engine.connect() as conn, conn.begin() as tx:
        cutoff = conn.execute(sa.text("SELECT now() - interval '24 hours'")).scalar_one()
        raw = conn.execute(
            sa.text("EXPLAIN (ANALYZE, FORMAT JSON) " + PRUNE),
            {"cutoff": cutoff, "batch_size": PAGE},
        ).scalar_one()
        tx.rollback()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    scans = [
        n
        for n in walk(plan)
        if n.get("Relation Name") == "seen_events" and n["Node Type"] != "ModifyTable"
    ]
    assert not [n for n in scans if n["Node Type"] == "Seq Scan"], scans
    index_scans = [n for n in scans if n.get("Index Name") == "seen_events_seen_at_idx"]
    assert index_scans, [n["Node Type"] for n in scans]
    # the index walk stops after one page (plus rows skipped or re-checked), not 100,000
    assert sum(n["Actual Rows"] * n["Actual Loops"] for n in index_scans) <= 2 * PAGE
    # the delete finds its rows by primary key
    assert {n["Node Type"] for n in scans} <= {"Index Scan", "Index Only Scan", "Bitmap Heap Scan"}
    assert "seen_events_pkey" in {n.get("Index Name") for n in scans}
