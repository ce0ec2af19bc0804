"""Retention, the refresh schedule, the run log and `enrichq sweep --once` (DESIGN §3, prune)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY
from tests.support.pg import Databases
from tests.support.settings import make_settings

from enrichq_schema.db import create_engine
from enrichq_schema.errors import SettingsError
from enrichq_schema.tables import lookup_log, queue, runs, tenant_served, ticket_enrichments
from enrichq_service.terminal import say
from enrichq_sweeper import passes, refresh, retention
from enrichq_sweeper.leader import SWEEPER_LOCK_ID
from enrichq_sweeper.scheduler import run_sweeper

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def put(conn: sa.Connection, key: str, state: str, *, finished_ago: timedelta | None) -> int:
    """A queue row in `state`; terminal rows finished `finished_ago` before T0."""
    values: dict[str, object] = {
        "kind": "enrich",
        "key": key,
        "reason": "created",
        "state": state,
        "attempts": 1,
        "max_attempts": 5,
        "visible_at": T0 - 100 * DAY,
    }
    if state == "leased":
        values.update(lease_owner="w", lease_expires_at=T0 + timedelta(minutes=1))
    if finished_ago is not None:
        values["finished_at"] = T0 - finished_ago
    if state == "dead_letter":
        values["dead_reason"] = "superseded"
    return int(conn.execute(sa.insert(queue).values(**values).returning(queue.c.id)).scalar_one())


def ids(conn: sa.Connection) -> set[int]:
    return set(conn.execute(sa.select(queue.c.id)).scalars())


# -- retention


def test_retention_deletes_only_rows_past_their_retention_in_batches(
    db_engine: sa.Engine,
) -> None:
    with db_engine.begin() as conn:
        old_done = [put(conn, f"D{i}", "done", finished_ago=31 * DAY) for i in range(5)]
        old_failed = put(conn, "F1", "failed", finished_ago=40 * DAY)
        young_done = put(conn, "D9", "done", finished_ago=29 * DAY)
        old_dead = put(conn, "X1", "dead_letter", finished_ago=91 * DAY)
        young_dead = put(conn, "X2", "dead_letter", finished_ago=60 * DAY)
        # open rows are never pruned, however old
        queued = put(conn, "Q1", "queued", finished_ago=None)
        leased = put(conn, "L1", "leased", finished_ago=None)
        conn.execute(
            sa.insert(tenant_served),
            [
                {"kind": "enrich", "tenant": "a", "bucket": T0 - 3 * DAY, "served": 1},
                {"kind": "enrich", "tenant": "a", "bucket": T0 - DAY, "served": 1},
            ],
        )
        conn.execute(
            sa.insert(lookup_log),
            [
                {
                    "queue_id": 1,
                    "ticket_id": "D0",
                    "attempt": 1,
                    "duration_ms": 1.0,
                    "status": "ok",
                    "created_at": T0 - age,
                }
                for age in (31 * DAY, DAY)
            ],
        )
        conn.execute(
            sa.insert(runs),
            [
                {"component": "worker", "owner": "h:1", "started_at": T0 - 31 * DAY,
                 "finished_at": T0 - 31 * DAY, "stop_reason": "no_work"},
                # still running (or crashed): kept until someone closes it
                {"component": "worker", "owner": "h:2", "started_at": T0 - 31 * DAY,
                 "finished_at": None, "stop_reason": None},
                {"component": "worker", "owner": "h:3", "started_at": T0 - DAY,
                 "finished_at": T0 - DAY, "stop_reason": "no_work"},
            ],
        )  # fmt: skip

    result = retention.run_once(
        db_engine, retention_days=30, dead_letter_retention_days=90, batch_size=2, now=T0
    )

    assert (result.done, result.failed, result.dead_letter) == (5, 1, 1)
    assert result.pruned == 7
    assert (result.tenant_served, result.lookup_log, result.runs) == (1, 1, 1)
    # five old done rows and one failed row in pages of two, then the others
    assert result.batches >= 6
    assert not result.stopped
    with db_engine.connect() as conn:
        left = ids(conn)
        assert left == {young_done, young_dead, queued, leased}
        assert not left & {*old_done, old_failed, old_dead}
        buckets = conn.execute(sa.select(tenant_served.c.bucket)).scalars().all()
        assert buckets == [T0 - DAY]
        assert conn.execute(sa.select(sa.func.count()).select_from(lookup_log)).scalar() == 1
        assert sorted(conn.execute(sa.select(runs.c.owner)).scalars()) == ["h:2", "h:3"]


def test_a_run_longer_than_the_retention_is_kept_for_the_retention_after_it_ends(
    db_engine: sa.Engine,
) -> None:
    # a worker that ran for 40 days and stopped yesterday: the row that says why it stopped
    # is what an operator reads today, so its age runs from its end, not its start
    with db_engine.begin() as conn:
        conn.execute(
            sa.insert(runs),
            [
                {"component": "worker", "owner": "long:1", "started_at": T0 - 40 * DAY,
                 "finished_at": T0 - DAY, "stop_reason": "error", "error": "boom"},
                {"component": "worker", "owner": "old:1", "started_at": T0 - 40 * DAY,
                 "finished_at": T0 - 31 * DAY, "stop_reason": "shutdown", "error": None},
            ],
        )  # fmt: skip

    result = retention.run_once(
        db_engine, retention_days=30, dead_letter_retention_days=90, batch_size=2, now=T0
    )

    assert result.runs == 1
    with db_engine.connect() as conn:
        assert conn.execute(sa.select(runs.c.owner)).scalars().all() == ["long:1"]


def test_retention_refuses_nonsense_periods(db_engine: sa.Engine) -> None:
    with pytest.raises(ValueError, match="positive"):
        retention.run_once(db_engine, retention_days=0, dead_letter_retention_days=90)
    with pytest.raises(ValueError, match="batch_size"):
        retention.run_once(db_engine, retention_days=1, dead_letter_retention_days=1, batch_size=0)


def test_retention_stops_between_batches_when_asked(db_engine: sa.Engine) -> None:
    with db_engine.begin() as conn:
        for i in range(6):
            put(conn, f"D{i}", "done", finished_ago=31 * DAY)
    calls = iter([False, True])
    result = retention.run_once(
        db_engine,
        retention_days=30,
        dead_letter_retention_days=90,
        batch_size=2,
        now=T0,
        should_stop=lambda: next(calls, True),
    )
    assert result.stopped
    assert result.done == 2


# -- refresh

TICKETS_DDL = """
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE {schema}.{table} (id text PRIMARY KEY, requester_email text, tenant text,
                               created_at timestamptz, updated_at timestamptz)
