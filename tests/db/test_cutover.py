"""Cutover and rollback against real Postgres: the gate's refusals, whole and per-tenant
moves, the record of every step, the status, the lock, and readers during the swaps."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.parity_world import add_ticket, create_sources
from tests.support.plans import walk
from tests.support.procs import wait_for
from tests.support.settings import make_settings

from enrichq_parity.cutover import (
    SHADOW_TABLE,
    VIEW,
    Action,
    CutoverError,
    CutoverRefused,
    CutoverResult,
    ViewMode,
    ViewState,
    ensure_view,
    repoint,
    status,
)
from enrichq_parity.model import Coverage, Tally, Thresholds
from enrichq_schema.db import create_engine
from enrichq_schema.settings import Settings
from enrichq_service.cli import main

TENANTS = ("acme", "globex", "initech")
NO_TICKETS = Coverage(())
TICKETS_PER_TENANT = 3
BARS = Thresholds(0.995, 0.005, 0.99)
GOOD = Tally(exact=100, legacy_orders=300, matched_orders=300)


def build_world(conn: sa.Connection) -> None:
    """Three tickets per tenant; legacy and enrichq name their orders apart (L-… and S-…),
    so a reader can tell which side each row comes from."""
    create_sources(conn)
    created = datetime.now(UTC) - timedelta(days=2)
    for tenant in TENANTS:
        for i in range(TICKETS_PER_TENANT):
            ticket = f"{tenant}-{i}"
            add_ticket(
                conn, ticket, created_at=created, tenant=tenant,
                legacy=[f"L-{ticket}-{k}" for k in range(2)],
                shadow=[f"S-{ticket}-{k}" for k in range(3)],
            )  # fmt: skip


def add_run(
    conn: sa.Connection,
    *,
    tenants: Mapping[str, Tally] | None = None,
    age: timedelta = timedelta(minutes=5),
    approved_by: Sequence[str] = ("alice",),
    max_shadow_fault_rate: float | None = 0.005,
    coverage: Coverage | None = NO_TICKETS,
    window: timedelta = timedelta(days=7),
) -> int:
    """A finished parity run `age` old over a `window` ending when it ran, with these
    per-tenant figures (default: every tenant of the world matching) and `coverage`,
    approved by `approved_by`."""
    per_tenant = dict(tenants if tenants is not None else dict.fromkeys(TENANTS, GOOD))
    whole = sum(per_tenant.values(), Tally())
    report = {
        "total": whole.as_dict(),
        "tenants": [{"tenant": t, **tally.as_dict()} for t, tally in per_tenant.items()],
    }
    run_id: int = conn.execute(
        sa.text(
            "INSERT INTO enrichq.parity_runs (started_at, finished_at, window_since,"
            " window_until, tickets_compared, order_coverage, ticket_match_rate,"
            " min_order_coverage, min_ticket_match_rate, max_shadow_fault_rate, passed, report,"
            " data_at, coverage)"
            " VALUES (now() - CAST(:age AS interval), now() - CAST(:age AS interval),"
            " now() - CAST(:age AS interval) - CAST(:window AS interval),"
            " now() - CAST(:age AS interval), :compared, :cov, :rate,"
            " 0.995, 0.99, :max_faults, :passed, CAST(:report AS jsonb),"
            " now() - CAST(:age AS interval), CAST(:coverage AS jsonb)) RETURNING id"
        ),
        {
            "age": f"{age.total_seconds()} seconds",
            "window": f"{window.total_seconds()} seconds",
            "coverage": None if coverage is None else json.dumps(coverage.as_dict()),
            "compared": whole.compared,
            "cov": whole.order_coverage,
            "rate": whole.ticket_match_rate,
            "max_faults": max_shadow_fault_rate,
            "passed": whole.shadow_fault_rate is not None and whole.shadow_fault_rate <= 0.005,
            "report": json.dumps(report),
        },
    ).scalar_one()
    for name in approved_by:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.parity_approvals (parity_run_id, approved_by, reviewer_key)"
                " VALUES (:id, :by, lower(:by))"
            ),
            {"id": run_id, "by": name},
        )
    return run_id


def sides(engine: sa.Engine | sa.Connection) -> dict[str, str]:
    """Per tenant, which side the view shows: 'legacy', 'shadow' or 'mixed'."""

    def read(conn: sa.Connection) -> dict[str, str]:
        rows = conn.execute(sa.text(f"SELECT ticket_id, order_id FROM {VIEW}")).all()
        seen: dict[str, set[str]] = {}
        for ticket, order in rows:
            seen.setdefault(ticket.rsplit("-", 1)[0], set()).add(order[0])
        return {
            t: {"L": "legacy", "S": "shadow"}[next(iter(s))] if len(s) == 1 else "mixed"
            for t, s in seen.items()
        }

    if isinstance(engine, sa.Connection):
        return read(engine)
    with engine.connect() as conn:
        return read(conn)


def events(engine: sa.Engine) -> list[tuple[object, ...]]:
    """(action, tenant, target, parity_run_id, actor) of every event, oldest first."""
    with engine.connect() as conn:
        return [
            tuple(row)
            for row in conn.execute(
                sa.text(
                    "SELECT action, tenant, target, parity_run_id, actor"
                    " FROM enrichq.cutover_events ORDER BY id"
                )
            )
        ]


def view_exists(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT to_regclass(:v)"), {"v": VIEW}).scalar() is not None


@pytest.fixture
def world(db_engine: sa.Engine, db_url: str) -> tuple[sa.Engine, Settings]:
    with db_engine.begin() as conn:
        build_world(conn)
    return db_engine, make_settings(db_url)


def move(
    engine: sa.Engine,
    settings: Settings,
    action: Action,
    tenants: Sequence[str] | None = None,
    actor: str = "alice",
) -> CutoverResult:
    with engine.begin() as conn:
        return repoint(conn, settings, action=action, tenants=tenants, actor=actor)


ALL_LEGACY = dict.fromkeys(TENANTS, "legacy")
ALL_SHADOW = dict.fromkeys(TENANTS, "shadow")
FAULTY = Tally(exact=90, partial=10, legacy_orders=300, matched_orders=290)
UNACCEPTED = Tally(exact=95, legacy_missing=3, extra_only=2, legacy_orders=300, matched_orders=300)

# -- refusals change nothing -----------------------------------------------------------------


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, db_url: str) -> str:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    return db_url


REFUSED_RUNS: dict[str, tuple[dict[str, object] | None, str]] = {
    "no run": (None, "no finished parity run: run `enrichq parity` first"),
    "failed": (
        {"tenants": {"acme": FAULTY, "globex": GOOD}},
        "did not pass for tenant acme (order coverage 96.67% is below 99.50%",
    ),
    "stale": ({"age": timedelta(hours=25)}, "older than ENRICHQ_PARITY_MAX_AGE_HOURS (24)"),
    "window too short": (
        {"window": timedelta(days=1)},
        "covers 1.0 days, shorter than ENRICHQ_PARITY_WINDOW_DAYS (7)",
    ),
    "not approved": ({"approved_by": ()}, "is not approved: review its report, then"),
}


@pytest.mark.parametrize("case", REFUSED_RUNS, ids=list(REFUSED_RUNS))
def test_a_refused_cutover_changes_nothing(
    cli_env: str,
    world: tuple[sa.Engine, Settings],
    capsys: pytest.CaptureFixture[str],
    case: str,
) -> None:
    engine, _ = world
    setup, reason = REFUSED_RUNS[case]
    run_id = None
    if setup is not None:
        with engine.begin() as conn:
            run_id = add_run(conn, **setup)  # type: ignore[arg-type]  # parametrized keyword arguments
    assert main(["cutover", "--tenant", "acme"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    prefix = "enrichq: cutover refused: " + ("" if run_id is None else f"parity run #{run_id} ")
    assert err.startswith(prefix)
    assert reason in err
    assert events(engine) == []
    assert not view_exists(engine)  # the refused transaction even left the view uncreated


def test_the_latest_run_is_the_one_judged(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn, age=timedelta(hours=2))
        add_run(conn, age=timedelta(hours=1), approved_by=())
    with pytest.raises(CutoverRefused, match="is not approved"):
        move(engine, settings, Action.CUTOVER, ["acme"])


def test_moving_two_tenants_is_all_or_nothing(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn, tenants={"acme": GOOD, "globex": UNACCEPTED, "initech": GOOD})
    with pytest.raises(CutoverRefused, match="for tenant globex that no accepted rule covers"):
        move(engine, settings, Action.CUTOVER, ["acme", "globex"])
    assert events(engine) == []
    result = move(engine, settings, Action.CUTOVER, ["acme", "initech"])
    assert result.changed
    assert sides(engine) == {"acme": "shadow", "globex": "legacy", "initech": "shadow"}


# -- staged, per tenant ----------------------------------------------------------------------


def test_a_tenant_moves_alone_and_back(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        assert ensure_view(conn, settings) == ViewState(ViewMode.LEGACY)
        run_id = add_run(conn)
    assert sides(engine) == ALL_LEGACY

    result = move(engine, settings, Action.CUTOVER, ["acme"], actor="carol")
    assert result.changed
    assert result.state == ViewState(ViewMode.STAGED, frozenset({"acme"}))
    assert sides(engine) == {"acme": "shadow", "globex": "legacy", "initech": "legacy"}
    assert "tenant acme now reads enrichq.ticket_orders;" in result.message
    assert f"parity run #{run_id} passed 0.1 h ago, approved by alice; event #" in result.message
    assert events(engine) == [("cutover", "acme", SHADOW_TABLE, run_id, "carol")]

    again = move(engine, settings, Action.CUTOVER, ["acme"])
    assert (again.changed, again.message) == (
        False, "tenant acme already reads enrichq's rows; nothing changed",
    )  # fmt: skip
    move(engine, settings, Action.CUTOVER, ["globex"])
    assert sides(engine) == {"acme": "shadow", "globex": "shadow", "initech": "legacy"}

    back = move(engine, settings, Action.ROLLBACK, ["acme"], actor="dave")
    assert back.state == ViewState(ViewMode.STAGED, frozenset({"globex"}))
    assert sides(engine) == {"acme": "legacy", "globex": "shadow", "initech": "legacy"}
    move(engine, settings, Action.ROLLBACK, ["globex"], actor="dave")
    assert sides(engine) == ALL_LEGACY
    with engine.connect() as conn:
        # the last tenant back: the view reads the legacy table alone again
        assert ensure_view(conn, settings) == ViewState(ViewMode.LEGACY)
        assert (
            conn.execute(sa.text("SELECT count(*) FROM enrichq_public.cutover_tenants")).scalar()
            == 0
        )
        conn.rollback()
    assert [e[:2] for e in events(engine)] == [
        ("cutover", "acme"), ("cutover", "globex"), ("rollback", "acme"), ("rollback", "globex"),
    ]  # fmt: skip


def test_a_ticket_the_mirror_does_not_have_reads_legacy(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn)
        conn.execute(
            sa.text("INSERT INTO legacy.ticket_orders VALUES ('acme-orphan', 'L-x', now())")
        )
    move(engine, settings, Action.CUTOVER, ["acme"])
    with engine.connect() as conn:
        orphan = (
            conn.execute(sa.text(f"SELECT order_id FROM {VIEW} WHERE ticket_id = 'acme-orphan'"))
            .scalars()
            .all()
        )
    assert orphan == ["L-x"]


def test_whole_cutover_and_rollback(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        run_id = add_run(conn)
    move(engine, settings, Action.CUTOVER, ["acme"])
    whole = move(engine, settings, Action.CUTOVER, None, actor="erin")
    assert whole.state == ViewState(ViewMode.SHADOW)
    assert whole.message.startswith(
        f"every tenant now reads {SHADOW_TABLE}; {VIEW} reads {SHADOW_TABLE} for every tenant;"
    )
    assert sides(engine) == ALL_SHADOW
    with pytest.raises(
        CutoverRefused, match="roll every tenant back with `enrichq cutover --rollback`"
    ):
        move(engine, settings, Action.ROLLBACK, ["acme"])
    back = move(engine, settings, Action.ROLLBACK, None, actor="frank")
    assert back.state == ViewState(ViewMode.LEGACY)
    assert sides(engine) == ALL_LEGACY
    assert not move(engine, settings, Action.ROLLBACK, None).changed
    assert events(engine) == [
        ("cutover", "acme", SHADOW_TABLE, run_id, "alice"),
        ("cutover", None, SHADOW_TABLE, run_id, "erin"),
        ("rollback", None, "legacy.ticket_orders", run_id, "frank"),
    ]


def test_a_full_rollback_takes_a_staged_cutover_back(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn)
    move(engine, settings, Action.CUTOVER, ["acme", "globex"])
    back = move(engine, settings, Action.ROLLBACK, None)
    assert back.state == ViewState(ViewMode.LEGACY)
    assert sides(engine) == ALL_LEGACY
    assert events(engine)[-1][:2] == ("rollback", None)


def test_rollback_needs_no_parity_run(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    result = move(engine, settings, Action.ROLLBACK)
    assert not result.changed
    assert sides(engine) == ALL_LEGACY  # the view now exists, on legacy
    assert events(engine) == []


def test_missing_tables_are_clear_errors(db_engine: sa.Engine, db_url: str) -> None:
    with db_engine.begin() as conn:
        create_sources(conn)
        add_run(conn)
    with pytest.raises(CutoverError, match=r"table legacy\.nowhere does not exist"):
        move(db_engine, make_settings(db_url, legacy_table="legacy.nowhere"), Action.ROLLBACK)
    with pytest.raises(
        CutoverError, match=r"table helpdesk\.nowhere does not exist \(ENRICHQ_TICKETS_TABLE\)"
    ):
        move(
            db_engine,
            make_settings(db_url, tickets_table="helpdesk.nowhere"),
            Action.CUTOVER,
            ["acme"],
        )
    assert events(db_engine) == []


def test_two_cutovers_at_once_record_one_event(world: tuple[sa.Engine, Settings]) -> None:
    """The advisory lock serializes them: the second finds the tenant already moved."""
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn)
        ensure_view(conn, settings)
    holder = engine.connect()
    try:
        # Hold the lock so both contenders queue on it, then let them go together.
        holder.execute(sa.text("SELECT pg_advisory_lock(hashtext('enrichq.cutover'))"))
        results: list[CutoverResult] = []
        threads = [
            threading.Thread(
                target=lambda: results.append(move(engine, settings, Action.CUTOVER, ["acme"]))
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        wait_for(lambda: _lock_waiters(engine) == 2, what="both cutovers to wait on the lock")
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


# -- readers during the swaps ----------------------------------------------------------------


def test_readers_see_one_side_per_tenant_during_swaps(world: tuple[sa.Engine, Settings]) -> None:
    """Readers on connections of their own read the whole view and single tickets while
    tenants move back and forth (and the view changes mode): never an error, never a
    tenant half on one side, and both sides seen."""
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn)
        ensure_view(conn, settings)
    readers = create_engine(engine.url, pool_size=4, isolation_level="AUTOCOMMIT")
    stop = threading.Event()
    seen: set[str] = set()
    errors: list[BaseException] = []
    reads = [0]

    def read() -> None:
        try:
            with readers.connect() as conn:
                while not stop.is_set():
                    per_tenant = sides(conn)
                    if set(per_tenant) != set(TENANTS) or "mixed" in per_tenant.values():
                        raise AssertionError(f"a reader saw {per_tenant}")
                    seen.add(per_tenant["acme"])
                    # one ticket: every row from one side, the same shape whatever the mode
                    rows = conn.execute(
                        sa.text(f"SELECT * FROM {VIEW} WHERE ticket_id = 'acme-1' ORDER BY 2")
                    ).all()
                    if {r.order_id[0] for r in rows} not in ({"L"}, {"S"}) or len(rows) not in (
                        2,
                        3,
                    ):
                        raise AssertionError(f"acme-1 read as {rows}")
                    reads[0] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    steps = 0
    try:
        deadline = time.monotonic() + 60
        while steps < 24 or seen != {"legacy", "shadow"} or reads[0] < 200:
            assert time.monotonic() < deadline, f"after {steps} steps readers saw {seen}"
            move(engine, settings, Action.CUTOVER, ["acme"])  # legacy → staged
            move(engine, settings, Action.CUTOVER, ["globex"])  # staged → staged
            move(engine, settings, Action.ROLLBACK, ["globex"])
            move(engine, settings, Action.ROLLBACK, ["acme"])  # staged → legacy
            steps += 4
            if errors:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        readers.dispose()
    assert errors == []
    assert seen == {"legacy", "shadow"}
    assert len(events(engine)) == steps


# -- reading one ticket stays an index lookup ------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "staged", "shadow"])
def test_reading_one_ticket_through_the_view_is_an_index_lookup(
    db_engine: sa.Engine, db_url: str, mode: str
) -> None:
    """With 20,000 tickets analyzed, a read of one ticket by id touches each big table by an
    index, whatever the view reads (the tenant list is small: a scan of it is fine)."""
    engine, settings = db_engine, make_settings(db_url)
    with engine.begin() as conn:
        create_sources(conn)
        conn.execute(
            sa.text(
                "INSERT INTO helpdesk.tickets SELECT 'T-' || g, 'x@example.com',"
                " 'tenant-' || (g % 20), now() - interval '2 days', now()"
                " FROM generate_series(1, 20000) AS g"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO legacy.ticket_orders SELECT 'T-' || g, 'O-' || g || '-' || k, now()"
                " FROM generate_series(1, 20000) AS g, generate_series(1, 3) AS k"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_orders (ticket_id, order_id, looked_up_at, queue_id)"
                " SELECT 'T-' || g, 'O-' || g || '-' || k, now(), g"
                " FROM generate_series(1, 20000) AS g, generate_series(1, 3) AS k"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_enrichments (ticket_id, enriched_at, order_count,"
                " queue_id) SELECT 'T-' || g, now(), 3, g FROM generate_series(1, 20000) AS g"
            )
        )
        add_run(conn, tenants={f"tenant-{i}": GOOD for i in range(20)})
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
    if mode == "staged":
        move(engine, settings, Action.CUTOVER, ["tenant-3", "tenant-7"])
    elif mode == "shadow":
        move(engine, settings, Action.CUTOVER, None)
    else:
        move(engine, settings, Action.ROLLBACK, None)
    with engine.connect() as conn:
        plan_json = conn.execute(
            sa.text(f"EXPLAIN (FORMAT JSON) SELECT * FROM {VIEW} WHERE ticket_id = :t"),
            {"t": "T-4242"},
        ).scalar_one()
        rows = conn.execute(sa.text(f"SELECT * FROM {VIEW} WHERE ticket_id = 'T-4242'")).all()
    nodes = list(walk(plan_json[0]["Plan"]))
    scanned = [
        (str(n["Relation Name"]), str(n["Node Type"])) for n in nodes if "Relation Name" in n
    ]
    big = [(name, kind) for name, kind in scanned if name in {"ticket_orders", "tickets"}]
    expected = (
        ["ticket_orders", "ticket_orders", "tickets"] if mode == "staged" else ["ticket_orders"]
    )
    assert sorted({name for name, _ in big} | set()) == sorted(set(expected))
    assert len([n for n, _ in big if n == "ticket_orders"]) == expected.count("ticket_orders")
    lookups = {"Index Scan", "Index Only Scan", "Bitmap Heap Scan"}
    assert all(kind in lookups for _, kind in big), f"{mode}: {scanned}"
    assert len(rows) == 3


# -- status and the command line -------------------------------------------------------------


def test_status_says_per_tenant_what_consumers_read(world: tuple[sa.Engine, Settings]) -> None:
    engine, settings = world
    with engine.begin() as conn:
        run_id = add_run(conn)
    move(engine, settings, Action.CUTOVER, ["acme"], actor="carol")
    move(engine, settings, Action.CUTOVER, ["globex"], actor="carol")
    move(engine, settings, Action.ROLLBACK, ["globex"], actor="dave")
    with engine.connect() as conn:
        report = status(conn, settings)
    assert report.state == ViewState(ViewMode.STAGED, frozenset({"acme"}))
    got = {t.tenant: (t.reads, t.actor, t.parity_run_id) for t in report.tenants}
    assert got == {
        "acme": (SHADOW_TABLE, "carol", run_id),
        "globex": ("legacy.ticket_orders", "dave", run_id),
        "initech": ("legacy.ticket_orders", None, None),
    }
    assert report.description == (
        f"{SHADOW_TABLE} for tenant acme, legacy.ticket_orders for the others"
    )


def test_cli_cutover_status_rollback(
    cli_env: str,
    world: tuple[sa.Engine, Settings],
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine, _ = world
    with engine.begin() as conn:
        run_id = add_run(conn)
    assert main(["cutover", "--status"]) == 0
    assert "nothing yet: the view does not exist" in capsys.readouterr().out
    assert main(["cutover", "--tenant", "acme", "--actor", "carol"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cutover: tenant acme now reads enrichq.ticket_orders;")
    assert f"parity run #{run_id} passed" in out
    assert main(["cutover", "--status"]) == 0
    out = capsys.readouterr().out
    assert (
        f"{VIEW} reads {SHADOW_TABLE} for tenant acme, legacy.ticket_orders for the others" in out
    )
    acme = next(line for line in out.splitlines() if line.startswith("acme"))
    assert SHADOW_TABLE in acme
    assert "carol" in acme
    assert main(["cutover", "--status", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["mode"], document["tenants"][0]["tenant"]) == ("staged", "acme")
    assert main(["cutover", "--rollback", "--tenant", "acme", "--actor", "carol"]) == 0
    assert capsys.readouterr().out.startswith(
        "rollback: tenant acme now reads legacy.ticket_orders again;"
    )
    assert [(e[0], e[1], e[4]) for e in events(engine)] == [
        ("cutover", "acme", "carol"), ("rollback", "acme", "carol"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["cutover", "--actor", "  "], "enrichq: cutover: actor: must be 1 to 200 characters;"),
        (["cutover", "--tenant", "ac\x07me"], "enrichq: cutover: --tenant 'ac\\x07me': expected"),
        (["cutover", "--tenant", "x" * 201], "enrichq: cutover: --tenant 'xxx"),
    ],
    ids=["blank actor", "control character", "long tenant"],
)
def test_cli_bad_input_is_exit_2(
    cli_env: str,
    world: tuple[sa.Engine, Settings],
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    said: str,
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(said)
    assert len(err.splitlines()) == 1
    assert events(world[0]) == []


def test_cli_parity_approve_then_cutover_one_tenant(
    cli_env: str,
    world: tuple[sa.Engine, Settings],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The review path end to end: a real parity run, refused until approved, then a tenant."""
    engine, _ = world
    with engine.begin() as conn:  # make parity pass: legacy gets what the shadow found
        conn.execute(
            sa.text("UPDATE legacy.ticket_orders SET order_id = 'S' || substr(order_id, 2)")
        )
        conn.execute(
            sa.text(
                "INSERT INTO legacy.ticket_orders SELECT ticket_id, order_id, now()"
                " FROM enrichq.ticket_orders WHERE order_id LIKE '%-2'"
            )
        )
    assert main(["parity", "--json", str(tmp_path / "p.json")]) == 0
    run_id = json.loads((tmp_path / "p.json").read_text())["run_id"]
    assert main(["cutover", "--tenant", "acme"]) == 1
    assert f"parity run #{run_id} is not approved" in capsys.readouterr().err
    assert main(["parity", "approve", str(run_id), "--by", "alice"]) == 0
    assert main(["cutover", "--tenant", "acme", "--actor", "carol"]) == 0
    assert "approved by alice" in capsys.readouterr().out
    assert events(engine) == [("cutover", "acme", SHADOW_TABLE, run_id, "carol")]


