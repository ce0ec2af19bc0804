"""Signing parity runs and listing them: `enrichq parity approve`, `parity runs`, `parity show`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.parity_world import add_ticket, seed, seed_legacy_faults_only
from tests.support.settings import parity_settings

from enrichq_parity.model import AcceptFile, AcceptRule, TicketClass
from enrichq_parity.parity import run_parity
from enrichq_parity.review import approvals_of, list_runs
from enrichq_schema.settings import Settings
from enrichq_service.cli import main

CREATED = datetime.now(UTC).replace(microsecond=0) - timedelta(days=2)
EVERY_LEGACY_FAULT = AcceptFile(
    "accept.toml",
    "f" * 64,
    tuple(
        AcceptRule(
            number=n,
            line=n,
            ticket_class=TicketClass(c),
            reason="the legacy flow lost them",
            author="alice",
            first_day=CREATED.date(),
            last_day=CREATED.date(),
        )
        for n, c in ((1, "legacy_missing"), (2, "extra_only"))
    ),
)


@pytest.fixture
def world(
    monkeypatch: pytest.MonkeyPatch, db_url: str, db_engine: sa.Engine
) -> tuple[sa.Engine, Settings]:
    """Legacy faults only (a passing world), created two days ago; the CLI points at it."""
    seed(db_engine, lambda conn: seed_legacy_faults_only(conn, created_at=CREATED))
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    return db_engine, parity_settings(db_url)


def parity(engine: sa.Engine, settings: Settings, accept: AcceptFile | None = None) -> int:
    """A parity run over the default window; its id."""
    report = run_parity(engine, engine, settings, since=None, until=None, accept=accept)
    assert report.run_id is not None
    return report.run_id


def failing_run(engine: sa.Engine, settings: Settings) -> int:
    """A run that did not pass: one ticket of 31 never enriched."""
    with engine.begin() as conn:
        add_ticket(conn, "Z-lost", created_at=CREATED, legacy=["Z1", "Z2"])
    run_id = parity(engine, settings)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM helpdesk.tickets WHERE id = 'Z-lost'"))
    return run_id


def approvals(engine: sa.Engine) -> list[tuple[int, str, str | None]]:
    with engine.connect() as conn:
        return [
            (r.parity_run_id, r.approved_by, r.note)
            for r in conn.execute(sa.text("SELECT * FROM enrichq.parity_approvals ORDER BY id"))
        ]


# -- approve --------------------------------------------------------------------------------


def test_approve_records_a_signature_once(
    world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    engine, settings = world
    run_id = parity(engine, settings, EVERY_LEGACY_FAULT)
    assert main(["parity", "approve", str(run_id), "--by", "alice", "--note", "read it all"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"approved parity run #{run_id} by alice at ")
    assert "note:" not in out
    assert approvals(engine) == [(run_id, "alice", "read it all")]
    assert main(["parity", "approve", str(run_id), "--by", "alice"]) == 0
    assert "already approved by alice" in capsys.readouterr().out
    assert main(["parity", "approve", str(run_id), "--by", "bob"]) == 0
    assert approvals(engine) == [(run_id, "alice", "read it all"), (run_id, "bob", None)]
    with engine.connect() as conn:
        got = approvals_of(conn, [run_id, 999])
    assert [a.approved_by for a in got[run_id]] == ["alice", "bob"]
    assert got[999] == ()


def test_a_reviewer_is_one_reviewer_whatever_the_case_of_the_name(
    world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    engine, settings = world
    run_id = parity(engine, settings, EVERY_LEGACY_FAULT)
    assert main(["parity", "approve", str(run_id), "--by", "alice"]) == 0
    capsys.readouterr()
    assert main(["parity", "approve", str(run_id), "--by", "Alice"]) == 0
    assert "was already approved by alice" in capsys.readouterr().out
    assert main(["parity", "approve", str(run_id), "--by", "ÉLODIE"]) == 0
    assert main(["parity", "approve", str(run_id), "--by", "élodie"]) == 0
    assert [a[1] for a in approvals(engine)] == ["alice", "ÉLODIE"]


def test_approving_an_unknown_run_is_exit_2(
    world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["parity", "approve", "42", "--by", "alice"]) == 2
    assert capsys.readouterr().err.strip() == "enrichq: parity approve: there is no parity run #42"
    assert approvals(world[0]) == []


def test_approving_a_failed_run_is_exit_1(
    world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    engine, settings = world
    run_id = failing_run(engine, settings)
    assert main(["parity", "approve", str(run_id), "--by", "alice"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"enrichq: parity approve refused: parity run #{run_id} did not pass (")
    assert err.endswith("): a failing run cannot be approved")
    assert approvals(engine) == []


@pytest.mark.parametrize(
    ("report", "said"),
    [("{}", "(it is still running)"), ('{"error": "OperationalError: gone"}', "(it failed: ")],
    ids=["running", "errored"],
)
def test_approving_an_unfinished_run_is_exit_1(
    world: tuple[sa.Engine, Settings],
    capsys: pytest.CaptureFixture[str],
    report: str,
    said: str,
) -> None:
    engine, _ = world
    with engine.begin() as conn:
        run_id = conn.execute(
            sa.text(
                "INSERT INTO enrichq.parity_runs (window_since, window_until, min_order_coverage,"
                " min_ticket_match_rate, report) VALUES (now() - interval '7 days', now(), 0.995,"
                " 0.99, CAST(:report AS jsonb)) RETURNING id"
            ),
            {"report": report},
        ).scalar_one()
    assert main(["parity", "approve", str(run_id), "--by", "alice"]) == 1
    err = capsys.readouterr().err.strip()
    assert f"parity run #{run_id} did not finish {said}" in err
    assert approvals(engine) == []


def test_a_run_from_before_verdicts_by_fault_cannot_be_approved(
    world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    engine, settings = world
    run_id = parity(engine, settings)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE enrichq.parity_runs SET max_shadow_fault_rate = NULL"))
    assert main(["parity", "approve", str(run_id), "--by", "alice"]) == 1
    assert "was recorded before verdicts by fault" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--by", "   "], "--by must be 1 to 200 printable characters"),
        (["--by", "a" * 201], "--by must be 1 to 200 printable characters"),
        (["--by", "alice", "--note", "x" * 2001], "--note must be at most 2000"),
        (["--by", "alice", "--note", "bell\a"], "--note must be at most 2000 printable"),
    ],
    ids=["blank name", "long name", "long note", "control character"],
)
def test_a_bad_name_or_note_is_exit_2(
    world: tuple[sa.Engine, Settings],
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    said: str,
) -> None:
    engine, settings = world
    run_id = parity(engine, settings, EVERY_LEGACY_FAULT)
    assert main(["parity", "approve", str(run_id), *args]) == 2
    assert said in capsys.readouterr().err
    assert approvals(engine) == []


def test_approval_says_what_cutover_will_still_refuse(
    world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    """A passing run with legacy faults nobody accepted can be signed; the approval says
    that cutover will refuse their tenants, and that a newer run is the one judged."""
    engine, settings = world
    unaccepted = parity(engine, settings)
    parity(engine, settings, EVERY_LEGACY_FAULT)
    assert main(["parity", "approve", str(unaccepted), "--by", "alice"]) == 0
    out = capsys.readouterr().out
    assert "note: 4 legacy-fault tickets of this run have no accepted rule" in out
    assert f"note: cutover judges the latest finished run, #{unaccepted + 1}, not this one" in out


# -- runs, show -----------------------------------------------------------------------------


def test_runs_lists_verdicts_rules_and_approvals(
    world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    engine, settings = world
    failed = failing_run(engine, settings)
    review = parity(engine, settings)
    passed = parity(
        engine,
        settings,
        AcceptFile("a.toml", "a" * 64, (*EVERY_LEGACY_FAULT.rules, _unused_rule())),
    )
    assert main(["parity", "approve", str(passed), "--by", "carol"]) == 0
    capsys.readouterr()
    with engine.connect() as conn:
        rows = {r.id: r for r in list_runs(conn)}
    assert [rows[i].state for i in (failed, review, passed)] == ["fail", "review", "pass"]
    assert (rows[passed].accept_rules, rows[passed].unused_rules) == (3, 1)
    assert (rows[passed].legacy_faults, rows[passed].accepted_legacy_faults) == (4, 4)
    assert [a.approved_by for a in rows[passed].approvals] == ["carol"]
    assert main(["parity", "runs", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["id"] for line in lines] == [passed, review, failed]
    assert lines[0]["approvals"][0]["approved_by"] == "carol"
    assert main(["parity", "runs"]) == 0
    out = capsys.readouterr().out
    assert "carol" in out
    assert "legacy faults to accept" in out
    assert "1 matched nothing" in out


def _unused_rule() -> AcceptRule:
    return AcceptRule(
        number=3,
        line=20,
        ticket_class=TicketClass.EXTRA_ONLY,
        reason="r",
        author="a",
        tenant="initech",
        tickets=("I-1",),
    )


def test_runs_with_none_recorded(
    world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["parity", "runs"]) == 0
    assert "no parity runs recorded yet" in capsys.readouterr().out


def test_show_writes_the_report_again_with_its_approvals(
    world: tuple[sa.Engine, Settings], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine, settings = world
    run_id = parity(engine, settings, EVERY_LEGACY_FAULT)
    assert main(["parity", "approve", str(run_id), "--by", "dana", "--note", "rule 1 checked"]) == 0
    html, document = tmp_path / "r.html", tmp_path / "r.json"
    assert main(["parity", "show", str(run_id), "--html", str(html), "--json", str(document)]) == 0
    out = capsys.readouterr().out
    assert "approved by dana" in out
    page = html.read_text()
    assert ">APPROVED<" in page
    assert "rule 1 checked" in page
    stored = json.loads(document.read_text())
    assert stored["approvals"][0]["approved_by"] == "dana"
    assert stored["run_id"] == run_id
    assert main(["parity", "show", "777"]) == 2
    assert capsys.readouterr().err.strip() == "enrichq: parity show: there is no parity run #777"


def test_comparison_options_do_not_go_with_a_review_command(
    world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["parity", "--json", "x.json", "runs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "enrichq: parity runs: --json belongs to a comparison (`enrichq parity`), not to this "
        "command"
    )


def test_parity_still_runs_a_comparison_without_a_command(
    world: tuple[sa.Engine, Settings], tmp_path: Path
) -> None:
    engine, _ = world
    out = tmp_path / "x.json"
    assert main(["parity", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["state"] == "review"
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 1
