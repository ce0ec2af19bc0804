"""Accepted differences and the CSV export, against real Postgres: which tickets each rule
covers, what the run records of them, and every differing ticket in the export."""

from __future__ import annotations

import csv
import json
from datetime import date
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.parity_world import (
    DAY1,
    NOW,
    SINCE,
    add_ticket,
    create_sources,
    seed,
    seed_every_class,
    seed_legacy_faults_only,
)
from tests.support.settings import parity_settings

from enrichq_parity.accept import parse
from enrichq_parity.export import COLUMNS
from enrichq_parity.model import AcceptFile, AcceptRule, ParityReport, TicketClass
from enrichq_parity.parity import run_parity
from enrichq_schema.settings import Settings
from enrichq_service.cli import main


def rule(number: int, ticket_class: str, **scope: object) -> AcceptRule:
    values: dict[str, object] = {"first_day": None, "last_day": None}
    values.update(scope)
    return AcceptRule(
        number=number,
        line=number * 10,
        ticket_class=TicketClass(ticket_class),
        reason=f"reason {number}",
        author="alice",
        **values,  # type: ignore[arg-type]  # test overrides of any field
    )


def accept(*rules: AcceptRule) -> AcceptFile:
    return AcceptFile("accept.toml", "0" * 64, rules)


def run(
    engine: sa.Engine,
    settings: Settings,
    accepted: AcceptFile | None = None,
    csv_path: Path | None = None,
) -> ParityReport:
    return run_parity(
        engine, engine, settings, since=SINCE, until=None, now=NOW, accept=accepted,
        csv_path=csv_path,
    )  # fmt: skip


@pytest.fixture
def legacy_faults(db_engine: sa.Engine, db_url: str) -> tuple[sa.Engine, Settings]:
    seed(db_engine, seed_legacy_faults_only)
    return db_engine, parity_settings(db_url)


ON_DAY1 = {"first_day": DAY1.date(), "last_day": DAY1.date()}


def test_rules_accept_legacy_faults_and_list_what_they_matched(
    legacy_faults: tuple[sa.Engine, Settings],
) -> None:
    engine, settings = legacy_faults
    accepted = accept(
        rule(1, "legacy_missing", **ON_DAY1),
        rule(2, "extra_only", tickets=("A-extra-0", "A-extra-1", "A-nowhere")),
        rule(3, "extra_only", tenant="globex", **ON_DAY1),
    )
    before = run(engine, settings)
    assert (before.verdict.state, before.total.unaccepted_legacy_faults) == ("review", 4)
    report = run(engine, settings, accepted)
    t = report.total
    assert (t.accepted_legacy_missing, t.accepted_extra_only, t.unaccepted_legacy_faults) == (
        2,
        2,
        0,
    )
    assert (report.verdict.passed, report.verdict.ready, report.verdict.state) == (
        True,
        True,
        "pass",
    )
    assert report.verdict.reason.endswith("; all 4 legacy-fault tickets accepted")
    assert [(r.rule.number, r.matched, r.tickets, r.unused) for r in report.rules] == [
        (1, 2, ("A-lost-0", "A-lost-1"), False),
        (2, 2, ("A-extra-0", "A-extra-1"), False),
        (3, 0, (), True),
    ]
    accepted_by = {
        m.ticket_id: m.accepted_by
        for c in (TicketClass.LEGACY_MISSING, TicketClass.EXTRA_ONLY)
        for m in report.mismatches[c]
    }
    assert accepted_by == {"A-lost-0": (1,), "A-lost-1": (1,), "A-extra-0": (2,), "A-extra-1": (2,)}
    tenants = {tr.tenant: tr.tally for tr in report.tenants}
    assert (tenants["acme"].accepted_legacy_faults, tenants["globex"].legacy_faults) == (4, 0)
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT * FROM enrichq.parity_runs WHERE id = :id"), {"id": report.run_id}
        ).one()
    assert (row.legacy_faults, row.accepted_legacy_faults, row.passed) == (4, 4, True)
    assert (row.accept_rules, row.accept_sha256) == (3, "0" * 64)
    stored = row.report["rules"]
    assert [(r["number"], r["matched"], r["reason"], r["author"]) for r in stored] == [
        (1, 2, "reason 1", "alice"), (2, 2, "reason 2", "alice"), (3, 0, "reason 3", "alice"),
    ]  # fmt: skip
    assert stored[1]["tickets_matched"] == ["A-extra-0", "A-extra-1"]