"""


def make_tickets(conn: sa.Connection, schema: str = "helpdesk", table: str = "tickets") -> str:
    conn.execute(sa.text(TICKETS_DDL.format(schema=schema, table=table)))
    return f"{schema}.{table}"


def ticket(conn: sa.Connection, table: str, key: str, updated_ago: timedelta) -> None:
    conn.execute(
        sa.text(
            f"INSERT INTO {table} (id, requester_email, tenant, created_at, updated_at)"
            " VALUES (:id, 'a@example.com', 'acme', :at, :at)"
        ),
        {"id": key, "at": T0 - updated_ago},
    )


def enriched(conn: sa.Connection, key: str, ago: timedelta) -> None:
    conn.execute(
        sa.insert(ticket_enrichments).values(
            ticket_id=key, enriched_at=T0 - ago, order_count=0, queue_id=1
        )
    )


def given_up(conn: sa.Connection, key: str, state: str, *, after_enrichment: bool) -> None:
    """A terminal row of `key` newer (or older) than its enrichment's queue row (id 1000)."""
    row_id = 2000 if after_enrichment else 500
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.queue (id, kind, key, reason, state, attempts, max_attempts,"
            " finished_at, dead_reason) OVERRIDING SYSTEM VALUE VALUES (:id, 'enrich', :key,"
            " 'updated', :state, 3, 3, :at, :reason)"
        ),
        {
            "id": row_id + sum(map(ord, key)),
            "key": key,
            "state": state,
            "at": T0 - DAY,
            "reason": {"dead_letter": "attempts_exhausted", "superseded": "superseded"}.get(state),
        },
    )


