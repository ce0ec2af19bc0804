"""Parity's statements cost one probe per ticket and table, and one pass per table.

The world of ``bench_parity`` at 3,000 tickets (legacy and shadow orders, drift, extras,
tickets legacy or enrichq lost), ANALYZEd. Each statement runs under EXPLAIN ANALYZE and its
plan is read for what the benchmark found costly: the day query probing a ticket's
enrichment row three times and hashing the whole legacy table for every day, and the
coverage query hashing every legacy ticket id before looking for the few the mirror lacks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from tests.bench.bench_parity import DAYS, INDEXES, SEED, SETUP, TENANTS
from tests.support.plans import walk

from enrichq_schema.db import create_engine
from enrichq_schema.identifiers import render

TICKETS = 3000
END = datetime(2026, 6, 1, tzinfo=UTC)
RELATIONS = {
    "tickets": "helpdesk.tickets",
    "legacy": "legacy.ticket_orders",
    "orders": "warehouse.orders",
    "customers": "warehouse.customers",
}


@pytest.fixture(scope="module")
def world(databases: Any) -> Iterator[sa.Engine]:
    url = databases.clone("parity_plans")
    engine = create_engine(url, pool_size=1)
    params = {"n": TICKETS, "tenants": TENANTS, "end": END, "span": DAYS * 86400.0}
    with engine.begin() as conn:
        conn.exec_driver_sql(SETUP)
        for statement in SEED:
            conn.execute(sa.text(statement), params)
        conn.exec_driver_sql(INDEXES)
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
    yield engine
    engine.dispose()
    databases.drop(url)


def _explain(conn: sa.Connection, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    """The plan of `sql` run under EXPLAIN ANALYZE, VERBOSE (so scans name their schema)."""
    raw = conn.execute(sa.text(f"EXPLAIN (ANALYZE, VERBOSE, FORMAT JSON) {sql}"), params)
    plan: dict[str, Any] = raw.scalar_one()[0]["Plan"]
    return plan


def _queries() -> Any:
    from enrichq_parity.parity import _queries as queries

    return queries()


def _on(node: dict[str, Any], schema: str, table: str) -> bool:
    return node.get("Schema") == schema and node.get("Relation Name") == table


def _loops(nodes: list[dict[str, Any]], schema: str, table: str) -> int:
    """How many times the plan read the table (its scans times their loops)."""
    return sum(int(n["Actual Loops"]) for n in nodes if _on(n, schema, table))


def _day_nodes(engine: sa.Engine, start: datetime, end: datetime) -> list[dict[str, Any]]:
    statement = render(_queries()["parity_day"], **RELATIONS)
    params = {
        "day_start": start,
        "day_end": end,
        "young_after": END + timedelta(days=1),
        "sample_size": 20,
        "rules": json.dumps([]),
        "rule_sample": 20,
        "export": False,
    }
    with engine.connect() as conn:
        conn.execute(_queries()("parity_day_settings"))
        plan = _explain(conn, statement.text, params)
        conn.rollback()
    return list(walk(plan))


def _count(engine: sa.Engine, sql: str, **params: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(sql), params).scalar_one())


def test_the_day_query_probes_each_ticket_once_per_table(world: sa.Engine) -> None:
    """Legacy and shadow orders: one index probe per ticket (and one more per differing
    ticket); the enrichment row only for a ticket without legacy orders (and a differing
    one); never a scan of a whole table."""
    start, end = END - timedelta(days=3), END - timedelta(days=2)
    nodes = _day_nodes(world, start, end)
    window = "created_at >= :s AND created_at < :e"
    tickets = _count(world, f"SELECT count(*) FROM helpdesk.tickets WHERE {window}", s=start, e=end)
    no_legacy = _count(
        world,
        f"SELECT count(*) FROM helpdesk.tickets AS t WHERE {window} AND NOT EXISTS "
        "(SELECT 1 FROM legacy.ticket_orders AS l WHERE l.ticket_id = t.id)",
        s=start,
        e=end,
    )
    differing = sum(
        int(n["Actual Rows"]) for n in nodes if n.get("Subplan Name") == "CTE differing"
    )
    assert tickets > 300
    assert 0 < no_legacy < tickets // 10
    assert 0 < differing < tickets // 10
    tables = {
        ("legacy", "ticket_orders"),
        ("enrichq", "ticket_orders"),
        ("enrichq", "ticket_enrichments"),
    }
    scanned = [
        n for n in nodes
        if "Seq Scan" in n["Node Type"] and (n.get("Schema"), n.get("Relation Name")) in tables
    ]  # fmt: skip
    assert not scanned, [n["Relation Name"] for n in scanned]
    assert _loops(nodes, "legacy", "ticket_orders") <= tickets + 2 * differing
    assert _loops(nodes, "enrichq", "ticket_enrichments") <= no_legacy + differing


def test_coverage_hashes_no_legacy_ticket_id_the_mirror_has(world: sa.Engine) -> None:
    """The legacy tickets the mirror lacks are found by an anti join over the legacy rows;
    only what it leaves is made distinct. Each shadow table is read once."""
    statement = render(
        _queries()["parity_coverage"], tickets=RELATIONS["tickets"], legacy=RELATIONS["legacy"]
    )
    with world.connect() as conn:
        plan = _explain(conn, statement.text, {"young_after": END, "legacy_only": True})
        conn.rollback()
    nodes = list(walk(plan))
    legacy_rows = _count(world, "SELECT count(*) FROM legacy.ticket_orders")
    for node in nodes:
        keys = " ".join(node.get("Group Key", ()))
        if node["Node Type"] in {"Aggregate", "Unique"} and "ticket_id" in keys:
            fed = sum(int(c["Actual Rows"]) * int(c["Actual Loops"]) for c in node["Plans"])
            assert fed < legacy_rows, (node["Group Key"], fed)
    for table in ("ticket_orders", "ticket_enrichments"):
        reads = [n for n in nodes if _on(n, "enrichq", table)]
        assert len([n for n in reads if "Seq Scan" in n["Node Type"]]) <= 1, table
