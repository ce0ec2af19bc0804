"""Parity against real Postgres: every class and fault group, the verification of extras,
exclusions, samples, outputs, CLI exits."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY
from tests.support.parity_world import (
    DAY1,
    DAY2,
    NOW,
    SINCE,
    add_ticket,
    create_sources,
    seed,
    seed_every_class,
)
from tests.support.pg import Databases
from tests.support.plans import walk
from tests.support.settings import make_settings, parity_settings

from enrichq_parity.model import (
    Fault,
    Thresholds,
    TicketClass,
    decide,
)
from enrichq_parity.parity import (
    ParityInputError,
    ParityReport,
    export_latest,
    run_parity,
    run_scheduled,
)
from enrichq_schema import identifiers as names
from enrichq_schema import tables
from enrichq_schema.db import create_engine
from enrichq_schema.settings import Settings
from enrichq_service.cli import main

# re-exported for the other test modules that build parity worlds
__all__ = ["add_ticket", "create_sources"]

BARS = Thresholds(min_order_coverage=0.995, max_shadow_fault_rate=0.005, min_ticket_match_rate=0.99)


def run(
    engine: sa.Engine,
    settings: Settings,
    since: datetime = SINCE,
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


# -- the classes and fault groups, exactly -------------------------------------------------


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
        "drift_only": 1,
        "partial": 2,
        "shadow_missing": 1,
        "unverified": 3,
        "legacy_missing": 1,
        "extra_only": 1,
    }
    assert (t.compared, t.too_young, t.open_queue_rows, t.excluded) == (12, 1, 2, 3)
    assert (t.legacy_orders, t.matched_orders, t.missing_orders) == (14, 9, 5)
    assert (t.extra_orders, t.drift_orders, t.unverified_orders) == (3, 1, 3)
    assert (t.shadow_faults, t.legacy_faults, t.in_group(Fault.EXPLAINED)) == (6, 2, 1)
    assert t.order_coverage == pytest.approx(9 / 14)
    assert t.shadow_fault_rate == pytest.approx(6 / 12)
    assert t.ticket_match_rate == pytest.approx(4 / 12)
    assert not report.passed
    assert report.verdict.reason == (
        "order coverage 64.29% is below 99.50%; shadow fault rate 50.00% is above 0.50% "
        "(partial 2, shadow missing 1, unverified 3)"
    )


def test_each_mismatch_names_its_orders(every_class: tuple[sa.Engine, Settings]) -> None:
    engine, settings = every_class
    report = run(engine, settings)
    got = {
        m.ticket_id: (m.ticket_class.value, m.missing, m.extra, m.drift, m.unverified)
        for ms in report.mismatches.values()
        for m in ms
    }
    assert got == {
        "T-03-partial": ("partial", ("P2", "P3"), (), (), ()),
        "T-04-lost": ("shadow_missing", ("S1", "S2"), (), (), ()),
        "T-06-partial-extra": ("partial", ("Q2",), ("Q9",), (), ()),
        "T-14-foreign": ("unverified", (), (), (), ("F2",)),
        "T-09-late": ("unverified", (), (), (), ("W2",)),
        "T-15-unknown": ("unverified", (), (), (), ("U1",)),
        "T-07-legacy-missing": ("legacy_missing", (), ("L1",), (), ()),
        "T-08-extra": ("extra_only", (), ("E2",), (), ()),
        "T-05-drift": ("drift_only", (), (), ("D2",), ()),
    }
    lost = report.mismatches[TicketClass.SHADOW_MISSING][0]
    assert (lost.tenant, lost.enriched_at, lost.legacy_orders, lost.matched_orders) == (
        "globex", None, 2, 0,
    )  # fmt: skip
    assert (lost.fault, report.mismatches[TicketClass.DRIFT_ONLY][0].fault) == (
        Fault.SHADOW, Fault.EXPLAINED,
    )  # fmt: skip


# One ticket: legacy has O1, enrichq has O1 and O2; `how` says what the warehouse knows of O2.
VERIFICATION_CASES = {
    # the customer's order, placed before both lookups: the legacy flow missed it
    "confirmed": ({}, "extra_only"),
    # the requester's e-mail differs in case only: the lookup is case-insensitive
    "e-mail case": ({"email": "T-1@EXAMPLE.com"}, "extra_only"),
    # placed between the legacy lookup and enrichq's: drift
    "drift": ({"placed_at": {"O2": DAY1 + timedelta(hours=1, minutes=10)}}, "drift_only"),
    # placed after enrichq's own lookup: enrichq cannot have found it honestly
    "after enrichq's lookup": ({"placed_at": {"O2": DAY1 + timedelta(hours=3)}}, "unverified"),
    # another customer's order
    "another customer": ({"foreign": {"O2"}}, "unverified"),
    # an order the warehouse does not know
    "unknown order": ({"unknown": {"O2"}}, "unverified"),
}


@pytest.mark.parametrize("case", VERIFICATION_CASES, ids=list(VERIFICATION_CASES))
def test_shadow_only_orders_are_verified_against_the_warehouse(
    db_engine: sa.Engine, db_url: str, case: str
) -> None:
    options, expected = VERIFICATION_CASES[case]

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        add_ticket(conn, "T-1", created_at=DAY1, legacy=["O1"], shadow=["O1", "O2"], **options)  # type: ignore[arg-type]  # parametrized keyword arguments

    seed(db_engine, build)
    t = run(db_engine, parity_settings(db_url)).total
    assert {c.value for c in TicketClass if t.count(c)} == {expected}
    orders = {"extra_only": "extra", "drift_only": "drift", "unverified": "unverified"}[expected]
    assert getattr(t, f"{orders}_orders") == 1
    assert t.extra_orders + t.drift_orders + t.unverified_orders == 1


@pytest.mark.parametrize(
    ("placed", "expected"),
    [
        # placed after the legacy lookup that found nothing: drift, not the legacy's fault
        ({"N1": DAY1 + timedelta(hours=1, minutes=10)}, {"drift_only": 1}),
        # placed before it: the legacy flow missed it
        ({"N1": DAY1 - timedelta(days=1)}, {"legacy_missing": 1}),
    ],
    ids=["after the legacy lookup", "before it"],
)
def test_drift_after_a_legacy_lookup_that_found_nothing_is_drift(
    db_engine: sa.Engine, db_url: str, placed: dict[str, datetime], expected: dict[str, int]
) -> None:
    """The legacy flow looked the ticket up and found no order (a row with no order id); the
    order enrichq found was placed after that lookup."""

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        add_ticket(conn, "T-1", created_at=DAY1, shadow=["N1"], placed_at=placed)
        conn.execute(
            sa.text("INSERT INTO legacy.ticket_orders VALUES ('T-1', NULL, :at)"),
            {"at": DAY1 + timedelta(hours=1)},
        )

    seed(db_engine, build)
    t = run(db_engine, parity_settings(db_url)).total
    assert {c.value: t.count(c) for c in TicketClass if t.count(c)} == expected


def test_a_legacy_less_ticket_with_an_unconfirmed_order_is_a_shadow_fault(
    db_engine: sa.Engine, db_url: str
) -> None:
    """Without verification this would be 'legacy missing' (the legacy's fault); an order of
    another customer makes it enrichq's."""

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        add_ticket(conn, "T-1", created_at=DAY1, shadow=["O1", "O2"], foreign={"O2"})
        add_ticket(conn, "T-2", created_at=DAY1, shadow=["O3"])

    seed(db_engine, build)
    t = run(db_engine, parity_settings(db_url)).total
    assert (t.unverified, t.legacy_missing, t.unverified_orders, t.extra_orders) == (1, 1, 1, 2)


def test_without_the_warehouse_nothing_is_verified(db_engine: sa.Engine, db_url: str) -> None:
    """A parity database without the warehouse tables (a BigQuery warehouse) cannot confirm
    any shadow-only order: each one is unverified, and the report says why."""

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        add_ticket(conn, "T-1", created_at=DAY1, legacy=["O1"], shadow=["O1", "O2"])
        conn.exec_driver_sql("DROP TABLE warehouse.customers")

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url))
    assert (report.total.unverified, report.total.extra_only) == (1, 0)
    assert report.sources["verified_against"].startswith("nothing: ")


