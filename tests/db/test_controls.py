"""Operator controls on real Postgres: cancel, dlq discard, the audit log, batches, fences.

Redrive's own rules are in test_sweeper_dlq.py; the plans in test_controls_plans.py; the
races with workers in tests/concurrent/test_controls_races.py.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.db import lock_waiters
from tests.support.procs import wait_for
from tests.support.settings import make_settings

from enrichq_schema import audit
from enrichq_schema.states import AuditCommand
from enrichq_schema.tables import queue
from enrichq_service import queue as q
from enrichq_service.commands import controls as control_commands
from enrichq_service.commands.base import CommandError, Context
from enrichq_service.controls import actions as controls
from enrichq_service.controls.errors import FilterError
from enrichq_service.controls.filters import Filter, Scope
from enrichq_service.queue import EnqueueRequest, Job

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
OWNER = "w-1"


def row(
    conn: sa.Connection,
    key: str,
    state: str = "queued",
    *,
    kind: str = "enrich",
    tenant: str | None = None,
    reason: str = "updated",
    dead_reason: str | None = None,
    age: timedelta = timedelta(hours=1),
) -> int:
    """A row in `state`, created (and, when terminal, finished) `age` before T0."""
    values: dict[str, Any] = {
        "kind": kind,
        "key": key,
        "tenant": tenant,
        "reason": reason,
        "state": state,
        "max_attempts": 3,
        "visible_at": T0 - age,
        "created_at": T0 - age,
    }
    if state == "leased":
        values |= {"attempts": 1, "lease_owner": OWNER, "lease_expires_at": T0 + timedelta(1)}
    if state in {"done", "failed", "dead_letter"}:
        values |= {"attempts": 1, "finished_at": T0 - age}
    if state == "dead_letter":
        values["dead_reason"] = dead_reason or "attempts_exhausted"
    return int(conn.execute(sa.insert(queue).values(**values).returning(queue.c.id)).scalar_one())


def get(conn: sa.Connection, row_id: int) -> sa.Row[Any]:
    return conn.execute(sa.select(queue).where(queue.c.id == row_id)).one()


def states(conn: sa.Connection) -> dict[int, tuple[str, str | None]]:
    rows = conn.execute(sa.select(queue.c.id, queue.c.state, queue.c.dead_reason))
    return {r.id: (r.state, r.dead_reason) for r in rows}


def act(
    conn: sa.Connection, command: AuditCommand, batch_size: int = 1000, **criteria: Any
) -> Counter[str]:
    """What the CLI's action does, batch by batch, inside the test's transaction."""
    flt = Filter.build(controls.SCOPE_OF[command], **criteria)
    selection = controls.select(conn, flt, now=T0)
    done: Counter[str] = Counter()
    for start in range(0, len(selection.ids), batch_size):
        ids = selection.ids[start : start + batch_size]
        if command is AuditCommand.CANCEL:
            done.update(controls.cancel_batch(conn, flt, ids, now=T0, started=selection.started))
        else:
            done.update(controls.discard_batch(conn, flt, ids, now=T0))
    return +done  # the counts that are not zero


# -- cancel


def test_cancel_moves_queued_and_leased_rows_to_dead_letter_and_nothing_else(
    conn: sa.Connection,
) -> None:
    queued = row(conn, "T-1", tenant="acme")
    leased = row(conn, "T-2", "leased", tenant="acme")
    others = {
        row(conn, "T-3", "done", tenant="acme"): ("done", None),
        row(conn, "T-4", "failed", tenant="acme"): ("failed", None),
        row(conn, "T-5", "dead_letter", tenant="acme"): ("dead_letter", "attempts_exhausted"),
        row(conn, "T-6", tenant="globex"): ("queued", None),
    }
    assert act(conn, AuditCommand.CANCEL, tenant="acme") == {"queued": 1, "leased": 1}
    after = states(conn)
    assert after[queued] == after[leased] == ("dead_letter", "cancelled")
    assert {i: after[i] for i in others} == others
    # the invariants of a terminal row hold (the table's CHECKs would refuse otherwise)
    for row_id in (queued, leased):
        r = get(conn, row_id)
        assert (r.finished_at, r.updated_at) == (T0, T0)
        assert (r.lease_owner, r.lease_expires_at, r.heartbeat_at, r.superseded_by) == (None,) * 4


@pytest.mark.parametrize(
    ("criteria", "expected"),
    [
        ({"keys": ["T-1", "T-3"]}, {"T-1", "T-3"}),
        ({"kind": "refresh"}, {"T-3"}),
        ({"reason": "created"}, {"T-2"}),
        ({"tenant": "acme", "reason": "updated"}, {"T-1"}),
        ({"older_than": "2h"}, {"T-2", "T-4"}),
        ({"older_than": "2h", "tenant": "acme"}, {"T-2"}),
        ({"keys": ["T-9"]}, set()),
        ({"all_rows": True}, {"T-1", "T-2", "T-3", "T-4"}),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_cancel_filters_combine(
    conn: sa.Connection, criteria: dict[str, Any], expected: set[str]
) -> None:
    rows = {
        row(conn, "T-1", tenant="acme"): "T-1",
        row(conn, "T-2", "leased", tenant="acme", reason="created", age=timedelta(hours=3)): "T-2",
        row(conn, "T-3", kind="refresh", reason="refresh"): "T-3",
        row(conn, "T-4", age=timedelta(days=2)): "T-4",
    }
    act(conn, AuditCommand.CANCEL, **criteria)
    cancelled = {rows[i] for i, (s, _) in states(conn).items() if s == "dead_letter"}
    assert cancelled == expected


def test_cancel_by_id_refuses_ids_that_are_not_queued_or_leased_before_changing_anything(
    conn: sa.Connection,
) -> None:
    queued = row(conn, "T-1")
    done = row(conn, "T-2", "done")
    with pytest.raises(FilterError, match=f"not queued or leased: {done}, 999999"):
        act(conn, AuditCommand.CANCEL, ids=[queued, done, 999999])
    assert get(conn, queued).state == "queued"
    # an id in scope that another criterion excludes is simply not matched
    assert act(conn, AuditCommand.CANCEL, ids=[queued], tenant="acme") == {}


def claimed(conn: sa.Connection, key: str) -> Job:
    settings = make_settings(None)
    q.enqueue(conn, [EnqueueRequest.build(key=key)], settings=settings, now=T0)
    [job] = q.claim(conn, kinds=("enrich",), owner=OWNER, limit=1, lease_seconds=60, now=T0)
    return job


def test_a_cancelled_leased_row_fences_its_worker(conn: sa.Connection) -> None:
    job = claimed(conn, "T-1")
    assert act(conn, AuditCommand.CANCEL, keys=["T-1"]) == {"leased": 1}
    later = T0 + timedelta(seconds=5)
    # the heartbeat reports the lease lost, so the handler is told to stop ...
    assert q.heartbeat(conn, owner=OWNER, jobs=[job], lease_seconds=60, now=later) == {job.id}
    # ... and every settle is refused: the worker writes its results only for winners
    assert q.complete(conn, owner=OWNER, jobs=[job], now=later) == set()
    assert q.fail(conn, owner=OWNER, failures=[(job, "x")], now=later) == set()
    assert (
        q.retry(
            conn,
            owner=OWNER,
            failures=[(job, "x")],
            backoff_base_seconds=1,
            backoff_cap_seconds=1,
            now=later,
        )
        == {}
    )
    assert q.defer(conn, owner=OWNER, deferrals=[(job, None)], now=later) == set()
    r = get(conn, job.id)
    assert (r.state, r.dead_reason, r.attempts, r.lease_owner) == (
        "dead_letter",
        "cancelled",
        1,
        None,
    )


def test_redrive_brings_cancelled_rows_back(conn: sa.Connection) -> None:
    a = row(conn, "T-1")
    act(conn, AuditCommand.CANCEL, ids=[a])
    flt = Filter.build(Scope.DEAD, reason="cancelled")
    selection = controls.select(conn, flt, now=T0)
    assert controls.redrive_batch(conn, flt, selection.ids, selection.winners, now=T0) == {
        "redriven": 1,
        "merged": 0,
    }
    assert (get(conn, a).state, get(conn, a).reason) == ("queued", "redrive")


# -- discard


def test_discard_deletes_only_matching_dead_letters(conn: sa.Connection) -> None:
    old_exhausted = row(conn, "T-1", "dead_letter", age=timedelta(days=10))
    new_exhausted = row(conn, "T-2", "dead_letter")
    old_superseded = row(conn, "T-3", "dead_letter", dead_reason="superseded", age=timedelta(8))
    old_done = row(conn, "T-4", "done", age=timedelta(days=10))
    old_queued = row(conn, "T-5", age=timedelta(days=10))
    assert act(conn, AuditCommand.DLQ_DISCARD, reason="attempts_exhausted", older_than="7d") == {
        "discarded": 1
    }
    assert set(states(conn)) == {new_exhausted, old_superseded, old_done, old_queued}
    assert old_exhausted not in states(conn)
    assert act(conn, AuditCommand.DLQ_DISCARD, all_rows=True) == {"discarded": 2}
    assert set(states(conn)) == {old_done, old_queued}


def test_discard_by_id_refuses_rows_that_are_not_dead_letters(conn: sa.Connection) -> None:
    live = row(conn, "T-1")
    with pytest.raises(FilterError, match=f"not dead letters: {live}"):
        act(conn, AuditCommand.DLQ_DISCARD, ids=[live])
    assert get(conn, live).state == "queued"


# -- runs in batches, each its own transaction, audited


def seen_from_outside(engine: sa.Engine, sql: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql)).all()


def test_a_run_works_in_batches_and_its_audit_row_follows_each_commit(
    db_engine: sa.Engine,
) -> None:
    with db_engine.begin() as conn:
        ids = [row(conn, f"T-{i}", tenant="acme") for i in range(5)]
    seen: list[tuple[Any, ...]] = []

    def after_batch(n: int, totals: Any) -> None:
        # another connection sees each batch committed, and the audit row with it
        [entry] = seen_from_outside(
            db_engine, "SELECT rows_affected, finished_at FROM enrichq.audit_log"
        )
        cancelled = seen_from_outside(
            db_engine, "SELECT count(*) FROM enrichq.queue WHERE dead_reason = 'cancelled'"
        )[0][0]
        seen.append((n, entry.rows_affected, entry.finished_at is None, cancelled))

    result = controls.run(
        db_engine,
        AuditCommand.CANCEL,
        Filter.build(Scope.OPEN, tenant="acme"),
        actor="ops",
        batch_size=2,
        on_batch=after_batch,
    )
    assert seen == [(1, 2, True, 2), (2, 4, True, 4), (3, 5, True, 5)]
    assert (result.matched, result.affected, result.batches) == (5, 5, 3)
    [entry] = audit.recent(db_engine.connect(), limit=5)
    assert (entry.command, entry.actor, entry.rows_affected, entry.id) == (
        "cancel",
        "ops",
        5,
        result.audit_id,
    )
    assert entry.filter == {"scope": "open", "tenant": "acme"}
    assert entry.detail == {"matched": 5, "queued": 5, "leased": 0, "kept": 0}
    assert entry.finished_at is not None
    assert len(ids) == 5


def test_an_interrupted_run_keeps_its_committed_batches_and_an_unfinished_audit_row(
    db_engine: sa.Engine,
) -> None:
    with db_engine.begin() as conn:
        for i in range(5):
            row(conn, f"T-{i}", "dead_letter")

    def stop(n: int, totals: Any) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        controls.run(
            db_engine,
            AuditCommand.DLQ_DISCARD,
            Filter.build(Scope.DEAD, all_rows=True),
            actor="ops",
            batch_size=2,
            on_batch=stop,
        )
    assert seen_from_outside(db_engine, "SELECT count(*) FROM enrichq.queue")[0][0] == 3
    [entry] = seen_from_outside(
        db_engine, "SELECT command, rows_affected, finished_at FROM enrichq.audit_log"
    )
    assert (entry.command, entry.rows_affected, entry.finished_at) == ("dlq discard", 2, None)


def test_a_dry_run_counts_and_samples_in_selection_order_and_changes_nothing(
    db_engine: sa.Engine,
) -> None:
    with db_engine.begin() as conn:
        # the selection reads the queued rows by (kind, key), then the leased ones
        a = row(conn, "a")
        b_refresh = row(conn, "B", kind="refresh", reason="refresh")
        b_enrich = row(conn, "B", "leased")
        before = conn.execute(sa.select(queue).order_by(queue.c.id)).all()
    result = controls.run(
        db_engine,
        AuditCommand.CANCEL,
        Filter.build(Scope.OPEN, all_rows=True),
        actor="ops",
        dry_run=True,
        sample_size=2,
    )
    assert (result.dry_run, result.matched, result.batches, result.audit_id) == (
        True,
        3,
        0,
        None,
    )
    assert result.states == {"queued": 2, "leased": 1}
    assert [s.id for s in result.sample] == [a, b_refresh]
    with db_engine.connect() as conn:
        assert conn.execute(sa.select(queue).order_by(queue.c.id)).all() == before
        assert audit.recent(conn) == []
    assert b_enrich not in [s.id for s in result.sample]


def test_a_batch_locks_its_rows_in_key_kind_id_order(db_engine: sa.Engine) -> None:
    """Deterministic proof of the lock order, with three connections.

    Rows are created so that id order is the reverse of lock order. A blocker locks the
    middle row; the cancel batch then locks every row before it in lock order and waits.
    A probe with SKIP LOCKED sees exactly which rows are locked: the ones before the
    middle (and the middle), never the ones after it, whatever their ids.
    """
    with db_engine.begin() as conn:
        keys = ["T-5", "T-4", "T-3", "T-2", "T-1"]  # ids ascending, keys descending
        ids = {key: row(conn, key) for key in keys}
    flt = Filter.build(Scope.OPEN, all_rows=True)
    with db_engine.connect() as conn:
        selection = controls.select(conn, flt)
    assert tuple(selection.ids) == tuple(ids[k] for k in sorted(keys))

    blocker = db_engine.connect()
    blocker_tx = blocker.begin()
    blocker.execute(
        sa.text("SELECT 1 FROM enrichq.queue WHERE id = :id FOR UPDATE"), {"id": ids["T-3"]}
    )
    failure: list[BaseException] = []

    def cancel() -> None:
        try:
            with db_engine.connect() as conn, conn.begin():
                controls.cancel_batch(conn, flt, selection.ids)
        except BaseException as exc:  # reported below
            failure.append(exc)

    worker = threading.Thread(target=cancel)
    worker.start()
    try:
        wait_for(lambda: lock_waiters(db_engine) == 1, what="the cancel to wait")
        with db_engine.connect() as probe, probe.begin():
            free = {
                r.key
                for r in probe.execute(
                    sa.text("SELECT key FROM enrichq.queue FOR UPDATE SKIP LOCKED")
                )
            }
        assert free == {"T-4", "T-5"}
    finally:
        blocker_tx.rollback()
        blocker.close()
        worker.join(30)
    assert not failure, failure
    with db_engine.connect() as conn:
        assert {s for s, _ in states(conn).values()} == {"dead_letter"}


# -- the command line


def test_the_cli_cancels_discards_and_lists_the_audit(
    db_engine: sa.Engine,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from enrichq_service.cli import main

    with db_engine.begin() as conn:
        a = row(conn, "T-1", tenant="acme")
        row(conn, "T-2", "leased", tenant="acme")
        row(conn, "T-3", tenant="globex")
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    assert main(["cancel", "--tenant", "acme", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "2 rows (1 queued, 1 leased) match --tenant acme; would cancel them (dry run"
    )
    assert main(["cancel", "--tenant", "acme", "--actor", "alice"]) == 0
    assert capsys.readouterr().out.startswith(
        "2 rows matched --tenant acme: 2 cancelled (1 queued, 1 leased); 1 batch, audit id 1"
    )
    assert main(["dlq", "discard", "--id", str(a), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counts"] == {"discarded": 1}
    assert main(["cancel", "--id", str(a)]) == 2
    assert (
        capsys.readouterr().err == f"enrichq: cancel: not queued or leased: {a}; nothing changed\n"
    )
    assert main(["audit", "--json"]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["command"], e["actor"], e["rows_affected"]) for e in entries] == [
        ("dlq discard", audit.default_actor(), 1),
        ("cancel", "alice", 2),
    ]
    assert main(["audit", "--command", "cancel"]) == 0
    table = capsys.readouterr().out
    assert "alice" in table
    assert "tenant=acme" in table
    assert "dlq discard" not in table


def flat(out: str) -> str:
    """Printed text with the table's borders, spaces and wrapping taken out."""
    return re.sub(r"[\s│┃┏┓┗┛┡┩└┘━─┳┻╇┴┬]", "", out)


