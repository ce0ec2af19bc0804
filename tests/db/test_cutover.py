"""Cutover and rollback against real Postgres: the gate, the record, the lock, live readers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.conftest import make_settings
from tests.db.test_parity import add_ticket, create_sources
from tests.support.procs import wait_for as shared_wait_for

from enrichq_parity.cutover import (
    SHADOW_TABLE,
    VIEW,
    CutoverError,
    CutoverRefused,
    CutoverResult,
    LatestRun,
    cutover,
    ensure_view,
    gate,
    rollback,
)
from enrichq_schema.db import create_engine
from enrichq_service.cli import main
from enrichq_service.settings import Settings

LEGACY_ROWS = 3
SHADOW_ROWS = 5


def build_world(conn: sa.Connection) -> None:
    """Legacy has 3 rows, the shadow 5: a reader can tell which table the view reads."""
    create_sources(conn)
    created = datetime.now(UTC) - timedelta(days=2)
    add_ticket(conn, "T-1", created_at=created, legacy=["A", "B", "C"], shadow=["A", "B", "C"])
    add_ticket(conn, "T-2", created_at=created, shadow=["D", "E"])


def add_run(conn: sa.Connection, *, passed: bool, age: timedelta = timedelta(minutes=5)) -> int:
    """A finished parity run, `age` old."""
    run_id: int = conn.execute(
        sa.text(
            "INSERT INTO enrichq.parity_runs (started_at, finished_at, window_since,"
            " window_until, tickets_compared, order_coverage, ticket_match_rate,"
            " min_order_coverage, min_ticket_match_rate, passed)"
            " VALUES (now() - CAST(:age AS interval), now() - CAST(:age AS interval),"
            " now() - interval '8 days', now() - interval '1 day', 100, :cov, :rate,"
            " 0.995, 0.99, :passed) RETURNING id"
        ),
        {
            "age": f"{age.total_seconds()} seconds",
            "cov": 1.0 if passed else 0.9,
            "rate": 1.0 if passed else 0.8,
            "passed": passed,
        },
    ).scalar_one()
    return run_id


def view_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        count: int = conn.execute(sa.text(f"SELECT count(*) FROM {VIEW}")).scalar_one()
    return count


def events(engine: sa.Engine) -> list[tuple[object, ...]]:
    """(action, target, parity_run_id, actor, note) of every cutover event, oldest first."""
    with engine.connect() as conn:
        return [
            tuple(row)
            for row in conn.execute(
                sa.text(
                    "SELECT action, target, parity_run_id, actor, note"
                    " FROM enrichq.cutover_events ORDER BY id"
                )
            )
        ]


@pytest.fixture
def world(db_engine: sa.Engine, db_url: str) -> tuple[sa.Engine, Settings]:
    with db_engine.begin() as conn:
        build_world(conn)
    return db_engine, make_settings(db_url)


def do_cutover(engine: sa.Engine, settings: Settings, actor: str = "alice") -> CutoverResult:
    with engine.begin() as conn:
        return cutover(conn, settings, actor=actor)


def do_rollback(engine: sa.Engine, settings: Settings, actor: str = "bob") -> CutoverResult:
    with engine.begin() as conn:
        return rollback(conn, settings, actor=actor)


# -- the gate -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (None, "no finished parity run: run `enrichq parity` first"),
        ({"passed": False}, "did not pass (order coverage 90.00%, ticket match rate 80.00%)"),
        ({"passed": True, "age": timedelta(hours=25)}, "older than ENRICHQ_PARITY_MAX_AGE_HOURS"),
    ],
    ids=["no-run", "failed-run", "stale-run"],
)
def test_cutover_refuses_and_changes_nothing(
    world: tuple[sa.Engine, Settings], setup: dict[str, object] | None, reason: str
) -> None:
    engine, settings = world
    if setup is not None:
        with engine.begin() as conn:
            add_run(conn, **setup)  # type: ignore[arg-type]
    with pytest.raises(CutoverRefused, match=reason.replace("(", r"\(").replace(")", r"\)")):
        do_cutover(engine, settings)
    assert events(engine) == []
    with engine.connect() as conn:  # the refused transaction even left the view uncreated
        assert conn.execute(sa.text("SELECT to_regclass(:v)"), {"v": VIEW}).scalar() is None


def test_the_latest_run_is_the_one_judged(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn, passed=True, age=timedelta(hours=2))
        add_run(conn, passed=False, age=timedelta(hours=1))
    with pytest.raises(CutoverRefused, match="did not pass"):
        do_cutover(engine, settings)


def test_gate_is_a_pure_decision() -> None:
    now = datetime(2024, 3, 10, tzinfo=UTC)
    fresh = LatestRun(7, now - timedelta(hours=23, minutes=59), True, 1.0, 1.0)
    assert gate(fresh, now, 24) is None
    stale = LatestRun(7, now - timedelta(hours=24), True, 1.0, 1.0)
    assert gate(stale, now, 24) == (
        "the latest parity run #7 finished 24.0 h ago, older than "
        "ENRICHQ_PARITY_MAX_AGE_HOURS (24): run `enrichq parity` again"
    )


# -- cutover, rollback ----------------------------------------------------------------------


def test_cutover_then_rollback(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        assert ensure_view(conn, settings) == "legacy.ticket_orders"
    assert view_count(engine) == LEGACY_ROWS
    with engine.begin() as conn:
        run_id = add_run(conn, passed=True)

    result = do_cutover(engine, settings, actor="alice")
    assert view_count(engine) == SHADOW_ROWS
    assert result.changed
    assert events(engine)[0] == (
        "cutover", SHADOW_TABLE, run_id, "alice", "was legacy.ticket_orders",
    )  # fmt: skip

    again = do_cutover(engine, settings)
    assert not again.changed
    assert len(events(engine)) == 1

    back = do_rollback(engine, settings, actor="bob")
    assert back.changed
    assert view_count(engine) == LEGACY_ROWS
    assert events(engine)[1] == (
        "rollback", "legacy.ticket_orders", run_id, "bob", f"was {SHADOW_TABLE}",
    )  # fmt: skip
    with engine.begin() as conn:
        assert ensure_view(conn, settings) == "legacy.ticket_orders"


def test_rollback_needs_no_parity_run(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    result = do_rollback(engine, settings)
    assert not result.changed
    assert view_count(engine) == LEGACY_ROWS  # the view now exists, on legacy
    assert events(engine) == []


def test_missing_legacy_table_is_a_clear_error(db_engine: sa.Engine, db_url: str) -> None:
    settings = make_settings(db_url, legacy_table="legacy.nowhere")
    with db_engine.begin() as conn:
        create_sources(conn)
    with pytest.raises(CutoverError, match=r"table legacy\.nowhere does not exist"):
        do_rollback(db_engine, settings)


def test_two_cutovers_at_once_record_one_event(world: tuple[sa.Engine, Settings]) -> None:
    """The advisory lock serializes them: the second finds the view already swapped."""
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn, passed=True)
        ensure_view(conn, settings)
    holder = engine.connect()
    try:
        # Hold the lock so both contenders queue on it, then let them go together.
        holder.execute(sa.text("SELECT pg_advisory_lock(hashtext('enrichq.cutover'))"))
        results: list[CutoverResult] = []
        threads = [
            threading.Thread(target=lambda: results.append(do_cutover(engine, settings)))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        wait_for(lambda: _lock_waiters(engine) == 2, "both cutovers to wait on the lock")
        holder.execute(sa.text("SELECT pg_advisory_unlock(hashtext('enrichq.cutover'))"))
        holder.commit()
        for t in threads:
            t.join(timeout=30)
    finally:
        holder.close()
    assert sorted(r.changed for r in results) == [False, True]
    assert len(events(engine)) == 1


def _lock_waiters(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        n: int = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        ).scalar_one()
    return n


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    shared_wait_for(condition, timeout=timeout, interval=0.02, what=what)


# -- readers during the swap ----------------------------------------------------------------


def test_readers_never_see_an_error_during_swaps(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn, passed=True)
        ensure_view(conn, settings)
    readers = create_engine(engine.url, pool_size=4, isolation_level="AUTOCOMMIT")
    stop = threading.Event()
    seen: set[int] = set()
    errors: list[BaseException] = []
    queries = [0]

    def read() -> None:
        try:
            with readers.connect() as conn:
                while not stop.is_set():
                    seen.add(conn.execute(sa.text(f"SELECT count(*) FROM {VIEW}")).scalar_one())
                    # the row shape stays the same too, so prepared statements survive swaps
                    conn.execute(sa.text(f"SELECT * FROM {VIEW} ORDER BY 1, 2 LIMIT 1")).one()
                    queries[0] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    swaps = 0
    try:
        deadline = time.monotonic() + 60
        while swaps < 20 or seen != {LEGACY_ROWS, SHADOW_ROWS} or queries[0] < 200:
            assert time.monotonic() < deadline, f"after {swaps} swaps readers saw {seen}"
            do_cutover(engine, settings)
            do_rollback(engine, settings)
            swaps += 2
            if errors:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        readers.dispose()
    assert errors == []
    assert seen == {LEGACY_ROWS, SHADOW_ROWS}
    assert len(events(engine)) == swaps


# -- the command line -----------------------------------------------------------------------


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, db_url: str) -> str:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    return db_url


def test_cli_refuses_with_exit_1(
    cli_env: str, world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cutover"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("enrichq: cutover refused: no finished parity run: run `enrichq parity` first")


def test_cli_bad_actor_is_exit_2(
    cli_env: str, world: tuple[sa.Engine, Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cutover", "--actor", "  "]) == 2
    assert capsys.readouterr().err.startswith("enrichq: cutover: --actor must be")


def test_cli_parity_then_cutover_then_rollback(
    cli_env: str,
    world: tuple[sa.Engine, Settings],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine, _ = world
    with engine.begin() as conn:  # make parity pass: legacy gets what the shadow found
        conn.execute(sa.text("DELETE FROM enrichq.ticket_orders WHERE ticket_id = 'T-2'"))
    assert main(["parity", "--json", str(tmp_path / "p.json")]) == 0
    assert main(["cutover", "--actor", "carol"]) == 0
    out = capsys.readouterr().out
    assert f"cutover: {VIEW} now reads {SHADOW_TABLE} (was legacy.ticket_orders)" in out
    assert "by carol" in out
    assert main(["cutover", "--rollback", "--actor", "carol"]) == 0
    assert f"now reads legacy.ticket_orders again (was {SHADOW_TABLE})" in capsys.readouterr().out
    assert [(e[0], e[3]) for e in events(engine)] == [
        ("cutover", "carol"), ("rollback", "carol"),
    ]  # fmt: skip