def test_legacy_faults_never_fail_a_run(db_engine: sa.Engine, db_url: str) -> None:
    """The demo's world in small: enrichq has every legacy order, legacy lost some tickets."""

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        for i in range(10):
            add_ticket(conn, f"T-{i}", created_at=DAY1, legacy=[f"O{i}"], shadow=[f"O{i}"])
        add_ticket(conn, "T-lost", created_at=DAY1, shadow=["L1"])
        add_ticket(conn, "T-more", created_at=DAY1, legacy=["M1"], shadow=["M1", "M2"])

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url))
    t = report.total
    assert (t.order_coverage, t.shadow_fault_rate, t.legacy_faults) == (1.0, 0.0, 2)
    assert t.ticket_match_rate == pytest.approx(10 / 12)  # below 99%: still not a bar
    verdict = report.verdict
    assert (verdict.passed, verdict.ready, verdict.state) == (True, False, "review")
    assert verdict.reason == (
        "order coverage 100.00% ≥ 99.50% and shadow fault rate 0.00% ≤ 0.50%; 2 legacy-fault "
        "tickets not accepted yet (legacy missing 1, extra only 1): cutover needs an accepted "
        "rule for each"
    )


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
    assert (day1.exact, day1.partial, day1.shadow_missing, day1.unverified) == (2, 1, 1, 1)
    assert day1.order_coverage == pytest.approx(4 / 8)
    assert (day2.exact, day2.drift_only, day2.partial, day2.legacy_missing) == (1, 1, 1, 1)
    assert (day2.extra_only, day2.unverified, day2.open_queue_rows, day2.compared) == (1, 2, 2, 7)
    assert by_day["2024-03-10"].too_young == 1
    assert by_day["2024-03-02"].compared == 0
    assert by_day["2024-03-02"].order_coverage is None
    tenants = {tr.tenant: tr.tally for tr in report.tenants}
    assert set(tenants) == {"", "acme", "globex"}
    assert (tenants["globex"].partial, tenants["globex"].shadow_missing) == (1, 1)
    assert tenants["globex"].order_coverage == pytest.approx(1 / 5)
    assert tenants[""].legacy_missing == 1
    assert tenants["acme"].compared == 9
    assert report.tenant_verdict("globex") == decide(tenants["globex"], report.thresholds)
    assert report.tenant_verdict("nobody") is None


