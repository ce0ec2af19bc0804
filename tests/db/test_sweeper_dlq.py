"""Dead letters: `enrichq dlq list` and `enrichq dlq redrive` (DESIGN §3, redrive).

Redrive is one of the filtered operator controls; cancel and discard, the filter language
and the batching are in test_controls.py.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.settings import make_settings

from enrichq_schema.states import AuditCommand
from enrichq_schema.tables import queue
from enrichq_service.commands import controls as control_commands
from enrichq_service.commands.base import CommandError, Context
from enrichq_service.controls import actions as controls
from enrichq_service.controls import dlq
from enrichq_service.controls.actions import sql as controls_sql
from enrichq_service.controls.errors import DlqInputError, FilterError
from enrichq_service.controls.filters import Filter, Scope

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)


def dead(
    conn: sa.Connection,
    key: str,
    reason: str = "attempts_exhausted",
    *,
    kind: str = "enrich",
    superseded_by: int | None = None,
) -> int:
    """A dead letter that used 3 of 3 attempts and died an hour before T0."""
    return int(
        conn.execute(
            sa.insert(queue)
            .values(
                kind=kind,
                key=key,
                reason="created",
                state="dead_letter",
                attempts=3,
                max_attempts=3,
                visible_at=T0 - timedelta(hours=2),
                finished_at=T0 - timedelta(hours=1),
                dead_reason=reason,
                superseded_by=superseded_by,
                last_error="warehouse timeout",
            )
            .returning(queue.c.id)
        ).scalar_one()
    )


def queued(conn: sa.Connection, key: str) -> int:
    return int(
        conn.execute(
            sa.insert(queue)
            .values(kind="enrich", key=key, reason="updated", state="queued", max_attempts=3)
            .returning(queue.c.id)
        ).scalar_one()
    )


def get(conn: sa.Connection, row_id: int) -> sa.Row[tuple[object, ...]]:
    return conn.execute(sa.select(queue).where(queue.c.id == row_id)).one()


def states(conn: sa.Connection) -> dict[int, str]:
    return {r.id: r.state for r in conn.execute(sa.select(queue.c.id, queue.c.state))}


# -- list


def test_list_is_newest_first_and_filters_by_reason(conn: sa.Connection) -> None:
    a = dead(conn, "T-1")
    b = dead(conn, "T-2", "superseded")
    c = dead(conn, "T-3")
    queued(conn, "T-4")
    assert [d.id for d in dlq.list_dead(conn)] == [c, b, a]
    assert [d.id for d in dlq.list_dead(conn, reason="attempts_exhausted")] == [c, a]
    assert [d.id for d in dlq.list_dead(conn, reason="superseded")] == [b]
    assert [d.id for d in dlq.list_dead(conn, limit=1)] == [c]
    first = dlq.list_dead(conn)[0]
    assert (first.key, first.dead_reason, first.attempts, first.last_error) == (
        "T-3",
        "attempts_exhausted",
        3,
        "warehouse timeout",
    )


def test_list_refuses_bad_input(conn: sa.Connection) -> None:
    with pytest.raises(DlqInputError, match="unknown dead reason 'tired'"):
        dlq.list_dead(conn, reason="tired")
    with pytest.raises(DlqInputError, match="limit"):
        dlq.list_dead(conn, limit=0)


def test_list_cli_prints_json_lines_and_a_table(
    db_engine: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with db_engine.begin() as conn:
        a = dead(conn, "T-1")
        b = dead(conn, "T-2", "superseded", superseded_by=a)
    settings = make_settings(db_url)
    control_commands.dlq_list(Context.given(settings, db_url), reason=None, limit=10, as_json=True)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["id"], r["dead_reason"], r["superseded_by"]) for r in lines] == [
        (b, "superseded", a),
        (a, "attempts_exhausted", None),
    ]
    control_commands.dlq_list(
        Context.given(settings, db_url), reason="superseded", limit=10, as_json=False
    )
    table = capsys.readouterr().out
    assert "T-2" in table
    assert "T-1" not in table


def test_a_superseder_that_retention_pruned_is_shown_as_pruned(
    db_engine: sa.Engine,
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dead letters are kept 90 days, the done rows that superseded them 30: the listing
    must not name a row that no longer exists as if it did."""
    with db_engine.begin() as conn:
        kept = queued(conn, "T-1")
        gone = queued(conn, "T-2")
        alive = dead(conn, "T-1", "superseded", superseded_by=kept)
        orphan = dead(conn, "T-2", "superseded", superseded_by=gone)
        conn.execute(sa.delete(queue).where(queue.c.id == gone))  # what retention does
    settings = make_settings(db_url)
    control_commands.dlq_list(Context.given(settings, db_url), reason=None, limit=10, as_json=True)
    lines = {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert (lines[alive]["superseded_by"], lines[alive]["superseded_by_state"]) == (kept, "queued")
    assert (lines[orphan]["superseded_by"], lines[orphan]["superseded_by_state"]) == (gone, None)
    monkeypatch.setenv("COLUMNS", "200")  # a terminal wide enough for every column
    control_commands.dlq_list(Context.given(settings, db_url), reason=None, limit=10, as_json=False)
    table = capsys.readouterr().out
    assert f"{gone} (pruned)" in table
    assert f"{kept} (queued)" in table


def test_list_cli_bad_reason_is_a_one_line_error(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = Context.given(make_settings(db_url), db_url)
    with pytest.raises(CommandError) as refused:
        control_commands.dlq_list(ctx, reason="tired", limit=10, as_json=True)
    assert refused.value.code == 2
    assert str(refused.value).startswith("unknown dead reason")
    assert "\n" not in str(refused.value)
    assert capsys.readouterr().out == ""


# -- redrive


def redrive(conn: sa.Connection, batch_size: int = 1000, **criteria: Any) -> Counter[str]:
    """What `enrichq dlq redrive` does, batch by batch, inside the test's transaction."""
    flt = Filter.build(Scope.DEAD, **criteria)
    selection = controls.select(conn, flt, now=T0)
    done: Counter[str] = Counter()
    for start in range(0, len(selection.ids), batch_size):
        ids = selection.ids[start : start + batch_size]
        winners = selection.winners[start : start + batch_size]
        done.update(controls.redrive_batch(conn, flt, ids, winners, now=T0))
    return done


def test_redrive_by_id_resets_the_row(conn: sa.Connection) -> None:
    row_id = dead(conn, "T-1")
    other = dead(conn, "T-2")
    assert redrive(conn, ids=[row_id]) == {"redriven": 1, "merged": 0}
    row = get(conn, row_id)
    assert (row.state, row.attempts, row.max_attempts, row.reason) == ("queued", 0, 3, "redrive")
    assert (row.visible_at, row.updated_at) == (T0, T0)
    assert (row.dead_reason, row.superseded_by, row.finished_at) == (None, None, None)
    # kept: why it died, until the next attempt says otherwise
    assert row.last_error == "warehouse timeout"
    assert get(conn, other).state == "dead_letter"


def test_redrive_by_reason_and_all(conn: sa.Connection) -> None:
    exhausted = dead(conn, "T-1")
    superseded = dead(conn, "T-2", "superseded")
    assert redrive(conn, reason="superseded")["redriven"] == 1
    assert get(conn, superseded).state == "queued"
    assert get(conn, exhausted).state == "dead_letter"
    more = dead(conn, "T-3", "superseded")
    assert redrive(conn, all_rows=True)["redriven"] == 2
    assert {get(conn, i).state for i in (exhausted, more)} == {"queued"}
    assert set(states(conn).values()) == {"queued"}


def test_redrive_merges_into_a_queued_row_of_the_key(conn: sa.Connection) -> None:
    row_id = dead(conn, "T-1")
    queued(conn, "T-1")
    assert redrive(conn, ids=[row_id]) == {"redriven": 0, "merged": 1}
    assert get(conn, row_id).state == "dead_letter"
    assert get(conn, row_id).dead_reason == "attempts_exhausted"


@pytest.mark.parametrize("batch_size", [1, 2, 1000])
def test_several_dead_letters_of_one_key_only_the_newest_is_queued(
    conn: sa.Connection, batch_size: int
) -> None:
    # in lock order (key, kind, id) T-1's rows come first, oldest first: with batches of
    # one or two rows the older row of T-1 is worked before the newer one is even read
    older = dead(conn, "T-1")
    other_key = dead(conn, "T-2")
    newer = dead(conn, "T-1", "superseded")
    assert redrive(conn, batch_size, all_rows=True) == {"redriven": 2, "merged": 1}
    assert states(conn) == {older: "dead_letter", other_key: "queued", newer: "queued"}


def test_redrive_of_one_kind_leaves_the_other_kind_of_the_ticket(conn: sa.Connection) -> None:
    enrich = dead(conn, "T-1")
    refresh = dead(conn, "T-1", kind="refresh")
    assert redrive(conn, kind="refresh") == {"redriven": 1, "merged": 0}
    assert states(conn) == {enrich: "dead_letter", refresh: "queued"}


def test_redrive_of_ids_that_are_not_dead_letters_changes_nothing(conn: sa.Connection) -> None:
    row_id = dead(conn, "T-1")
    live = queued(conn, "T-2")
    with pytest.raises(FilterError, match=f"not dead letters: {live}, 999999"):
        redrive(conn, ids=[row_id, live, 999999])
    assert get(conn, row_id).state == "dead_letter"


def test_redrive_needs_a_filter(conn: sa.Connection) -> None:
    with pytest.raises(FilterError, match="give a filter"):
        redrive(conn)
    with pytest.raises(FilterError, match="--all selects every row"):
        redrive(conn, ids=[1], all_rows=True)
    with pytest.raises(FilterError, match="not a dead reason"):
        redrive(conn, reason="created")


def test_redrive_cli_dry_run_reports_and_changes_nothing(
    db_engine: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with db_engine.begin() as conn:
        a = dead(conn, "T-1")
        b = dead(conn, "T-1")
        c = dead(conn, "T-2", "superseded")
        before = conn.execute(sa.select(queue).order_by(queue.c.id)).all()
    flt = Filter.build(Scope.DEAD, all_rows=True)
    ctx = Context.given(make_settings(db_url), db_url)
    control_commands.run_action(
        ctx, AuditCommand.DLQ_REDRIVE, flt, actor="ops", dry_run=True, batch_size=1000
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "3 dead letters match --all; would redrive 2 and merge 1 (left dead: their ticket has"
        " a newer match or a queued row) (dry run: nothing changed)"
    )
    shown = [int(m) for m in re.findall(r"^│\s*(\d+) │", out, re.MULTILINE)]
    assert shown == [c, b, a]  # the sample, a ticket's dead letters together, newest first
    with db_engine.connect() as conn:
        assert conn.execute(sa.select(queue).order_by(queue.c.id)).all() == before
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.audit_log")).scalar() == 0


def test_a_redrive_dry_run_says_what_the_run_then_does_in_text_and_json(
    db_engine: sa.Engine,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Four dead letters, one redriven: two of a ticket (the older merges into the newer),
    and one of a ticket that has a queued row (it merges into that row)."""
    from enrichq_service.cli import main

    with db_engine.begin() as conn:
        dead(conn, "T-1")
        dead(conn, "T-1")
        dead(conn, "T-2", "superseded")
        queued(conn, "T-2")
        dead(conn, "T-3", "cancelled", kind="refresh")
        dead(conn, "T-3", "cancelled", kind="refresh")
        queued(conn, "T-3")  # of kind enrich: not the refresh rows' ticket-and-kind
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    assert main(["dlq", "redrive", "--all", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "5 dead letters match --all; would redrive 2 and merge 3 (left dead: their ticket has"
        " a newer match or a queued row) (dry run: nothing changed)"
    )
    assert main(["dlq", "redrive", "--all", "--dry-run", "--json"]) == 0
    would = json.loads(capsys.readouterr().out)
    assert (would["dry_run"], would["counts"], would["affected"]) == (
        True,
        {"redriven": 2, "merged": 3},
        2,
    )
    assert main(["dlq", "redrive", "--all", "--json"]) == 0
    did = json.loads(capsys.readouterr().out)
    assert (did["dry_run"], did["counts"], did["affected"]) == (False, would["counts"], 2)


def test_a_selection_read_in_pages_keeps_a_tickets_newest_dead_letter_as_its_winner(
    db_engine: sa.Engine,
) -> None:
    """Pages of two rows: T-1's three dead letters span two pages, and only its newest is
    redriven; the selection is the same whatever the page size."""
    with db_engine.begin() as conn:
        t1 = [dead(conn, "T-1") for _ in range(3)]
        t2 = dead(conn, "T-2")
        t0 = dead(conn, "T-0")
    flt = Filter.build(Scope.DEAD, all_rows=True)
    with db_engine.connect() as conn:
        whole = controls.select(conn, flt)
        paged = controls.select(conn, flt, page_size=2)
    assert list(paged.ids) == list(whole.ids) == [t2, *reversed(t1), t0]
    assert list(paged.winners) == list(whole.winners) == [t2, t1[2], t1[2], t1[2], t0]
    result = controls.run(db_engine, AuditCommand.DLQ_REDRIVE, flt, actor="ops", page_size=2)
    assert result.counts == {"redriven": 3, "merged": 2}
    with db_engine.connect() as conn:
        assert [get(conn, i).state for i in t1] == ["dead_letter", "dead_letter", "queued"]


def test_redrive_cli_commits_reports_and_audits(
    db_engine: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with db_engine.begin() as conn:
        a = dead(conn, "T-1")
        b = dead(conn, "T-1")
    flt = Filter.build(Scope.DEAD, keys=["T-1"])
    ctx = Context.given(make_settings(db_url), db_url)
    control_commands.run_action(
        ctx, AuditCommand.DLQ_REDRIVE, flt, actor="ops", dry_run=False, batch_size=1000
    )
    assert capsys.readouterr().out.startswith(
        "2 dead letters matched --key T-1: 1 redriven, 1 merged"
    )
    with db_engine.connect() as conn:
        assert (get(conn, a).state, get(conn, b).state) == ("dead_letter", "queued")
        entry = conn.execute(sa.text("SELECT * FROM enrichq.audit_log")).one()
    assert (entry.command, entry.actor, entry.rows_affected) == ("dlq redrive", "ops", 1)
    assert entry.filter == {"scope": "dead", "keys": ["T-1"]}
    assert entry.detail == {"matched": 2, "redriven": 1, "merged": 1}
    assert entry.finished_at is not None


def test_redrive_cli_bad_id_is_a_one_line_error_and_changes_nothing(
    db_engine: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with db_engine.begin() as conn:
        a = dead(conn, "T-1")
    flt = Filter.build(Scope.DEAD, ids=[a, a + 1])
    ctx = Context.given(make_settings(db_url), db_url)
    with pytest.raises(CommandError) as refused:
        control_commands.run_action(
            ctx, AuditCommand.DLQ_REDRIVE, flt, actor="ops", dry_run=False, batch_size=1000
        )
    assert refused.value.code == 2
    assert str(refused.value) == f"dlq redrive: not dead letters: {a + 1}; nothing changed"
    with db_engine.connect() as conn:
        assert get(conn, a).state == "dead_letter"
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.audit_log")).scalar() == 0


def test_listing_by_reason_uses_the_dead_letter_index(conn: sa.Connection) -> None:
    dead(conn, "T-1")
    conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
    plan = conn.execute(
        sa.text("EXPLAIN (FORMAT JSON) " + controls_sql()["dlq_list_by_reason"].sql),
        {"reason": "superseded", "limit": 10},
    ).scalar_one()
    assert "queue_dead_reason_idx" in json.dumps(plan)


def test_the_cli_commands_reach_the_sweeper(
    db_engine: sa.Engine,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from enrichq_service.cli import main

    with db_engine.begin() as conn:
        a = dead(conn, "T-1")
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    assert main(["dlq", "list", "--json", "--reason", "attempts_exhausted"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == a
    assert main(["dlq", "redrive", "--id", str(a), "--dry-run"]) == 0
    assert "would redrive it" in capsys.readouterr().out
    assert main(["dlq", "redrive", "--id", str(a + 1)]) == 2
    assert "not dead letters" in capsys.readouterr().err
    assert main(["dlq", "redrive", "--reason", "attempts_exhausted", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["matched"], result["counts"]) == (1, {"redriven": 1, "merged": 0})
    with db_engine.connect() as conn:
        assert get(conn, a).state == "queued"