def test_a_ticket_two_rules_cover_counts_once(legacy_faults: tuple[sa.Engine, Settings]) -> None:
    engine, settings = legacy_faults
    report = run(
        engine,
        settings,
        accept(
            rule(1, "legacy_missing", tickets=("A-lost-0",)),
            rule(2, "legacy_missing", tenant="acme", **ON_DAY1),
        ),
    )
    assert [(r.matched, r.tickets) for r in report.rules] == [
        (1, ("A-lost-0",)), (2, ("A-lost-0", "A-lost-1")),
    ]  # fmt: skip
    assert report.total.accepted_legacy_missing == 2
    lost0 = next(
        m for m in report.mismatches[TicketClass.LEGACY_MISSING] if m.ticket_id == "A-lost-0"
    )
    assert lost0.accepted_by == (1, 2)


SCOPES_THAT_MISS: dict[str, dict[str, object]] = {
    "another tenant": {"tenant": "globex", **ON_DAY1},
    "tickets without a tenant": {"tenant": "", **ON_DAY1},
    "other days": {"first_day": date(2024, 3, 5), "last_day": date(2024, 3, 9)},
    "other tickets": {"tickets": ("A-extra-0", "A-00")},
}


@pytest.mark.parametrize("scope", SCOPES_THAT_MISS, ids=list(SCOPES_THAT_MISS))
def test_a_rule_covers_its_scope_only(
    legacy_faults: tuple[sa.Engine, Settings], scope: str
) -> None:
    """Each of these rules is for legacy_missing tickets, and misses both of them."""
    engine, settings = legacy_faults
    report = run(engine, settings, accept(rule(1, "legacy_missing", **SCOPES_THAT_MISS[scope])))
    assert (report.rules[0].matched, report.rules[0].unused) == (0, True)
    assert report.total.accepted_legacy_faults == 0
    assert not report.verdict.ready


def test_a_rule_covers_its_class_only(legacy_faults: tuple[sa.Engine, Settings]) -> None:
    engine, settings = legacy_faults
    report = run(engine, settings, accept(rule(1, "extra_only", **ON_DAY1)))
    t = report.total
    assert (t.accepted_extra_only, t.accepted_legacy_missing, report.rules[0].matched) == (2, 0, 2)


def test_rules_never_touch_shadow_faults(every_class: tuple[sa.Engine, Settings]) -> None:
    """Rules cover legacy faults only: a run with every class stays failed with them."""
    engine, settings = every_class
    wide = {"first_day": date(2024, 3, 1), "last_day": date(2024, 3, 10)}
    report = run(
        engine,
        settings,
        accept(rule(1, "legacy_missing", **wide), rule(2, "extra_only", **wide)),
    )
    t = report.total
    assert (t.accepted_legacy_faults, t.legacy_faults, t.shadow_faults) == (2, 2, 6)
    assert not report.passed


@pytest.fixture
def every_class(db_engine: sa.Engine, db_url: str) -> tuple[sa.Engine, Settings]:
    seed(db_engine, seed_every_class)
    return db_engine, parity_settings(db_url)