@pytest.mark.parametrize("concurrency", [1, 4])
def test_days_compared_at_once_give_the_same_report(
    every_class: tuple[sa.Engine, Settings], concurrency: int
) -> None:
    """Days run on several connections at once, but are added up in day order: the report
    (days, tenants, mismatches) and the progress calls do not depend on which day finished
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
    assert other.mismatches == reference.mismatches
    assert other.total == reference.total


def test_mismatches_are_kept_most_differing_first(db_engine: sa.Engine, db_url: str) -> None:
    """60 partial tickets over two days, missing 1 to 60 orders: the 50 kept are the most
    differing, in that order, whatever day they are on."""

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        for i in range(1, 61):
            orders = [f"O{i}-{k}" for k in range(i + 1)]
            add_ticket(
                conn, f"P-{i:02d}", created_at=DAY1 if i % 2 else DAY2, legacy=orders,
                shadow=orders[:1],
            )  # fmt: skip

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url))
    kept = report.mismatches[TicketClass.PARTIAL]
    assert report.total.partial == 60
    assert [m.ticket_id for m in kept] == [f"P-{i:02d}" for i in range(60, 10, -1)]
    assert [m.differing_orders for m in kept[:3]] == [60, 59, 58]
    assert report.sample(Fault.SHADOW) == kept


def test_run_is_recorded(every_class: tuple[sa.Engine, Settings]) -> None:
    engine, settings = every_class
    report = run(engine, settings)
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT * FROM enrichq.parity_runs WHERE id = :id"), {"id": report.run_id}
        ).one()
        log = conn.execute(sa.text("SELECT * FROM enrichq.runs WHERE component = 'parity'")).one()
    assert row.finished_at == NOW
    assert (row.window_since, row.window_until) == (SINCE, NOW)
    assert (row.tickets_compared, row.tickets_excluded, row.exact_matches) == (12, 3, 3)
    assert row.order_coverage == pytest.approx(9 / 14)
    assert row.ticket_match_rate == pytest.approx(4 / 12)
    assert (row.shadow_faults, row.shadow_fault_rate) == (6, 0.5)
    assert (row.legacy_faults, row.accepted_legacy_faults) == (2, 0)
    assert (row.min_order_coverage, row.max_shadow_fault_rate) == (0.995, 0.005)
    assert (row.accept_rules, row.accept_sha256) == (0, None)
    assert row.passed is False
    assert row.report == json.loads(json.dumps(report.as_dict()))
    assert row.report["total"]["faults"] == {"shadow": 6, "legacy": 2, "explained": 1}
    assert (log.stop_reason, log.error) == ("no_work", None)
    assert log.counts["parity_run_id"] == report.run_id


def test_a_stored_report_reads_back_the_same(every_class: tuple[sa.Engine, Settings]) -> None:
    engine, settings = every_class
    report = run(engine, settings)
    again = ParityReport.from_dict(json.loads(json.dumps(report.as_dict())))
    assert again.as_dict() == report.as_dict()
    assert again.verdict == report.verdict


def test_gauges_show_the_latest_run(every_class: tuple[sa.Engine, Settings]) -> None:
    engine, settings = every_class
    run(engine, settings)
    with engine.connect() as conn:
        export_latest(conn)

    def gauge(name: str) -> float | None:
        return REGISTRY.get_sample_value(name)

    assert gauge("enrichq_parity_order_coverage") == pytest.approx(9 / 14)
    assert gauge("enrichq_parity_ticket_match_rate") == pytest.approx(4 / 12)
    assert gauge("enrichq_parity_pass") == 0
    assert gauge("enrichq_parity_last_run_timestamp_seconds") == NOW.timestamp()


def test_order_sets_compare_as_sets(db_engine: sa.Engine, db_url: str) -> None:
    """A legacy order written twice, or the two sides in another order, is still the same
    set: exact, its orders counted once; a set that holds the other and more is not."""

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        add_ticket(conn, "T-twice", created_at=DAY1, legacy=["B", "A", "B"], shadow=["A", "B"])
        add_ticket(conn, "T-order", created_at=DAY1, legacy=["Z", "Y"], shadow=["Y", "Z"])
        add_ticket(conn, "T-more", created_at=DAY1, legacy=["M", "M"], shadow=["M", "N"])

    seed(db_engine, build)
    t = run(db_engine, parity_settings(db_url)).total
    assert (t.compared, t.exact, t.count(TicketClass.EXTRA_ONLY)) == (3, 2, 1)
    assert (t.legacy_orders, t.matched_orders) == (5, 5)


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
    assert report.verdict.ready
    assert (report.total.exact, report.total.drift_only, report.total.mismatched) == (40, 1, 0)
    assert report.total.order_coverage == 1.0
    assert report.sample(Fault.SHADOW) == report.sample(Fault.LEGACY) == ()
    assert report.verdict.reason == (
        "order coverage 100.00% ≥ 99.50% and shadow fault rate 0.00% ≤ 0.50%; no legacy faults"
    )


def test_the_shadow_fault_bar_is_a_setting(db_engine: sa.Engine, db_url: str) -> None:
    """One partial ticket in 100 (1%): fails the default bar (0.5%), passes at 2%. Order
    coverage stays above its bar, so the fault rate alone decides."""

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        for i in range(99):
            orders = [f"O{i}-{k}" for k in range(3)]
            add_ticket(conn, f"T-{i:03d}", created_at=DAY1, legacy=orders, shadow=orders)
        add_ticket(
            conn, "T-partial", created_at=DAY1, legacy=["P1", "P2", "P3"], shadow=["P1", "P2"]
        )

    seed(db_engine, build)
    strict = run(db_engine, parity_settings(db_url, parity_min_order_coverage=0.99))
    assert not strict.passed
    assert "shadow fault rate 1.00% is above 0.50% (partial 1)" in strict.verdict.reason
    lenient = run(
        db_engine,
        parity_settings(db_url, parity_min_order_coverage=0.99, parity_max_shadow_fault_rate=0.02),
    )
    assert lenient.passed


# -- empty and young windows ----------------------------------------------------------------


def test_an_empty_window_is_a_clear_failure(db_engine: sa.Engine, db_url: str) -> None:
    seed(db_engine, create_sources)
    report = run(db_engine, parity_settings(db_url))
    assert report.total.compared == 0
    assert report.total.order_coverage is None
    assert not report.passed
    assert report.verdict.state == "empty"
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
        "no tickets compared in the window (3 excluded: too young 3, open queue rows 0, "
        "not enriched 0): nothing to judge"
    )


def test_tickets_without_legacy_orders_are_judged_by_the_fault_rate(
    db_engine: sa.Engine, db_url: str
) -> None:
    """Coverage of no legacy order is undefined, which is no failure (#27.3): enrichq looked
    the ticket up and found nothing, as legacy did; one it never looked up is not compared."""

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        add_ticket(conn, "T-1", created_at=DAY1, shadow=[])
        add_ticket(conn, "T-2", created_at=DAY1)

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url))
    assert (report.total.compared, report.total.exact, report.total.not_enriched) == (1, 1, 1)
    assert report.total.order_coverage is None
    assert report.passed
    assert report.verdict.reason.startswith(
        "order coverage n/a (legacy has no orders for these tickets) and shadow fault rate "
        "0.00% ≤ 0.50%"
    )


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
        assert report.total.compared == 12
        with db_engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 1
        with replica.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 0
    finally:
        replica.dispose()
        databases.drop(replica_url)


def test_the_run_records_what_it_read_and_the_report_says_it(
    every_class: tuple[sa.Engine, Settings],
) -> None:
    """A run records the time of the data it judged and the replica's lag (none on a
    primary); the report says where it read, a standby's lag included, not only a log line."""
    from dataclasses import replace

    from enrichq_parity.parity import ReadSide
    from enrichq_parity.report import to_html

    engine, settings = every_class
    report = run(engine, settings)
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT data_at, replica_lag_seconds FROM enrichq.parity_runs WHERE id = :id"),
            {"id": report.run_id},
        ).one()
    assert (row.data_at, row.replica_lag_seconds) == (NOW, None)
    assert "the primary, as of 2024-03-10 12:00:00 UTC" in to_html(report)
    standby = ReadSide(standby=True, lag_seconds=108000.0).describe(NOW - timedelta(hours=30))
    assert standby == "a standby 108000.0 s behind: its data is as of 2024-03-09 06:00:00 UTC"
    shown = to_html(replace(report, sources={**report.sources, "read_side": standby}))
    assert standby in shown