def test_keys_with_control_characters_are_shown_escaped(
    db_engine: sa.Engine,
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich's width when the output is not a terminal
    evil = "w\x1b[2J\nFAKE LOG LINE [bold]x"
    with db_engine.begin() as conn:  # stored before ingest refused such ids
        row(conn, evil, "dead_letter", tenant="t\u202eevil")
    settings = make_settings(db_url)
    flt = Filter.build(Scope.DEAD, keys=[evil])
    ctx = Context.given(settings, db_url)
    control_commands.run_action(
        ctx, AuditCommand.DLQ_REDRIVE, flt, actor="ops", dry_run=True, batch_size=1000
    )
    out = capsys.readouterr().out
    control_commands.dlq_list(ctx, reason=None, limit=10, as_json=False)
    table = capsys.readouterr().out
    for printed in (out, table):
        assert "\x1b" not in printed
        assert "\u202e" not in printed
        assert not any(line.startswith("FAKE") for line in printed.splitlines())
        # escaped, and rich markup shown as text rather than obeyed
        assert "w\\x1b[2J\\nFAKELOGLINE[bold]x" in flat(printed)
        assert "t\\u202eevil" in flat(printed)


def test_an_id_beyond_bigint_is_refused_by_name(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from enrichq_service.cli import main

    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    assert main(["cancel", "--id", str(2**63)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--id" in err
    assert "9223372036854775807" in err


def test_a_padded_tenant_is_refused_naming_what_was_meant(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from enrichq_service.cli import main

    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    assert main(["cancel", "--tenant", "acme ", "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "enrichq: cancel: --tenant: 'acme ' has spaces around it (did you mean 'acme'?);"
        " nothing changed\n"
    )


def test_an_action_stopped_by_the_statement_timeout_says_so_and_what_committed(
    db_engine: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Batch 2 waits for a row another transaction holds until the statement timeout stops
    it: the line names the timeout (not "database unavailable") and what batch 1 did."""
    with db_engine.begin() as conn:
        ids = [row(conn, f"T-{i}") for i in range(3)]
    blocker = db_engine.connect()
    blocker_tx = blocker.begin()
    blocker.execute(
        sa.text("SELECT 1 FROM enrichq.queue WHERE id = :id FOR UPDATE"), {"id": ids[1]}
    )
    settings = make_settings(db_url, statement_timeout_seconds=0.5)
    try:
        with pytest.raises(CommandError) as stopped:
            control_commands.run_action(
                Context.given(settings, db_url),
                AuditCommand.CANCEL,
                Filter.build(Scope.OPEN, all_rows=True),
                actor="ops",
                dry_run=False,
                batch_size=1,
            )
    finally:
        blocker_tx.rollback()
        blocker.close()
    assert stopped.value.code == 1
    err = str(stopped.value)
    [entry] = audit.recent(db_engine.connect(), limit=5)
    assert err == (
        "cancel: stopped during batch 2: a statement ran past the statement timeout"
        " (0.5 s, ENRICHQ_STATEMENT_TIMEOUT_SECONDS); the batches before it committed and stay"
        f" done: 1 cancelled (1 queued, 0 leased); 1 batch, audit id {entry.id}; run it again"
        " for the rest"
    )
    with db_engine.connect() as conn:
        assert [get(conn, i).state for i in ids] == ["dead_letter", "queued", "queued"]
    assert (entry.rows_affected, entry.finished_at) == (1, None)


def many_queued(engine: sa.Engine, n: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.queue (kind, key, reason, max_attempts)"
                " SELECT 'enrich', 'P-' || g, 'updated', 3 FROM generate_series(1, :n) AS g"
            ),
            {"n": n},
        )


def open_count(engine: sa.Engine) -> int:
    return int(
        seen_from_outside(engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'queued'")[0][0]
    )


@pytest.mark.parametrize(
    ("args", "answer", "asked", "code", "left"),
    [
        (["cancel", "--all"], "n\n", True, 1, 3),
        (["cancel", "--all"], "y\n", True, 0, 0),
        (["cancel", "--all", "--yes"], "", False, 0, 0),
        (["cancel", "--tenant", "acme"], "", False, 0, 3),  # not --all: no question
    ],
    ids=str,
)
def test_cancel_all_asks_on_a_terminal_unless_yes(
    *,
    db_engine: sa.Engine,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    answer: str,
    asked: bool,
    code: int,
    left: int,
) -> None:
    import io

    from enrichq_service.cli import main
    from enrichq_service.commands import progress

    many_queued(db_engine, 3)
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    monkeypatch.setattr("sys.stdin", io.StringIO(answer))
    monkeypatch.setattr(progress, "is_terminal", lambda stream: stream is sys.stdin)
    assert main(args) == code
    err = capsys.readouterr().err
    assert ("cancel 3 rows (3 queued) matching --all? [y/N]" in err) == asked
    if code == 1:
        assert err.endswith("enrichq: cancel: not confirmed; nothing changed\n")
    assert open_count(db_engine) == left


def test_dlq_discard_all_asks_too(
    db_engine: sa.Engine,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import io

    from enrichq_service.cli import main
    from enrichq_service.commands import progress

    with db_engine.begin() as conn:
        row(conn, "T-1", "dead_letter")
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))  # the default is no
    monkeypatch.setattr(progress, "is_terminal", lambda stream: stream is sys.stdin)
    assert main(["dlq", "discard", "--all"]) == 1
    assert "dlq discard 1 dead letter matching --all? [y/N]" in capsys.readouterr().err
    assert seen_from_outside(db_engine, "SELECT count(*) FROM enrichq.queue")[0][0] == 1


def test_a_long_run_reports_its_progress_in_plain_lines_when_not_on_a_terminal(
    db_engine: sa.Engine,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from enrichq_service.cli import main

    many_queued(db_engine, 2500)
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    assert main(["cancel", "--all"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("2500 rows matched --all: 2500 cancelled")
    lines = captured.err.splitlines()
    assert lines, "no progress"
    assert re.fullmatch(r"enrichq: cancel: 2,500/2,500 rows, [\d,]+ rows/s", lines[-1])
    assert all(line.startswith("enrichq: cancel: ") for line in lines)