# -- the CSV export -------------------------------------------------------------------------


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_export_has_every_differing_ticket(
    every_class: tuple[sa.Engine, Settings], tmp_path: Path
) -> None:
    engine, settings = every_class
    path = tmp_path / "mismatches.csv"
    report = run(
        engine, settings, accept(rule(1, "extra_only", tickets=("T-08-extra",))), csv_path=path
    )
    rows = read_csv(path)
    assert tuple(rows[0]) == COLUMNS
    # by creation day, then ticket id; exact matches are not in it
    assert [r["ticket_id"] for r in rows] == [
        "T-03-partial", "T-04-lost", "T-14-foreign",
        "T-05-drift", "T-06-partial-extra", "T-07-legacy-missing", "T-08-extra", "T-09-late",
        "T-15-unknown",
    ]  # fmt: skip
    assert len(rows) == report.total.compared - report.total.exact
    by_id = {r["ticket_id"]: r for r in rows}
    assert by_id["T-06-partial-extra"] == {
        "ticket_id": "T-06-partial-extra",
        "tenant": "acme",
        "created_at": "2024-03-05T09:00:00+00:00",
        "class": "partial",
        "fault": "shadow",
        "accepted_by": "",
        "legacy_orders": "2",
        "matched_orders": "1",
        "differing_orders": "2",
        "missing": '["Q2"]',
        "extra": '["Q9"]',
        "drift": "",
        "unverified": "",
        "legacy_looked_up_at": "2024-03-05T10:00:00+00:00",
        "enriched_at": "2024-03-05T10:30:00+00:00",
    }
    assert (by_id["T-08-extra"]["fault"], by_id["T-08-extra"]["accepted_by"]) == ("legacy", "1")
    assert (by_id["T-05-drift"]["fault"], by_id["T-05-drift"]["drift"]) == ("explained", '["D2"]')
    assert by_id["T-04-lost"]["enriched_at"] == ""
    # the export is the run's own: the same classes as the report
    counts = {c.value: sum(1 for r in rows if r["class"] == c.value) for c in TicketClass}
    assert counts == {c.value: report.total.count(c) for c in TicketClass} | {"exact": 0}
    assert [p.name for p in tmp_path.iterdir()] == ["mismatches.csv"]


HOSTILE = ('=HYPERLINK("http://x")', "+1", "-2", "@SUM(A1)", "\tTAB", "\rCR", "A B", "C,D")


def test_the_export_neutralises_formulas_and_keeps_ids_apart(
    db_engine: sa.Engine, db_url: str, tmp_path: Path
) -> None:
    """Ids and tenants that a spreadsheet would run as formulas come out as text, and ids
    holding a space or a comma read back one by one."""

    def build(conn: sa.Connection) -> None:
        create_sources(conn)
        add_ticket(conn, "=1+1", created_at=DAY1, tenant="@acme", legacy=list(HOSTILE))

    seed(db_engine, build)
    path = tmp_path / "m.csv"
    run_parity(
        db_engine, db_engine, parity_settings(db_url),
        since=SINCE, until=None, now=NOW, csv_path=path,
    )  # fmt: skip
    [row] = read_csv(path)
    assert (row["ticket_id"], row["tenant"], row["class"]) == ("'=1+1", "'@acme", "shadow_missing")
    assert sorted(json.loads(row["missing"])) == sorted(HOSTILE)
    for cell in row.values():
        assert not cell.startswith(("=", "+", "-", "@", "\t", "\r"))


def test_a_failed_run_leaves_no_export(
    every_class: tuple[sa.Engine, Settings], tmp_path: Path
) -> None:
    engine, settings = every_class
    path = tmp_path / "mismatches.csv"

    def stop(done: int, _days: int) -> None:
        if done == 4:
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        run_parity(
            engine, engine, settings, since=SINCE, until=None, now=NOW, csv_path=path,
            progress=stop,
        )  # fmt: skip
    assert list(tmp_path.iterdir()) == []
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT finished_at, report FROM enrichq.parity_runs")).one()
    assert row.finished_at is None
    assert row.report == {"error": "RuntimeError: interrupted"}


# -- the command line -----------------------------------------------------------------------

ACCEPT_FILE = """\
[[rule]]
class = "legacy_missing"
first_day = 2024-03-04
last_day = 2024-03-04
reason = "The legacy flow lost these during its restart."
author = "alice"

[[rule]]
class = "extra_only"
tenant = "acme"
tickets = ["A-extra-0", "A-extra-1"]
reason = "Placed while the legacy lookup was running."
author = "bob"

[[rule]]
class = "extra_only"
tenant = "initech"
first_day = 2024-03-01
last_day = 2024-03-09
reason = "Nothing of the kind any more."
author = "bob"
"""


