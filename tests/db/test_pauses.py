"""Pause and resume on real Postgres: the claim skips paused scopes, ingest goes on, every
action is audited, status and /metrics show the pauses, bad input changes nothing."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from tests.support.settings import make_settings

from enrichq_schema import audit
from enrichq_schema.states import AuditCommand
from enrichq_service import queue
from enrichq_service.cli import main
from enrichq_service.controls import pauses
from enrichq_service.controls.pauses import PauseScope
from enrichq_service.observe import families, read_snapshot
from enrichq_service.queue import EnqueueRequest
from enrichq_service.status import collect

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)


def put(conn: sa.Connection, key: str, *, kind: str = "enrich", tenant: str | None) -> None:
    queue.enqueue(
        conn,
        [EnqueueRequest.build(key=key, kind=kind, tenant=tenant, delay_seconds=0)],
        settings=make_settings(),
        now=T0,
    )


def claimable(conn: sa.Connection) -> list[tuple[str, str]]:
    """(kind, key) of everything a claim takes now (inside a savepoint, undone after)."""
    with conn.begin_nested() as sp:
        jobs = queue.claim(
            conn, owner="w", limit=100, lease_seconds=60, now=T0 + timedelta(seconds=1)
        )
        sp.rollback()
    return sorted((j.kind, j.key) for j in jobs)


@pytest.fixture
def world(conn: sa.Connection) -> sa.Connection:
    put(conn, "A-1", tenant="acme")
    put(conn, "A-2", kind="refresh", tenant="acme")
    put(conn, "G-1", tenant="globex")
    put(conn, "N-1", kind="refresh", tenant=None)
    return conn


EVERYTHING = [("enrich", "A-1"), ("enrich", "G-1"), ("refresh", "A-2"), ("refresh", "N-1")]


@pytest.mark.parametrize(
    ("kind", "tenant", "left"),
    [
        (None, "acme", [("enrich", "G-1"), ("refresh", "N-1")]),
        ("refresh", None, [("enrich", "A-1"), ("enrich", "G-1")]),
        ("enrich", "acme", [("enrich", "G-1"), ("refresh", "A-2"), ("refresh", "N-1")]),
        (None, None, []),
    ],
    ids=["tenant", "kind", "kind-and-tenant", "everything"],
)
def test_the_claim_skips_what_a_pause_covers(
    world: sa.Connection, kind: str | None, tenant: str | None, left: list[tuple[str, str]]
) -> None:
    assert claimable(world) == EVERYTHING
    pauses.pause(world, PauseScope.build(kind=kind, tenant=tenant), actor="ops", now=T0)
    assert claimable(world) == left
    assert [p.scope for p in pauses.resume(world, PauseScope(kind, tenant), actor="ops")] == [
        PauseScope(kind, tenant)
    ]
    assert claimable(world) == EVERYTHING


def test_ingest_goes_on_while_paused(world: sa.Connection) -> None:
    pauses.pause(world, PauseScope(None, None), actor="ops", now=T0)
    put(world, "A-1", tenant="acme")  # merges into the queued row
    put(world, "A-3", tenant="acme")
    rows = world.execute(
        sa.text("SELECT key, count(*) FROM enrichq.queue WHERE kind = 'enrich' GROUP BY key")
    ).all()
    assert sorted(tuple(r) for r in rows) == [("A-1", 1), ("A-3", 1), ("G-1", 1)]
    assert claimable(world) == []


def test_resume_takes_exactly_the_scope_that_was_paused(world: sa.Connection) -> None:
    pauses.pause(world, PauseScope(None, "acme"), actor="ops", reason="warehouse", now=T0)
    # resuming enrich of acme, or everything, is not resuming "every kind of acme"
    assert pauses.resume(world, PauseScope("enrich", "acme"), actor="ops") == []
    assert pauses.resume(world, PauseScope(None, None), actor="ops") == []
    assert [p.scope for p in pauses.in_place(world)] == [PauseScope(None, "acme")]
    assert [p.scope for p in pauses.resume(world, None, actor="ops")] == [PauseScope(None, "acme")]
    assert pauses.in_place(world) == []


def test_pausing_again_keeps_the_start_and_takes_the_new_reason(world: sa.Connection) -> None:
    _, created = pauses.pause(world, PauseScope(None, "acme"), actor="ops", reason="a", now=T0)
    assert created
    later = T0 + timedelta(hours=3)
    again, created = pauses.pause(
        world, PauseScope(None, "acme"), actor="bob", reason="b", now=later
    )
    assert not created
    assert (again.paused_at, again.paused_by, again.reason) == (T0, "ops", "b")
    [in_place] = pauses.in_place(world, now=later)
    assert in_place.age_seconds == pytest.approx(3 * 3600)


def test_every_pause_and_resume_is_audited(world: sa.Connection) -> None:
    pauses.pause(world, PauseScope("enrich", "acme"), actor="ops", reason="warehouse down", now=T0)
    pauses.pause(world, PauseScope("enrich", "acme"), actor="ops", now=T0)
    pauses.resume(world, PauseScope("enrich", "acme"), actor="ops")
    pauses.resume(world, PauseScope("enrich", "acme"), actor="ops")  # nothing: not recorded
    entries = audit.recent(world, limit=10)
    assert [(e.command, e.rows_affected, dict(e.filter)) for e in entries] == [
        ("resume", 1, {"kind": "enrich", "tenant": "acme"}),
        ("pause", 0, {"kind": "enrich", "tenant": "acme"}),
        ("pause", 1, {"kind": "enrich", "tenant": "acme"}),
    ]
    assert entries[-1].note == "warehouse down"
    assert all(e.actor == "ops" for e in entries)
    assert {e.command for e in entries} <= {AuditCommand.PAUSE, AuditCommand.RESUME}


def test_status_and_metrics_show_the_pauses(world: sa.Connection) -> None:
    pauses.pause(world, PauseScope(None, "acme"), actor="ops", reason="warehouse", now=T0)
    pauses.pause(world, PauseScope("refresh", None), actor="ops", now=T0 + timedelta(minutes=5))
    report = collect(world)
    assert [(p["kind"], p["tenant"], p["reason"]) for p in report.pauses] == [
        (None, "acme", "warehouse"),
        ("refresh", None, None),
    ]
    json.dumps(report.as_dict(), default=str)  # what `status --json` prints
    samples = {
        (s.name, s.labels["kind"], s.labels["tenant"]): s.value
        for family in families(read_snapshot(world))
        if family.name.startswith("enrichq_paused")
        for s in family.samples
    }
    assert samples == {
        ("enrichq_paused", "*", "acme"): 1,
        ("enrichq_paused", "refresh", "*"): 1,
        ("enrichq_paused_since_timestamp_seconds", "*", "acme"): T0.timestamp(),
        ("enrichq_paused_since_timestamp_seconds", "refresh", "*"): T0.timestamp() + 300,
    }


def test_the_cli_pauses_lists_and_resumes(
    db_url: str,
    db_engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    with db_engine.begin() as conn:
        put(conn, "A-1", tenant="acme")
    code, out, _ = run("pause", "--tenant", "acme", "--reason", "warehouse down", "--actor", "o")
    assert (code, out) == (
        0,
        "paused every kind, tenant acme: no worker claims its work until resumed\n",
    )
    code, out, _ = run("pause", "--tenant", "acme", "--actor", "o")
    assert code == 0
    assert "was already paused" in out
    code, out, _ = run("status", "--json")
    assert [p["tenant"] for p in json.loads(out)["pauses"]] == ["acme"]
    code, out, _ = run("status")
    assert "PAUSED every kind, tenant acme since" in out
    assert "warehouse down" in out
    code, _, err = run("resume", "--kind", "enrich", "--tenant", "acme", "--actor", "o")
    assert code == 1
    assert err == (
        "enrichq: resume: nothing is paused at kind enrich, tenant acme;"
        " paused: every kind, tenant acme; nothing changed\n"
    )
    code, out, _ = run("resume", "--tenant", "acme", "--json", "--actor", "o")
    assert code == 0
    assert json.loads(out)["resumed"][0]["tenant"] == "acme"
    with db_engine.connect() as conn:
        assert pauses.in_place(conn) == []
        assert [e.command for e in audit.recent(conn)] == ["resume", "pause", "pause"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pause", "--tenant", "a\x07b"], "pause: --tenant: must not contain control"),
        (["pause", "--reason", "x" * 501], "pause: --reason: must be 1 to 500 characters"),
        (["pause", "--actor", " "], "pause: actor: must be 1 to 200 characters"),
        (["resume", "--all", "--tenant", "acme"], "resume: --all stands alone"),
        (["resume", "--tenant", ""], "resume: --tenant: must be 1 to 200 characters"),
        (["pause", "--tenant", "acme "], "pause: --tenant: 'acme ' has spaces around it"),
        (["resume", "--tenant", " acme"], "resume: --tenant: ' acme' has spaces around it"),
    ],
)
def test_bad_cli_input_exits_2_with_one_line_and_changes_nothing(
    *,
    db_url: str,
    db_engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"enrichq: {message}")
    assert err.count("\n") == 1
    with db_engine.connect() as conn:
        assert pauses.in_place(conn) == []
        assert audit.recent(conn) == []


@pytest.mark.parametrize(
    ("args", "warned"),
    [
        (["pause", "--tenant", "acmee"], True),  # a misspelt tenant: no work of it anywhere
        (["pause", "--kind", "refresh", "--tenant", "globex"], True),  # no refresh of globex
        (["pause", "--tenant", "acme"], False),  # has a queued row
        (["pause", "--kind", "refresh", "--tenant", "initech"], False),  # served today
        (["pause", "--tenant", "umbrella"], False),  # has a plan
        (["pause"], False),  # everything
    ],
    ids=str,
)
def test_pausing_a_scope_never_seen_warns_that_it_may_stop_nothing(
    *,
    db_url: str,
    db_engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    warned: bool,
) -> None:
    with db_engine.begin() as conn:
        put(conn, "A-1", tenant="acme")
        put(conn, "G-1", tenant="globex")
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.tenant_served (kind, tenant, bucket, served)"
                " VALUES ('refresh', 'initech', date_trunc('hour', now()), 3)"
            )
        )
        conn.execute(sa.text("INSERT INTO enrichq.tenants (tenant) VALUES ('umbrella')"))
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    assert main([*args, "--actor", "o"]) == 0
    out = capsys.readouterr()
    assert ("has ever been seen" in out.err) == warned
    assert out.err.count("\n") == (1 if warned else 0)
    assert out.out.startswith("paused ")
    assert ("(none seen so far)" in out.out) == warned
    with db_engine.connect() as conn:
        assert len(pauses.in_place(conn)) == 1  # paused all the same
