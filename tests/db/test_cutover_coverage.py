"""A cutover never hides a consumer's data (issue #27), end to end through the command line
on real PostgreSQL: real parity runs, real approvals, real cutovers, the consumer view read
back. Each test names what consumers lost before the gate knew better."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.db import q
from tests.support.parity_world import add_ticket, create_sources

from enrichq_parity.cutover import VIEW
from enrichq_service.cli import main

NOW = datetime.now(UTC)
RECENT = NOW - timedelta(days=2)
OLD = NOW - timedelta(days=40)


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, db_url: str) -> str:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    return db_url


def recent_matching(conn: sa.Connection, tenant: str, n: int = 5) -> None:
    """`n` tickets of `tenant` from two days ago on which both flows agree."""
    for i in range(n):
        ticket = f"{tenant}-new-{i}"
        add_ticket(conn, ticket, created_at=RECENT, tenant=tenant, legacy=[f"O-{ticket}"],
                   shadow=[f"O-{ticket}"])  # fmt: skip


def history(conn: sa.Connection, tenant: str, n: int = 10) -> None:
    """`n` tickets of `tenant` from before the shadow run began: legacy rows, no enrichment."""
    for i in range(n):
        ticket = f"{tenant}-old-{i}"
        add_ticket(conn, ticket, created_at=OLD, tenant=tenant, legacy=[f"H-{ticket}"])


def parity(tmp_path: Path, *args: str) -> tuple[int, dict[str, object]]:
    """Run `enrichq parity` (its JSON report kept); (exit code, report)."""
    path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.json"
    code = main(["parity", "--json", str(path), *args])
    return code, json.loads(path.read_text())


def approved_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> int:
    """A parity run that passed, approved by alice; its id."""
    code, report = parity(tmp_path, *args)
    assert code == 0, report["verdict"]
    run_id = int(str(report["run_id"]))
    assert main(["parity", "approve", str(run_id), "--by", "alice"]) == 0
    capsys.readouterr()
    return run_id


def seen(engine: sa.Engine, prefix: str) -> int:
    """Rows consumers read through the view for tickets whose id starts with `prefix`."""
    with engine.connect() as conn:
        if conn.execute(sa.text("SELECT to_regclass(:v)"), {"v": VIEW}).scalar() is None:
            # no view yet: consumers read the legacy table
            source = "legacy.ticket_orders"
        else:
            source = VIEW
        n: int = conn.execute(
            sa.text(f"SELECT count(*) FROM {source} WHERE ticket_id LIKE :p"), {"p": f"{prefix}%"}
        ).scalar_one()
    return n


def refusal(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# -- #27.1: history, and tickets the mirror lacks --------------------------------------------


def test_history_before_the_window_stops_a_tenant_cutover_until_backfilled(
    cli: str, db_engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: parity over the 7-day window passed and `cutover --tenant acme` moved acme;
    consumers then read 0 rows for its 10 older tickets (10 before)."""
    with db_engine.begin() as conn:
        create_sources(conn)
        recent_matching(conn, "acme")
        history(conn, "acme")
    code, report = parity(tmp_path, "--html", str(tmp_path / "p.html"))
    assert code == 0, report["verdict"]
    summary = capsys.readouterr().out
    (line,) = [s for s in summary.splitlines() if s.startswith("not yet enriched")]
    assert line.split()[3] == "10"
    assert "Not yet enriched (all time)" in (tmp_path / "p.html").read_text()
    assert main(["parity", "approve", str(report["run_id"]), "--by", "alice"]) == 0
    capsys.readouterr()
    assert seen(db_engine, "acme-old-") == 10

    assert main(["cutover", "--tenant", "acme"]) == 1
    err = refusal(capsys)
    assert "10 tickets of tenant acme that consumers can read were never enriched" in err
    assert "`enrichq backfill --tenant acme`" in err
    assert seen(db_engine, "acme-old-") == 10
    # the report says so too, for every tenant, all time
    coverage = report["coverage"]
    assert isinstance(coverage, dict)
    assert [(t["tenant"], t["not_enriched"]) for t in coverage["tenants"]] == [("acme", 10)]