def test_refresh_enqueues_recent_tickets_whose_enrichment_is_stale(
    db_engine: sa.Engine, db_url: str
) -> None:
    settings = make_settings(db_url, max_attempts=7)
    with db_engine.begin() as conn:
        table = make_tickets(conn)
        ticket(conn, table, "stale", 2 * DAY)
        enriched(conn, "stale", 2 * DAY)
        ticket(conn, table, "never-enriched", DAY)  # its own enrich row's business
        ticket(conn, table, "fresh", DAY)
        enriched(conn, "fresh", timedelta(hours=1))
        ticket(conn, table, "quiet-for-a-week", 8 * DAY)
        enriched(conn, "quiet-for-a-week", 9 * DAY)
        for key, state in (("queued-enrich", "queued"), ("running", "leased")):
            ticket(conn, table, key, DAY)
            enriched(conn, key, 2 * DAY)
            put(conn, key, state, finished_ago=None)
        ticket(conn, table, "x" * 201, DAY)  # longer than a queue key may be
        enriched(conn, "x" * 201, 2 * DAY)

    listener = psycopg.connect(db_url.replace("postgresql+psycopg", "postgresql"), autocommit=True)
    try:
        listener.execute("LISTEN enrichq_queue")
        assert refresh.run_once(db_engine, settings, now=T0) == 1
        heard = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    finally:
        listener.close()
    assert heard == ["refresh"]

    with db_engine.connect() as conn:
        rows = conn.execute(
            sa.select(queue).where(queue.c.kind == "refresh").order_by(queue.c.key)
        ).all()
    assert [r.key for r in rows] == ["stale"]
    for r in rows:
        assert (r.state, r.reason, r.tenant, r.priority) == ("queued", "refresh", "acme", 1)
        assert (r.attempts, r.max_attempts, r.visible_at) == (0, 7, T0)
    # a second pass finds it queued already
    assert refresh.run_once(db_engine, settings, now=T0) == 0


@pytest.mark.parametrize(
    ("state", "after_enrichment", "refreshed"),
    [
        ("dead_letter", True, False),  # attempts spent since the last enrichment: poison
        ("failed", True, False),  # failed for good since
        ("superseded", True, True),  # a newer row took its work over: nothing given up
        ("dead_letter", False, True),  # given up before, enriched since: refresh as usual
    ],
)
def test_refresh_leaves_a_ticket_the_queue_gave_up_on_until_it_is_redriven(
    db_engine: sa.Engine, db_url: str, state: str, after_enrichment: bool, refreshed: bool
) -> None:
    settings = make_settings(db_url)
    with db_engine.begin() as conn:
        table = make_tickets(conn)
        ticket(conn, table, "T-1", DAY)
        conn.execute(
            sa.insert(ticket_enrichments).values(
                ticket_id="T-1", enriched_at=T0 - 2 * DAY, order_count=0, queue_id=1000
            )
        )
        given_up(conn, "T-1", state if state != "superseded" else "dead_letter",
                 after_enrichment=after_enrichment)  # fmt: skip
        if state == "superseded":
            conn.execute(sa.text("UPDATE enrichq.queue SET dead_reason = 'superseded'"))
    for _ in range(10):
        refresh.run_once(db_engine, settings, now=T0)
        with db_engine.begin() as conn:  # each refresh done at once, enrichment still stale
            conn.execute(
                sa.text(
                    "UPDATE enrichq.queue SET state = 'done', finished_at = now()"
                    " WHERE kind = 'refresh' AND state = 'queued'"
                )
            )
    with db_engine.connect() as conn:
        refreshes = conn.execute(
            sa.select(sa.func.count()).where(queue.c.kind == "refresh")
        ).scalar_one()
    assert refreshes == (10 if refreshed else 0)