def _day_plan(engine: sa.Engine, *, seqscan: bool) -> list[Mapping[str, object]]:
    """The day query's plan nodes over the seeded world."""
    from enrichq_parity.parity import _queries

    statement = names.render(
        _queries()["parity_day"],
        tickets="helpdesk.tickets",
        legacy="legacy.ticket_orders",
        orders="warehouse.orders",
        customers="warehouse.customers",
    )
    with engine.connect() as conn:
        if not seqscan:
            conn.execute(sa.text("SET enable_seqscan = off"))
        plan = conn.execute(
            sa.text("EXPLAIN (FORMAT JSON) " + statement.text),
            {
                "day_start": DAY1,
                "day_end": NOW,
                "young_after": NOW,
                "sample_size": 50,
                "rules": "[]",
                "rule_sample": 100,
                "export": False,
            },
        ).scalar_one()
        conn.rollback()
    return list(walk(plan[0]["Plan"]))


def test_open_queue_checks_use_the_partial_indexes(
    every_class: tuple[sa.Engine, Settings],
) -> None:
    """With sequential scans priced out, the queue is only reached through open-row indexes."""
    engine, _ = every_class
    nodes = _day_plan(engine, seqscan=False)
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan" and n["Relation Name"] == "queue"]
    used = {str(n["Index Name"]) for n in nodes if str(n.get("Index Name", "")).startswith("queue")}
    open_row_indexes = {
        ix.name
        for ix in tables.queue.indexes
        if str(ix.dialect_options["postgresql"]["where"]) in {tables.QUEUED, tables.LEASED}
    }
    assert used <= open_row_indexes
    assert len(used) >= 2  # one per open state


