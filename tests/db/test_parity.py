"""Parity against real Postgres: every class, exclusions, drift, samples, outputs, CLI exits."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY
from tests.conftest import make_settings
from tests.support.pg import Databases

from enrichq_parity import names
from enrichq_parity.model import TicketClass, decide, pick_sample
from enrichq_parity.parity import (
    ParityInputError,
    ParityReport,
    day_windows,
    export_latest,
    run_parity,
    run_scheduled,
)
from enrichq_schema import tables
from enrichq_schema.db import create_engine
from enrichq_service.cli import main
from enrichq_service.settings import Settings

NOW = datetime(2024, 3, 10, 12, 0, tzinfo=UTC)
DAY1 = datetime(2024, 3, 4, 9, 0, tzinfo=UTC)
DAY2 = datetime(2024, 3, 5, 9, 0, tzinfo=UTC)

SOURCES_DDL = """
CREATE SCHEMA IF NOT EXISTS helpdesk;
CREATE TABLE IF NOT EXISTS helpdesk.tickets (
    id text PRIMARY KEY, requester_email text, tenant text,
    created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL);
CREATE INDEX IF NOT EXISTS tickets_created_at_idx ON helpdesk.tickets (created_at);
CREATE SCHEMA IF NOT EXISTS warehouse;
CREATE TABLE IF NOT EXISTS warehouse.customers (customer_id text PRIMARY KEY, email text);
CREATE TABLE IF NOT EXISTS warehouse.orders (
    order_id text PRIMARY KEY, customer_id text, placed_at timestamptz, total numeric);
CREATE SCHEMA IF NOT EXISTS legacy;
CREATE TABLE IF NOT EXISTS legacy.ticket_orders (
    ticket_id text, order_id text, looked_up_at timestamptz);