def test_refresh_walks_the_recent_tickets_a_page_at_a_time(
    db_engine: sa.Engine, db_url: str
) -> None:
    settings = make_settings(db_url)
    with db_engine.begin() as conn:
        table = make_tickets(conn)
        for i in range(25):
            ticket(conn, table, f"T-{i:02d}", DAY + timedelta(minutes=i % 4))  # ties included
            enriched(conn, f"T-{i:02d}", 2 * DAY)
    statements: list[int] = []

    @sa.event.listens_for(db_engine, "after_cursor_execute")
    def pages(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "refresh" in statement and "INSERT INTO enrichq.queue" in statement:
            statements.append(cursor.rowcount)

    assert refresh.run_once(db_engine, settings, now=T0, batch_size=10) == 25
    sa.event.remove(db_engine, "after_cursor_execute", pages)
    assert len(statements) == 3  # 10, 10, 5: no statement enqueues more than a page
    with db_engine.connect() as conn:
        keys = conn.execute(sa.select(queue.c.key).where(queue.c.kind == "refresh")).scalars()
        assert sorted(keys) == [f"T-{i:02d}" for i in range(25)]


def test_refresh_quotes_the_configured_table_name(db_engine: sa.Engine, db_url: str) -> None:
    settings = make_settings(db_url, tickets_table="desk.order")
    with db_engine.begin() as conn:
        table = make_tickets(conn, "desk", '"order"')
        ticket(conn, table, "T-1", DAY)
        enriched(conn, "T-1", 2 * DAY)
    assert refresh.run_once(db_engine, settings, now=T0) == 1


def test_refresh_pass_without_tickets_table_is_recorded_as_an_error(
    db_engine: sa.Engine, db_url: str
) -> None:
    settings = make_settings(db_url, tickets_table="nowhere.tickets")
    report = passes.refresh_pass(db_engine, settings, now=T0, owner="h:9")
    assert not report.ok
    assert report.error is not None
    assert "does not exist" in report.error
    with db_engine.connect() as conn:
        run = conn.execute(sa.select(runs)).one()
    assert (run.stop_reason, run.owner, run.counts["task"]) == ("error", "h:9", "refresh")
    assert "does not exist" in run.error
    assert "\n" not in run.error


# -- the run log and metrics of whole passes


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_retention_pass_counts_pruned_rows_in_run_log_and_metrics(
    db_engine: sa.Engine, db_url: str
) -> None:
    settings = make_settings(db_url)
    with db_engine.begin() as conn:
        put(conn, "D1", "done", finished_ago=31 * DAY)
        put(conn, "X1", "dead_letter", finished_ago=91 * DAY)
    done_before = sample("enrichq_sweeper_pruned_total", state="done")
    dead_before = sample("enrichq_sweeper_pruned_total", state="dead_letter")
    report = passes.retention_pass(db_engine, settings, now=T0)
    assert report.ok
    assert sample("enrichq_sweeper_pruned_total", state="done") == done_before + 1
    assert sample("enrichq_sweeper_pruned_total", state="dead_letter") == dead_before + 1
    assert sample("enrichq_sweeper_last_pass_timestamp_seconds", task="retention") > 0
    with db_engine.connect() as conn:
        run = conn.execute(sa.select(runs)).one()
    assert run.counts["task"] == "retention"
    assert run.counts["pruned"] == 2
    assert run.stop_reason == "no_work"


def test_recovery_pass_updates_the_sweeper_metrics(db_engine: sa.Engine, db_url: str) -> None:
    settings = make_settings(db_url)
    with db_engine.begin() as conn:
        for key, attempts in (("T-1", 1), ("T-2", 1), ("T-3", 5)):
            conn.execute(
                sa.insert(queue).values(
                    kind="enrich", key=key, reason="created", state="leased",
                    attempts=attempts, max_attempts=5, lease_owner="w",
                    lease_expires_at=T0 - timedelta(seconds=1),
                )
            )  # fmt: skip
        put(conn, "T-2", "queued", finished_ago=None)
    before = {
        "promoted": sample("enrichq_sweeper_promoted_total"),
        "expiries": sample("enrichq_sweeper_lease_expiries_total"),
        "superseded": sample("enrichq_sweeper_dead_letters_total", reason="superseded"),
        "exhausted": sample("enrichq_sweeper_dead_letters_total", reason="attempts_exhausted"),
    }
    passes.recovery_pass(db_engine, settings, gave_up_hook=None, now=T0)
    assert sample("enrichq_sweeper_promoted_total") == before["promoted"] + 1
    assert sample("enrichq_sweeper_lease_expiries_total") == before["expiries"] + 3
    assert (
        sample("enrichq_sweeper_dead_letters_total", reason="superseded")
        == before["superseded"] + 1
    )
    assert (
        sample("enrichq_sweeper_dead_letters_total", reason="attempts_exhausted")
        == before["exhausted"] + 1
    )


# -- enrichq sweep --once (in this process)


@pytest.fixture
def with_tickets(db_engine: sa.Engine) -> sa.Engine:
    with db_engine.begin() as conn:
        make_tickets(conn)
    return db_engine


def test_sweep_once_runs_every_task_once_and_exits_zero(
    with_tickets: sa.Engine, db_url: str
) -> None:
    with with_tickets.begin() as conn:
        conn.execute(
            sa.insert(queue).values(
                kind="enrich", key="T-1", reason="created", state="leased", attempts=1,
                max_attempts=5, lease_owner="w", lease_expires_at=sa.text("now() - interval '1 minute'"),
            )
        )  # fmt: skip
    settings = make_settings(db_url, metrics_port=0)
    assert run_sweeper(settings, db_url, once=True, tell=say) == 0
    with with_tickets.connect() as conn:
        tasks = conn.execute(sa.text("SELECT counts->>'task', stop_reason FROM enrichq.runs")).all()
        state = conn.execute(sa.select(queue.c.state)).scalar_one()
    assert sorted(tasks) == [
        ("counts", "no_work"),
        ("reconcile", "no_work"),
        ("recovery", "no_work"),
        ("refresh", "no_work"),
        ("retention", "no_work"),
    ]
    assert state == "queued"
    assert sample("enrichq_sweeper_is_leader") == 0


def test_the_leader_runs_the_parity_task_its_caller_hands_it(
    with_tickets: sa.Engine, db_url: str
) -> None:
    """The sweeper schedules parity without importing it: `enrichq sweep` hands it the task
    when ENRICHQ_PARITY_INTERVAL_HOURS is set; with none handed, the task says so and fails."""
    calls: list[str] = []
    settings = make_settings(db_url, metrics_port=0, parity_interval_hours=24)
    ran = run_sweeper(
        settings, db_url, once=True, tell=say, scheduled_parity=lambda s, url: calls.append(url)
    )
    assert (ran, calls) == (0, [db_url])
    assert run_sweeper(settings, db_url, once=True, tell=say) == 1


def test_sweep_once_exits_one_when_a_task_fails(
    with_tickets: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = make_settings(db_url, metrics_port=0)
    with with_tickets.begin() as conn:  # the mirror goes after start-up checked it
        conn.execute(sa.text("ALTER TABLE helpdesk.tickets RENAME TO gone"))
        conn.execute(sa.text("CREATE VIEW helpdesk.tickets AS SELECT 1 AS id"))
    assert run_sweeper(settings, db_url, once=True, tell=say) == 1
    assert "refresh, reconcile failed" in capsys.readouterr().err


def test_sweep_once_does_nothing_while_another_sweeper_leads(
    with_tickets: sa.Engine, db_url: str
) -> None:
    settings = make_settings(db_url, metrics_port=0)
    leader = create_engine(db_url, pool_size=1)
    try:
        with leader.connect() as held:
            assert held.execute(
                sa.text("SELECT pg_try_advisory_lock(:id)"), {"id": SWEEPER_LOCK_ID}
            ).scalar_one()
            assert run_sweeper(settings, db_url, once=True, tell=say) == 0
            with with_tickets.connect() as conn:
                assert conn.execute(sa.select(sa.func.count()).select_from(runs)).scalar() == 0
            held.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": SWEEPER_LOCK_ID})
            held.commit()
    finally:
        leader.dispose()


def test_sweep_refuses_a_bad_gave_up_hook(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    settings = make_settings(db_url, gave_up_hook="no_such_package.hooks:compensate")
    assert run_sweeper(settings, db_url, once=True, tell=say) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("enrichq: invalid setting ENRICHQ_GAVE_UP_HOOK")
    assert "\n" not in err


@pytest.fixture
def unmigrated_url(databases: Databases) -> Iterator[str]:
    url = databases.create_empty("sweeper_unmigrated")
    engine = create_engine(url, pool_size=1)
    try:
        with engine.begin() as conn:  # the help desk's mirror is there, enrichq's schema not
            make_tickets(conn)
    finally:
        engine.dispose()
    yield url
    databases.drop(url)


def test_sweep_told_not_to_wait_refuses_an_unmigrated_database(unmigrated_url: str) -> None:
    """Told not to wait for `enrichq migrate` (`sweep --no-wait`), the sweeper refuses: a
    SettingsError, which the command line says in one line with exit 2. (Waiting is
    tests/e2e/test_before_migrate.py's.)"""
    settings = make_settings(unmigrated_url, metrics_port=0)
    with pytest.raises(SettingsError, match=r"revision none, not \d+ \(run `enrichq migrate`\)"):
        run_sweeper(settings, unmigrated_url, once=True, tell=say, wait_for_schema=False)