def test_a_legacy_ticket_the_mirror_lacks_stops_a_whole_cutover(
    cli: str, db_engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a whole cutover passed and the ticket's legacy rows vanished from the view."""
    with db_engine.begin() as conn:
        create_sources(conn)
        recent_matching(conn, "acme")
        conn.execute(
            sa.text("INSERT INTO legacy.ticket_orders VALUES ('ghost-1', 'G-1', :at)"),
            {"at": RECENT},
        )
    approved_run(tmp_path, capsys)
    assert main(["cutover"]) == 1
    err = refusal(capsys)
    assert "1 ticket with legacy rows are missing from the tickets mirror" in err
    assert seen(db_engine, "ghost-") == 1
    # a staged cutover keeps showing a ticket the mirror lacks its legacy rows
    assert main(["cutover", "--tenant", "acme"]) == 0
    assert seen(db_engine, "ghost-") == 1


def test_a_ticket_never_looked_up_is_not_an_exact_match(
    cli: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """Before: a ticket with no legacy order that enrichq never looked up counted as exact
    (both sides empty); one enrichq looked up and found nothing still does."""
    with db_engine.begin() as conn:
        create_sources(conn)
        recent_matching(conn, "acme", 2)
        add_ticket(conn, "acme-never", created_at=RECENT)
        add_ticket(conn, "acme-empty", created_at=RECENT, shadow=[])
    _, report = parity(tmp_path)
    total = report["total"]
    assert isinstance(total, dict)
    assert total["classes"]["exact"] == 3
    assert total["exclusions"]["not_enriched"] == 1
    assert total["compared"] == 3


# -- #27.3: a tenant without legacy orders ---------------------------------------------------


def test_a_tenant_without_legacy_orders_can_be_cut_over_alone(
    cli: str, db_engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "order coverage is undefined" refused both tenants forever."""
    with db_engine.begin() as conn:
        create_sources(conn)
        recent_matching(conn, "acme")
        for i in range(4):  # the legacy flow lost every ticket of lost-co
            add_ticket(conn, f"lost-{i}", created_at=RECENT, tenant="lost-co", shadow=[f"L{i}"])
            # the customers of quiet-co have no orders: both sides looked and found nothing
            add_ticket(conn, f"quiet-{i}", created_at=RECENT, tenant="quiet-co", shadow=[])
    accept = tmp_path / "accept.toml"
    accept.write_text(
        '[[rule]]\nclass = "legacy_missing"\ntenant = "lost-co"\n'
        f"first_day = {OLD:%Y-%m-%d}\nlast_day = {NOW:%Y-%m-%d}\n"
        'reason = "The legacy flow lost them all."\nauthor = "alice"\n'
    )
    approved_run(tmp_path, capsys, "--accept", str(accept))
    assert main(["cutover", "--tenant", "lost-co"]) == 0, capsys.readouterr().err
    assert main(["cutover", "--tenant", "quiet-co"]) == 0, capsys.readouterr().err
    assert seen(db_engine, "lost-") == 4


# -- #27.4: every tenant on its own figures --------------------------------------------------


def globex_fails(conn: sa.Connection) -> None:
    """acme matches on 200 tickets; globex is at 75% coverage and a 50% shadow fault rate,
    while the whole run passes."""
    create_sources(conn)
    recent_matching(conn, "acme", 200)
    add_ticket(conn, "globex-1", created_at=RECENT, tenant="globex", legacy=["A", "B"],
               shadow=["A", "B"])  # fmt: skip
    add_ticket(conn, "globex-2", created_at=RECENT, tenant="globex", legacy=["C", "D"],
               shadow=["C"])  # fmt: skip
    # a tenant with no ticket in the window, its one old ticket enriched (by a backfill)
    add_ticket(conn, "sleepy-1", created_at=OLD, tenant="sleepy", legacy=["Z"], shadow=["Z"])


def test_a_whole_cutover_needs_every_tenant_to_pass_on_its_own(
    cli: str, db_engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `cutover --tenant globex` was refused but `cutover` moved globex with acme."""
    with db_engine.begin() as conn:
        globex_fails(conn)
    code, report = parity(tmp_path)
    assert code == 0, report["verdict"]
    assert main(["parity", "approve", str(report["run_id"]), "--by", "alice"]) == 0
    out = capsys.readouterr().out
    failing = out.index("globex")
    assert "tenant globex fails on its own figures" in out
    assert failing < out.index("approved parity run")  # shown before it signs
    assert main(["cutover"]) == 1
    assert "did not pass for tenant globex" in refusal(capsys)
    assert seen(db_engine, "globex-2") == 2  # still the legacy rows
    # every other tenant moves; one without a ticket in the window, on its coverage alone
    assert main(["cutover", "--exclude-tenant", "globex"]) == 0, capsys.readouterr().err
    assert seen(db_engine, "globex-2") == 2
    assert q(db_engine, "SELECT tenant FROM enrichq_public.cutover_tenants ORDER BY 1") == [
        ("acme",), ("sleepy",),
    ]  # fmt: skip


# -- #27.5: the gate checks what the run judged ----------------------------------------------


def test_a_run_over_an_old_window_does_not_gate_today(
    cli: str, db_engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a run over one day 200 days ago passed, was approved and gated a cutover."""
    day = (NOW - timedelta(days=200)).replace(hour=0, minute=0, second=0, microsecond=0)
    with db_engine.begin() as conn:
        create_sources(conn)
        for i in range(5):
            add_ticket(conn, f"acme-{i}", created_at=day + timedelta(hours=2), legacy=[f"O{i}"],
                       shadow=[f"O{i}"])  # fmt: skip
    since, until = f"{day:%Y-%m-%d}", f"{day + timedelta(days=1):%Y-%m-%d}"
    approved_run(tmp_path, capsys, "--since", since, "--until", until)
    assert main(["cutover", "--tenant", "acme"]) == 1
    err = refusal(capsys)
    assert "judged tickets created up to" in err
    assert "covers 1.0 days, shorter than ENRICHQ_PARITY_WINDOW_DAYS (7)" in err


def test_the_gate_judges_by_the_bars_in_force_at_cutover(
    cli: str,
    db_engine: sa.Engine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: a run made with no coverage bar passed at 0% coverage and gated a cutover
    under the default bars."""
    with db_engine.begin() as conn:
        create_sources(conn)
        for i in range(5):
            add_ticket(conn, f"acme-{i}", created_at=RECENT, legacy=[f"O{i}"], shadow=[])
    monkeypatch.setenv("ENRICHQ_PARITY_MIN_ORDER_COVERAGE", "0")
    monkeypatch.setenv("ENRICHQ_PARITY_MAX_SHADOW_FAULT_RATE", "1")
    approved_run(tmp_path, capsys)
    monkeypatch.delenv("ENRICHQ_PARITY_MIN_ORDER_COVERAGE")
    monkeypatch.delenv("ENRICHQ_PARITY_MAX_SHADOW_FAULT_RATE")
    assert main(["cutover", "--tenant", "acme"]) == 1
    err = refusal(capsys)
    assert "order coverage 0.00% is below 99.50%" in err
    assert "it ran with order coverage ≥ 0.00% and shadow fault rate ≤ 100.00%" in err


def test_a_shadow_table_emptied_after_approval_stops_the_cutover(
    cli: str, db_engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: deleting every enrichq row after approval still let a cutover through, and
    consumers read nothing."""
    with db_engine.begin() as conn:
        create_sources(conn)
        recent_matching(conn, "acme")
    run_id = approved_run(tmp_path, capsys)
    with db_engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM enrichq.ticket_orders"))
        conn.execute(sa.text("DELETE FROM enrichq.ticket_enrichments"))
    assert main(["cutover", "--tenant", "acme"]) == 1
    err = refusal(capsys)
    assert (
        f"enrichq.ticket_orders holds 0 order rows of 0 enriched tickets of tenant acme, "
        f"fewer than parity run #{run_id} saw (5 order rows of 5)"
    ) in err
    assert seen(db_engine, "acme-") == 5