CREATE INDEX IF NOT EXISTS legacy_ticket_orders_ticket_id_idx ON legacy.ticket_orders (ticket_id);
"""


def create_sources(conn: sa.Connection, *, legacy: bool = True) -> None:
    """The help desk mirror, the warehouse and (unless told not to) the legacy output."""
    ddl = SOURCES_DDL if legacy else SOURCES_DDL.split("CREATE SCHEMA IF NOT EXISTS legacy", 1)[0]
    conn.exec_driver_sql(ddl)


def add_ticket(
    conn: sa.Connection,
    ticket_id: str,
    *,
    created_at: datetime,
    tenant: str | None = "acme",
    legacy: Sequence[str] = (),
    looked_up_at: datetime | None = None,
    shadow: Sequence[str] | None = None,
    placed_at: Mapping[str, datetime | None] | None = None,
    warehouse_placed_at: Mapping[str, datetime] | None = None,
    legacy_table: str = "legacy.ticket_orders",
) -> None:
    """One ticket with its legacy rows and shadow result (shadow=None: never enriched).

    Orders are placed a day before the ticket unless `placed_at` (the shadow row's) or
    `warehouse_placed_at` say otherwise; the legacy flow looked up an hour after creation.
    """
    looked = looked_up_at or created_at + timedelta(hours=1)
    conn.execute(
        sa.text(
            "INSERT INTO helpdesk.tickets VALUES (:id, :email, :tenant, :created, :created)"
        ),
        {"id": ticket_id, "email": f"{ticket_id}@example.com", "tenant": tenant,
         "created": created_at},
    )  # fmt: skip
    for order_id in legacy:
        conn.execute(
            sa.text(f"INSERT INTO {legacy_table} VALUES (:t, :o, :at)"),
            {"t": ticket_id, "o": order_id, "at": looked},
        )
    default_placed = created_at - timedelta(days=1)
    every = set(legacy) | set(shadow or ())
    for order_id in sorted(every):
        when = (warehouse_placed_at or {}).get(order_id, default_placed)
        conn.execute(
            sa.text(
                "INSERT INTO warehouse.orders VALUES (:o, 'C-1', :at, 10) "
                "ON CONFLICT (order_id) DO NOTHING"
            ),
            {"o": order_id, "at": when},
        )
    if shadow is None:
        return
    enriched = looked + timedelta(minutes=30)
    for order_id in shadow:
        shadow_placed = (placed_at or {}).get(order_id, default_placed)
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_orders (ticket_id, order_id, customer_id, placed_at,"
                " total, looked_up_at, queue_id) VALUES (:t, :o, 'C-1', :placed, 10, :at, 1)"
            ),
            {"t": ticket_id, "o": order_id, "placed": shadow_placed, "at": enriched},
        )
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.ticket_enrichments (ticket_id, enriched_at, order_count,"
            " queue_id) VALUES (:t, :at, :n, 1)"
        ),
        {"t": ticket_id, "at": enriched, "n": len(shadow)},
    )


def add_queue_row(conn: sa.Connection, key: str, state: str) -> None:
    """An open queue row (queued or leased) for ticket `key`."""
    leased = state == "leased"
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.queue (kind, key, reason, state, max_attempts, attempts,"
            " lease_owner, lease_expires_at) VALUES ('enrich', :key, 'updated', :state, 5,"
            " :attempts, :owner, CASE WHEN :leased THEN now() + interval '1 minute' END)"
        ),
        {"key": key, "state": state, "attempts": 1 if leased else 0,
         "owner": "w-1" if leased else None, "leased": leased},
    )  # fmt: skip


def seed_every_class(conn: sa.Connection) -> None:
    """Known differences of every class over two days, plus exclusions and an outsider."""
    create_sources(conn)
    lookup = DAY2 + timedelta(hours=1)
    # day 1 (2024-03-04)
    add_ticket(conn, "T-01-exact", created_at=DAY1, legacy=["A1", "A2"], shadow=["A1", "A2"])
    add_ticket(conn, "T-02-empty", created_at=DAY1, legacy=[], shadow=[])
    add_ticket(
        conn, "T-03-partial", created_at=DAY1, tenant="globex",
        legacy=["P1", "P2", "P3"], shadow=["P1"],
    )  # fmt: skip
    add_ticket(conn, "T-04-lost", created_at=DAY1, tenant="globex", legacy=["S1", "S2"])
    # day 2 (2024-03-05)
    add_ticket(
        conn, "T-05-drift", created_at=DAY2, legacy=["D1"], shadow=["D1", "D2"],
        looked_up_at=lookup, placed_at={"D2": lookup + timedelta(minutes=5)},
    )  # fmt: skip
    add_ticket(
        conn, "T-06-partial-extra", created_at=DAY2, legacy=["Q1", "Q2"], shadow=["Q1", "Q9"],
        looked_up_at=lookup,
    )  # fmt: skip
    add_ticket(conn, "T-07-legacy-missing", created_at=DAY2, tenant=None, shadow=["L1"])
    add_ticket(conn, "T-08-extra", created_at=DAY2, legacy=["E1"], shadow=["E1", "E2"])
    # drift known only to the warehouse: the shadow row has no placed_at
    add_ticket(
        conn, "T-09-drift-warehouse", created_at=DAY2, legacy=["W1"], shadow=["W1", "W2"],
        looked_up_at=lookup, placed_at={"W2": None},
        warehouse_placed_at={"W2": lookup + timedelta(hours=2)},
    )  # fmt: skip
    # the legacy flow wrote X1 twice: still one order
    add_ticket(conn, "T-10-dup", created_at=DAY2, legacy=["X1", "X1"], shadow=["X1"])
    # excluded: too young, and open queue rows (queued, leased)
    add_ticket(conn, "T-11-young", created_at=NOW - timedelta(minutes=30), legacy=["Y1"], shadow=[])
    add_ticket(conn, "T-12-queued", created_at=DAY2, legacy=["Z1"], shadow=[])
    add_queue_row(conn, "T-12-queued", "queued")
    add_ticket(conn, "T-13-leased", created_at=DAY2, legacy=["Z2"])
    add_queue_row(conn, "T-13-leased", "leased")
    # outside the window: never counted
    add_ticket(conn, "T-99-old", created_at=datetime(2024, 2, 1, tzinfo=UTC), legacy=["O1"])


def parity_settings(url: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "delay_created_seconds": 600,
        "parity_grace_seconds": 3600,
        "parity_min_order_coverage": 0.995,
        "parity_min_ticket_match_rate": 0.99,
    }
    values.update(overrides)
    return make_settings(url, **values)


def run(
    engine: sa.Engine,
    settings: Settings,
    since: datetime = datetime(2024, 3, 1, tzinfo=UTC),
    until: datetime | None = None,
    *,
    now: datetime = NOW,
    read_engine: sa.Engine | None = None,
    progress: list[tuple[int, int]] | None = None,
) -> ParityReport:
    calls = progress if progress is not None else []
    return run_parity(
        read_engine or engine,
        engine,
        settings,
        since=since,
        until=until,
        now=now,
        progress=lambda done, total: calls.append((done, total)),
    )


def seed(engine: sa.Engine, builder: object) -> None:
    with engine.begin() as conn:
        builder(conn)  # type: ignore[operator]


# -- the classes, exactly ------------------------------------------------------------------


@pytest.fixture
def every_class(db_engine: sa.Engine, db_url: str) -> tuple[sa.Engine, Settings]:
    seed(db_engine, seed_every_class)
    return db_engine, parity_settings(db_url)


def test_every_class_is_counted_exactly(every_class: tuple[sa.Engine, Settings]) -> None:
    engine, settings = every_class
    report = run(engine, settings)
    t = report.total
    assert {c.value: t.count(c) for c in TicketClass} == {
        "exact": 3,
        "drift_only": 2,
        "partial": 2,
        "shadow_missing": 1,
        "legacy_missing": 1,
        "extra_only": 1,
    }
    assert (t.compared, t.too_young, t.open_queue_rows, t.excluded) == (10, 1, 2, 3)
    assert (t.legacy_orders, t.matched_orders, t.missing_orders) == (13, 8, 5)
    assert (t.extra_orders, t.drift_orders) == (3, 2)
    assert t.order_coverage == pytest.approx(8 / 13)
    assert t.ticket_match_rate == pytest.approx(5 / 10)
    assert not report.passed
    assert "order coverage 61.54% is below 99.50%" in report.verdict.reason
    assert "ticket match rate 50.00% is below 99.00%" in report.verdict.reason


def test_per_day_and_per_tenant(every_class: tuple[sa.Engine, Settings]) -> None:
    engine, settings = every_class
    progress: list[tuple[int, int]] = []
    report = run(engine, settings, progress=progress)
    # 2024-03-01 .. 2024-03-10 12:00 (now): ten day windows, the last one cut at noon
    assert [d.day.isoformat() for d in report.days][:5] == [
        "2024-03-01", "2024-03-02", "2024-03-03", "2024-03-04", "2024-03-05",
    ]  # fmt: skip
    assert len(report.days) == 10
    assert report.days[-1].until == NOW
    assert progress == [(i, 10) for i in range(1, 11)]
    by_day = {d.day.isoformat(): d.tally for d in report.days}
    day1, day2 = by_day["2024-03-04"], by_day["2024-03-05"]
    assert (day1.exact, day1.partial, day1.shadow_missing, day1.compared) == (2, 1, 1, 4)
    assert day1.order_coverage == pytest.approx(3 / 7)
    assert (day2.exact, day2.drift_only, day2.partial, day2.legacy_missing) == (1, 2, 1, 1)
    assert (day2.extra_only, day2.open_queue_rows, day2.compared) == (1, 2, 6)
    assert by_day["2024-03-10"].too_young == 1
    assert by_day["2024-03-02"].compared == 0
    assert by_day["2024-03-02"].order_coverage is None
    tenants = {tr.tenant: tr.tally for tr in report.tenants}
    assert set(tenants) == {"", "acme", "globex"}
    assert (tenants["globex"].partial, tenants["globex"].shadow_missing) == (1, 1)
    assert tenants["globex"].order_coverage == pytest.approx(1 / 5)
    assert tenants[""].legacy_missing == 1
    assert tenants["acme"].compared == 7


@pytest.mark.parametrize("concurrency", [1, 4])
def test_days_compared_at_once_give_the_same_report(
    every_class: tuple[sa.Engine, Settings], concurrency: int
) -> None:
    """Days run on several connections at once, but are added up in day order: the report
    (days, tenants, samples) and the progress calls do not depend on which day finished
    first. The default (2) is what every other test here runs with."""
    engine, settings = every_class
    reference = run(engine, settings)
    progress: list[tuple[int, int]] = []
    other = run(
        engine, settings.model_copy(update={"parity_concurrency": concurrency}), progress=progress
    )
    assert progress == [(i, 10) for i in range(1, 11)]
    assert other.days == reference.days
    assert other.tenants == reference.tenants
    assert other.sample == reference.sample
    assert other.drift_sample == reference.drift_sample
    assert other.total == reference.total


def test_sample_shows_each_mismatch_with_its_diff(every_class: tuple[sa.Engine, Settings]) -> None:
    engine, settings = every_class
    report = run(engine, settings)
    # taken in turn from each class: partial, shadow missing, legacy missing, extra, partial
    got = [(m.ticket_id, m.ticket_class.value, m.missing, m.extra, m.drift) for m in report.sample]
    assert got == [
        ("T-03-partial", "partial", ("P2", "P3"), (), ()),
        ("T-04-lost", "shadow_missing", ("S1", "S2"), (), ()),
        ("T-07-legacy-missing", "legacy_missing", (), ("L1",), ()),
        ("T-08-extra", "extra_only", (), ("E2",), ()),
        ("T-06-partial-extra", "partial", ("Q2",), ("Q9",), ()),
    ]
    lost = report.sample[1]
    assert (lost.tenant, lost.enriched_at, lost.legacy_orders, lost.matched_orders) == (
        "globex", None, 2, 0,
    )  # fmt: skip
    assert [(m.ticket_id, m.drift, m.extra) for m in report.drift_sample] == [
        ("T-05-drift", ("D2",), ()),
        ("T-09-drift-warehouse", ("W2",), ()),
    ]


def test_run_is_recorded(every_class: tuple[sa.Engine, Settings]) -> None:
    engine, settings = every_class
    report = run(engine, settings)
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT * FROM enrichq.parity_runs WHERE id = :id"), {"id": report.run_id}
        ).one()
        log = conn.execute(sa.text("SELECT * FROM enrichq.runs WHERE component = 'parity'")).one()
    assert row.finished_at == NOW
    assert (row.window_since, row.window_until) == (datetime(2024, 3, 1, tzinfo=UTC), NOW)
    assert (row.tickets_compared, row.tickets_excluded, row.exact_matches) == (10, 3, 3)
    assert row.order_coverage == pytest.approx(8 / 13)
    assert row.ticket_match_rate == pytest.approx(0.5)
    assert (row.min_order_coverage, row.min_ticket_match_rate) == (0.995, 0.99)
    assert row.passed is False
    assert row.report == json.loads(json.dumps(report.as_dict()))
    assert row.report["total"]["classes"]["partial"] == 2
    assert (log.stop_reason, log.error) == ("no_work", None)
    assert log.counts["parity_run_id"] == report.run_id


def test_gauges_show_the_latest_run(every_class: tuple[sa.Engine, Settings]) -> None:
    engine, settings = every_class
    run(engine, settings)
    with engine.connect() as conn:
        export_latest(conn)

    def gauge(name: str) -> float | None:
        return REGISTRY.get_sample_value(name)

    assert gauge("enrichq_parity_order_coverage") == pytest.approx(8 / 13)
    assert gauge("enrichq_parity_ticket_match_rate") == pytest.approx(0.5)
    assert gauge("enrichq_parity_pass") == 0
    assert gauge("enrichq_parity_last_run_timestamp_seconds") == NOW.timestamp()


def test_a_matching_world_passes(db_engine: sa.Engine, db_url: str) -> None:
    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        for i in range(40):
            orders = [f"O-{i}-{k}" for k in range(i % 4)]
            add_ticket(conn, f"T-{i:03d}", created_at=DAY1, legacy=orders, shadow=orders)
        lookup = DAY1 + timedelta(hours=1)
        add_ticket(
            conn, "T-drift", created_at=DAY1, legacy=["M1"], shadow=["M1", "M2"],
            looked_up_at=lookup, placed_at={"M2": lookup + timedelta(seconds=1)},
        )  # fmt: skip

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url))
    assert report.passed
    assert (report.total.exact, report.total.drift_only, report.total.mismatched) == (40, 1, 0)
    assert report.total.order_coverage == 1.0
    assert report.sample == ()
    assert report.verdict.reason.startswith("order coverage 100.00% ≥ 99.50%")


def test_sample_is_capped_and_spread_over_classes(db_engine: sa.Engine, db_url: str) -> None:
    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        # 60 partial and 3 shadow-missing tickets, in set-based inserts
        conn.execute(
            sa.text(
                "INSERT INTO helpdesk.tickets SELECT 'P-' || lpad(CAST(g AS text), 3, '0'), NULL,"
                " 'acme', :at, :at FROM generate_series(1, 63) AS g"
            ),
            {"at": DAY1},
        )
        conn.execute(
            sa.text(
                "INSERT INTO legacy.ticket_orders SELECT 'P-' || lpad(CAST(g AS text), 3, '0'),"
                " 'O-' || g || '-' || k, :at FROM generate_series(1, 63) AS g,"
                " generate_series(1, 2) AS k"
            ),
            {"at": DAY1 + timedelta(hours=1)},
        )
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_orders SELECT 'P-' || lpad(CAST(g AS text), 3, '0'),"
                " 'O-' || g || '-1', 'C', :at, 1, :at, 1 FROM generate_series(1, 60) AS g"
            ),
            {"at": DAY1 - timedelta(days=1)},
        )
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_enrichments"
                " SELECT 'P-' || lpad(CAST(g AS text), 3, '0'), :at, 1, 1"
                " FROM generate_series(1, 60) AS g"
            ),
            {"at": DAY1 + timedelta(hours=2)},
        )

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url))
    assert (report.total.partial, report.total.shadow_missing) == (60, 3)
    assert len(report.sample) == 50
    classes = [m.ticket_class for m in report.sample]
    assert classes.count(TicketClass.SHADOW_MISSING) == 3
    assert classes[:2] == [TicketClass.PARTIAL, TicketClass.SHADOW_MISSING]
    partial_ids = [m.ticket_id for m in report.sample if m.ticket_class is TicketClass.PARTIAL]
    assert partial_ids == [f"P-{g:03d}" for g in range(1, 48)]


# -- empty and young windows ----------------------------------------------------------------


def test_an_empty_window_is_a_clear_failure(db_engine: sa.Engine, db_url: str) -> None:
    seed(db_engine, create_sources)
    report = run(db_engine, parity_settings(db_url))
    assert report.total.compared == 0
    assert report.total.order_coverage is None
    assert not report.passed
    assert report.verdict.reason == "no tickets compared in the window: nothing to judge"
    with db_engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM enrichq.parity_runs")).one()
    assert (row.passed, row.order_coverage, row.finished_at) == (False, None, NOW)


def test_a_window_of_young_tickets_says_why(db_engine: sa.Engine, db_url: str) -> None:
    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        for i in range(3):
            add_ticket(
                conn, f"Y-{i}", created_at=NOW - timedelta(minutes=10 * i + 1),
                legacy=["A"], shadow=["A"],
            )  # fmt: skip

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url), since=NOW - timedelta(hours=1))
    assert (report.total.compared, report.total.too_young) == (0, 3)
    assert not report.passed
    assert report.verdict.reason == (
        "no tickets compared in the window (3 excluded: too young 3, open queue rows 0): "
        "nothing to judge"
    )


def test_only_legacy_less_tickets_leave_coverage_undefined(
    db_engine: sa.Engine, db_url: str
) -> None:
    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        add_ticket(conn, "T-1", created_at=DAY1, shadow=[])

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url))
    assert (report.total.compared, report.total.exact) == (1, 1)
    assert report.total.order_coverage is None
    assert not report.passed
    assert "order coverage is undefined" in report.verdict.reason


# -- inputs ---------------------------------------------------------------------------------


def test_missing_legacy_table_is_bad_input_and_writes_nothing(
    db_engine: sa.Engine, db_url: str
) -> None:
    seed(db_engine, lambda c: create_sources(c, legacy=False))
    with pytest.raises(ParityInputError, match=r"legacy table legacy\.ticket_orders"):
        run(db_engine, parity_settings(db_url))
    with db_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.runs")).scalar() == 0


def test_unindexed_legacy_table_is_bad_input(db_engine: sa.Engine, db_url: str) -> None:
    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        conn.exec_driver_sql("DROP INDEX legacy.legacy_ticket_orders_ticket_id_idx")

    seed(db_engine, build)
    with pytest.raises(ParityInputError, match=r"has no index on ticket_id.*CREATE INDEX"):
        run(db_engine, parity_settings(db_url))


def test_reversed_window_is_bad_input(db_engine: sa.Engine, db_url: str) -> None:
    seed(db_engine, create_sources)
    with pytest.raises(ParityInputError, match="the window is empty"):
        run(db_engine, parity_settings(db_url), since=NOW + timedelta(days=1))


def test_configured_names_are_quoted(db_engine: sa.Engine, db_url: str) -> None:
    dialect = db_engine.dialect
    assert names.qualified(dialect, "legacy.ticket_orders") == "legacy.ticket_orders"
    assert names.qualified(dialect, "legacy.order") == 'legacy."order"'
    assert names.qualified(dialect, "Legacy.Orders") == '"Legacy"."Orders"'

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        conn.exec_driver_sql(
            'CREATE TABLE legacy."order" (ticket_id text, order_id text, looked_up_at timestamptz);'
            ' CREATE INDEX ON legacy."order" (ticket_id)'
        )
        add_ticket(
            conn, "T-1", created_at=DAY1, legacy=["A"], shadow=["A"], legacy_table='legacy."order"'
        )

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url, legacy_table="legacy.order"))
    assert (report.total.exact, report.total.legacy_orders) == (1, 1)


def test_parity_reads_the_replica_and_writes_the_primary(
    db_engine: sa.Engine, db_url: str, databases: Databases
) -> None:
    replica_url = databases.clone("replica")
    replica = create_engine(replica_url, pool_size=1)
    try:
        seed(replica, seed_every_class)
        report = run(db_engine, parity_settings(db_url), read_engine=replica)
        assert report.total.compared == 10
        with db_engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 1
        with replica.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 0
    finally:
        replica.dispose()
        databases.drop(replica_url)


def test_open_queue_checks_use_the_partial_indexes(
    every_class: tuple[sa.Engine, Settings],
) -> None:
    """With sequential scans priced out, the queue is only reached through open-row indexes."""
    from enrichq_parity.parity import _queries

    engine, _ = every_class
    statement = names.render(
        _queries()["parity_day"],
        tickets="helpdesk.tickets",
        legacy="legacy.ticket_orders",
        orders="warehouse.orders",
    )
    with engine.connect() as conn:
        conn.execute(sa.text("SET enable_seqscan = off"))
        explain = sa.text("EXPLAIN (FORMAT JSON) " + statement.text)
        plan = conn.execute(
            explain, {"day_start": DAY1, "day_end": NOW, "young_after": NOW, "sample_size": 50}
        ).scalar_one()
        conn.rollback()
    nodes = list(_nodes(plan[0]["Plan"]))
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan" and n["Relation Name"] == "queue"]
    used = {str(n["Index Name"]) for n in nodes if str(n.get("Index Name", "")).startswith("queue")}
    open_row_indexes = {
        ix.name
        for ix in tables.queue.indexes
        if str(ix.dialect_options["postgresql"]["where"]) in {tables.QUEUED, tables.LEASED}
    }
    assert used <= open_row_indexes
    assert len(used) >= 2  # one per open state


def _nodes(node: Mapping[str, object]) -> Iterable[Mapping[str, object]]:
    yield node
    for child in node.get("Plans", []):  # type: ignore[attr-defined]
        yield from _nodes(child)


def test_day_windows_cut_at_utc_midnight() -> None:
    since = datetime(2024, 3, 1, 18, tzinfo=UTC)
    until = datetime(2024, 3, 3, 6, tzinfo=UTC)
    assert [(d.isoformat(), s.hour, e.hour) for d, s, e in day_windows(since, until)] == [
        ("2024-03-01", 18, 0), ("2024-03-02", 0, 0), ("2024-03-03", 0, 6),
    ]  # fmt: skip


def test_decide_and_pick_sample_are_pure() -> None:
    from enrichq_parity.model import Mismatch, Tally

    assert decide(
        Tally(exact=99, partial=1, legacy_orders=1000, matched_orders=995), 0.995, 0.99
    ).passed
    low = decide(Tally(exact=99, partial=1, legacy_orders=1000, matched_orders=994), 0.995, 0.99)
    assert (low.passed, low.reason) == (False, "order coverage 99.40% is below 99.50%")
    verdict = decide(Tally(exact=98, partial=2, legacy_orders=100, matched_orders=99), 0.99, 0.99)
    assert (verdict.passed, verdict.reason) == (
        False, "ticket match rate 98.00% is below 99.00%",
    )  # fmt: skip

    def m(i: int, c: TicketClass) -> Mismatch:
        return Mismatch(f"T{i}", "", c, NOW, None, None, 1, 0, (), (), ())

    by_class = {
        TicketClass.PARTIAL: [m(i, TicketClass.PARTIAL) for i in range(5)],
        TicketClass.EXTRA_ONLY: [m(9, TicketClass.EXTRA_ONLY)],
    }
    assert [x.ticket_id for x in pick_sample(by_class, limit=4)] == ["T0", "T9", "T1", "T2"]


def test_the_scheduled_run_records_and_exports(db_engine: sa.Engine, db_url: str) -> None:
    _cli_world(db_engine, mismatch=True)
    run_scheduled(make_settings(db_url, delay_created_seconds=600), db_url)
    with db_engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM enrichq.parity_runs")).one()
    assert (row.tickets_compared, row.passed) == (20, False)
    assert row.window_until - row.window_since == timedelta(days=7)
    assert REGISTRY.get_sample_value("enrichq_parity_pass") == 0
    assert REGISTRY.get_sample_value("enrichq_parity_order_coverage") == pytest.approx(40 / 60)


# -- outputs --------------------------------------------------------------------------------


def test_reports_are_written_and_escaped(db_engine: sa.Engine, db_url: str) -> None:
    from enrichq_parity.report import to_html, to_json

    def build(conn: sa.Connection) -> None:
        seed_every_class(conn)
        add_ticket(
            conn, "T-<script>alert(1)</script>", created_at=DAY1, tenant='<b>"evil"</b>',
            legacy=["<img src=x>"], shadow=[],
        )  # fmt: skip

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url))
    page = to_html(report)
    assert "<script>alert" not in page
    assert "T-&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;&quot;evil&quot;&lt;/b&gt;" in page
    assert "&lt;img src=x&gt;" in page
    assert "<svg" in page
    assert "FAIL" in page
    # self-contained: nothing fetched from anywhere
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page
    document = json.loads(to_json(report))
    assert document["total"]["classes"]["shadow_missing"] == 1
    assert document["sample"][0]["class"] == "partial"


# -- the command line -----------------------------------------------------------------------


def _cli_world(engine: sa.Engine, *, mismatch: bool) -> None:
    now = datetime.now(UTC)

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        for i in range(20):
            orders = [f"O-{i}-{k}" for k in range(3)]
            shadow = orders[:1] if mismatch and i % 2 else orders
            add_ticket(
                conn, f"T-{i}", created_at=now - timedelta(days=2, hours=i),
                legacy=orders, shadow=shadow,
            )  # fmt: skip

    seed(engine, build)


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, db_url: str) -> str:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    return db_url


def test_cli_exit_0_on_pass_with_reports(
    cli_env: str, db_engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_world(db_engine, mismatch=False)
    json_path, html_path = tmp_path / "parity.json", tmp_path / "parity.html"
    code = main(["parity", "--json", str(json_path), "--html", str(html_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "PASS" in out
    assert "100.00%" in out
    assert json.loads(json_path.read_text())["passed"] is True
    assert "PASS" in html_path.read_text()


def test_cli_exit_1_below_thresholds(
    cli_env: str, db_engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_world(db_engine, mismatch=True)
    assert main(["parity"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    assert "below" in out


def test_cli_exit_1_on_an_empty_window(
    cli_env: str, db_engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    seed(db_engine, create_sources)
    assert main(["parity", "--since", "2020-01-01", "--until", "2020-01-08"]) == 1
    assert "nothing to judge" in capsys.readouterr().out


def test_cli_exit_2_without_the_legacy_table(
    cli_env: str, db_engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    seed(db_engine, lambda c: create_sources(c, legacy=False))
    assert main(["parity"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "enrichq: parity: legacy table legacy.ticket_orders does not exist (ENRICHQ_LEGACY_TABLE)"
    )


def test_cli_exit_2_on_an_unwritable_report_path(
    cli_env: str, db_engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_world(db_engine, mismatch=False)
    assert main(["parity", "--html", str(tmp_path / "no" / "such" / "dir.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("enrichq: parity: --html ")
    assert err.endswith("its directory does not exist")
    assert len(err.splitlines()) == 1
    with db_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 0