@pytest.fixture
def cli_world(monkeypatch: pytest.MonkeyPatch, db_url: str, db_engine: sa.Engine) -> sa.Engine:
    """The legacy-faults world created three days ago (inside the CLI's default window)."""
    from datetime import UTC, datetime, timedelta

    created = datetime.now(UTC).replace(microsecond=0) - timedelta(days=3)
    seed(db_engine, lambda conn: seed_legacy_faults_only(conn, created_at=created))
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    return db_engine


def _accept_file(tmp_path: Path, text: str) -> Path:
    from datetime import UTC, datetime, timedelta

    day = (datetime.now(UTC) - timedelta(days=3)).date().isoformat()
    path = tmp_path / "accept.toml"
    path.write_text(text.replace("2024-03-04", day), encoding="utf-8")
    return path


def test_cli_applies_the_accept_file_and_flags_an_unused_rule(
    cli_world: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _accept_file(tmp_path, ACCEPT_FILE)
    csv_path = tmp_path / "m.csv"
    assert main(["parity", "--accept", str(path), "--csv", str(csv_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "PASS" in out
    assert "rule 1 (line 1) legacy_missing" in out
    assert "2 tickets" in out
    assert "rule 3 (line 15) extra_only, tenant initech" in out
    assert "matched nothing" in out
    assert "all 4 legacy-fault tickets accepted" in out
    rows = read_csv(csv_path)
    assert sorted((r["ticket_id"], r["accepted_by"]) for r in rows) == [
        ("A-extra-0", "2"), ("A-extra-1", "2"), ("A-lost-0", "1"), ("A-lost-1", "1"),
    ]  # fmt: skip
    with cli_world.connect() as conn:
        run = conn.execute(
            sa.text("SELECT accept_rules, accept_sha256 FROM enrichq.parity_runs")
        ).one()
    assert run.accept_rules == 3
    assert run.accept_sha256 == parse(path.read_bytes(), str(path)).sha256


def test_cli_without_accept_file_passes_with_legacy_faults_to_accept(
    cli_world: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["parity"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "legacy faults to accept" in out
    assert "4 legacy-fault tickets not accepted yet" in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            ACCEPT_FILE.replace(
                'class = "extra_only"\ntenant = "acme"', 'class = "partial"\ntenant = "acme"'
            ),
            ":9: rule 2: class 'partial' is a shadow fault",
        ),
        (
            ACCEPT_FILE.replace('author = "bob"\n\n[[rule]]', "\n\n[[rule]]", 1),
            ":8: rule 2: author is missing",
        ),
        ("[[rule]\n", ":1: not valid TOML: "),
    ],
    ids=["shadow-fault class", "no author", "broken TOML"],
)
def test_cli_refuses_a_bad_accept_file_with_exit_2_and_records_nothing(
    cli_world: sa.Engine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    message: str,
) -> None:
    path = _accept_file(tmp_path, text)
    assert main(["parity", "--accept", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"enrichq: parity: --accept {path}:")
    assert message in err
    with cli_world.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.runs")).scalar() == 0


def test_cli_refuses_a_missing_accept_file(
    cli_world: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["parity", "--accept", str(tmp_path / "nope.toml")]) == 2
    assert capsys.readouterr().err.strip().endswith("nope.toml: no such file")


def test_the_json_report_lists_rules_and_matches(cli_world: sa.Engine, tmp_path: Path) -> None:
    path = _accept_file(tmp_path, ACCEPT_FILE)
    out = tmp_path / "p.json"
    assert main(["parity", "--accept", str(path), "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["accept_file"]["path"] == str(path)
    assert [(r["number"], r["matched"]) for r in document["rules"]] == [(1, 2), (2, 2), (3, 0)]
    assert document["total"]["accepted"] == {"legacy_missing": 2, "extra_only": 2}
    assert document["state"] == "pass"