def test_a_rollback_behind_a_long_reader_waits_without_stalling_other_readers(
    world: tuple[sa.Engine, Settings], cli_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An emergency rollback of the last staged tenant (the view changes) while a reader
    holds the view for seconds: it succeeds once that reader is gone, and meanwhile the
    other readers of the view are held up a fraction of a second at a time, never for as
    long as the long reader holds on."""
    engine, settings = world
    hold_seconds = 4.0
    with engine.begin() as conn:
        add_run(conn)
    move(engine, settings, Action.CUTOVER, ["acme"])
    readers = create_engine(engine.url, pool_size=3, isolation_level="AUTOCOMMIT")
    long_reader = create_engine(engine.url, pool_size=1)
    stop = threading.Event()
    stalls: list[float] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            with readers.connect() as conn:
                while not stop.is_set():
                    started = time.monotonic()
                    conn.execute(sa.text(f"SELECT count(*) FROM {VIEW}")).scalar_one()
                    stalls.append(time.monotonic() - started)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(2)]
    try:
        with long_reader.connect() as holder:
            holder.execute(sa.text(f"SELECT count(*) FROM {VIEW}")).scalar_one()  # holds it
            for t in threads:
                t.start()
            rolled: list[int] = []
            roller = threading.Thread(
                target=lambda: rolled.append(main(["cutover", "--rollback", "--tenant", "acme"]))
            )
            roller.start()
            time.sleep(hold_seconds)  # the long reader's transaction, open meanwhile
            holder.rollback()
        roller.join(timeout=60)
        assert rolled == [0]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        readers.dispose()
        long_reader.dispose()
    assert errors == []
    assert set(sides(engine).values()) == {"legacy"}
    assert len(stalls) > 10
    # before: every reader queued behind the pending swap for as long as the long reader
    # held the view (its lock timeout was 5 s)
    assert max(stalls) < hold_seconds / 2, sorted(stalls)[-5:]


def test_a_swap_that_cannot_get_the_view_in_time_changes_nothing_and_says_why(
    world: tuple[sa.Engine, Settings], cli_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine, settings = world
    with engine.begin() as conn:
        add_run(conn)
    move(engine, settings, Action.CUTOVER, ["acme"])
    capsys.readouterr()
    long_reader = create_engine(engine.url, pool_size=1)
    try:
        with long_reader.connect() as holder:
            holder.execute(sa.text(f"SELECT count(*) FROM {VIEW}")).scalar_one()
            assert main(["cutover", "--rollback", "--tenant", "acme", "--wait", "1"]) == 1
            holder.rollback()
    finally:
        long_reader.dispose()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"enrichq: rollback: {VIEW} is held by a long-running reader (tried for 1 s"
    )
    assert err[0].startswith("rollback: waiting for readers")
    assert sides(engine)["acme"] == "shadow"
    assert [e[0] for e in events(engine)] == ["cutover"]