def test_verification_probes_the_warehouse_by_key(every_class: tuple[sa.Engine, Settings]) -> None:
    """Each shadow-only order is checked by its id and its customer's id, never by a scan
    of the warehouse tables (which are far larger than the few orders checked)."""
    engine, _ = every_class
    nodes = _day_plan(engine, seqscan=False)
    touched = {
        (str(n["Relation Name"]), str(n["Node Type"]))
        for n in nodes
        if n.get("Relation Name") in {"orders", "customers"}
    }
    assert {name for name, _ in touched} == {"orders", "customers"}
    assert all("Index" in kind for _, kind in touched), touched


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
    from enrichq_parity.model import Approval
    from enrichq_parity.report import to_html, to_json

    def build(conn: sa.Connection) -> None:
        seed_every_class(conn)
        add_ticket(
            conn, "T-<script>alert(1)</script>", created_at=DAY1, tenant='<b>"evil"</b>',
            legacy=["<img src=x>"], shadow=[],
        )  # fmt: skip

    seed(db_engine, build)
    report = run(db_engine, parity_settings(db_url))
    approval = Approval(1, "<i>mallory</i>", NOW, "looks <fine>")
    page = to_html(report, [approval])
    assert "<script>alert" not in page
    assert "T-&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;&#34;evil&#34;&lt;/b&gt;" in page
    assert "&lt;img src=x&gt;" in page
    assert "&lt;i&gt;mallory&lt;/i&gt;" in page
    assert "looks &lt;fine&gt;" in page
    assert "<svg" in page
    assert ">FAIL<" in page
    # the fault groups, the rule and approval sections are all there
    for heading in (
        "Shadow worse",
        "Legacy worse",
        "Explained",
        "Accepted differences",
        "Approvals",
    ):
        assert f">{heading}" in page
    # self-contained: the stylesheet is inline, nothing is fetched from anywhere
    assert ".chart .line" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page
    assert "<link" not in page
    document = json.loads(to_json(report, [approval]))
    assert document["total"]["classes"]["partial"] == 3
    assert document["mismatches"]["partial"][0]["ticket_id"] == "T-03-partial"
    assert document["approvals"][0]["approved_by"] == "<i>mallory</i>"


def test_what_a_first_time_reviewer_reads_agrees_with_itself(
    db_engine: sa.Engine, db_url: str
) -> None:
    """A run passing with legacy faults to accept is not a plain PASS; a failing run does not
    suggest approving it; the ticket bars have an axis in tickets, not in percent."""
    from tests.support.parity_world import seed_legacy_faults_only

    from enrichq_parity.report import to_html

    seed(db_engine, seed_legacy_faults_only)
    review = to_html(run(db_engine, parity_settings(db_url)))
    assert '<span class="badge review">PASS · LEGACY FAULTS TO ACCEPT</span>' in review
    assert ">PASS<" not in review
    assert "parity approve" in review  # a passing run may be approved once its faults are

    with db_engine.begin() as conn:
        add_ticket(conn, "Z-lost", created_at=DAY1, legacy=["Z1", "Z2"])
        for i in range(5):
            add_ticket(conn, f"Z-part-{i}", created_at=DAY2, legacy=["P1", "P2"], shadow=["P1"])
    report = run(db_engine, parity_settings(db_url))
    assert not report.passed
    failing = to_html(report)
    assert ">FAIL<" in failing
    assert "parity approve" not in failing
    assert "cannot be approved" in failing
    # 30 tickets on day 1, 5 on day 2: the right axis counts tickets up to a round 50
    right_axis = re.findall(r'text-anchor="start">([^<]+)</text>', failing)
    assert right_axis == ["0", "25", "50", "tickets"]


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
    assert ">PASS<" in html_path.read_text()


def test_cli_says_its_progress_in_plain_lines_when_not_on_a_terminal(
    cli_env: str, db_engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_world(db_engine, mismatch=False)
    assert main(["parity", "--since", "2020-01-01"]) in (0, 1)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("parity: ")]
    days = int(lines[-1].split(" of ")[1].split()[0])
    assert days > 1000
    assert 2 <= len(lines) <= 11
    assert lines[-1].startswith(f"parity: {days} of {days} days compared (")


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


@pytest.mark.parametrize("option", ["--html", "--json", "--csv"])
def test_cli_exit_2_on_an_unwritable_report_path(
    cli_env: str,
    db_engine: sa.Engine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    option: str,
) -> None:
    _cli_world(db_engine, mismatch=False)
    assert main(["parity", option, str(tmp_path / "no" / "such" / "dir.out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"enrichq: parity: {option} ")
    assert err.endswith("its directory does not exist")
    assert len(err.splitlines()) == 1
    with db_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 0
