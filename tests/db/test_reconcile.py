"""The reconcile pass (issue #29): a ticket the help desk changed with no event reaching
enrichq is enqueued (reason `reconcile`), a page at a time, counted per tenant, and never
when an event could still be on its way, when work is open, or when the queue gave up on
the ticket after the change. Its rows obey pauses like any enqueue."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY
from tests.support.settings import make_settings

from enrichq_schema.errors import SettingsError
from enrichq_schema.settings import Settings
from enrichq_schema.tables import queue, runs, tenants, ticket_enrichments
from enrichq_service import queue as queue_ops
from enrichq_service.controls import pauses
from enrichq_service.controls.pauses import PauseScope
from enrichq_sweeper import passes, reconcile
from enrichq_sweeper.scheduler import _Tasks

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)
DAY = timedelta(days=1)
# the longer of the visibility delays the first test sets (600 s after a new ticket)
QUIET = timedelta(seconds=600)


@pytest.fixture
def mirror(db_engine: sa.Engine) -> sa.Engine:
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE SCHEMA helpdesk; CREATE TABLE helpdesk.tickets (id text PRIMARY KEY,"
                " requester_email text, tenant text, created_at timestamptz,"
                " updated_at timestamptz)"
            )
        )
    return db_engine


def ticket(
    conn: sa.Connection, key: str, updated_ago: timedelta, tenant: str | None = "acme"
) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO helpdesk.tickets (id, requester_email, tenant, created_at, updated_at)"
            " VALUES (:id, 'a@example.com', :tenant, :at, :at)"
        ),
        {"id": key, "tenant": tenant, "at": T0 - updated_ago},
    )


def looked_up(conn: sa.Connection, key: str, ago: timedelta, queue_id: int = 1) -> None:
    """The ticket's last lookup started `ago` before T0."""
    conn.execute(
        sa.insert(ticket_enrichments).values(
            ticket_id=key, enriched_at=T0 - ago, order_count=0, queue_id=queue_id
        )
    )


def row(conn: sa.Connection, key: str, state: str, *, kind: str = "enrich", **extra: Any) -> None:
    values: dict[str, Any] = {
        "kind": kind, "key": key, "reason": "updated", "state": state, "attempts": 1,
        "max_attempts": 5, "visible_at": T0 - DAY,
    }  # fmt: skip
    if state == "leased":
        values.update(lease_owner="w", lease_expires_at=T0 + MINUTE)
    if state in ("done", "failed", "dead_letter"):
        values.setdefault("finished_at", T0 - DAY)
    values.update(extra)
    conn.execute(sa.insert(queue).values(**values))


def reconciled(conn: sa.Connection) -> list[str]:
    return sorted(
        conn.execute(sa.select(queue.c.key).where(queue.c.reason == "reconcile")).scalars()
    )


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_reconcile_enqueues_tickets_changed_with_no_event_and_nothing_else(
    mirror: sa.Engine, db_url: str
) -> None:
    settings = make_settings(
        db_url, max_attempts=7, delay_created_seconds=600, delay_updated_seconds=120
    )
    with mirror.begin() as conn:
        conn.execute(sa.insert(tenants).values(tenant="acme", plan="priority", priority=2))
        # due: never looked up; changed after its last lookup started
        ticket(conn, "never", 20 * MINUTE)
        ticket(conn, "changed", 20 * MINUTE)
        looked_up(conn, "changed", 30 * MINUTE)
        ticket(conn, "ownerless", 20 * MINUTE, tenant=None)
        # given up before the change: the change is new work
        ticket(conn, "dead-before", 20 * MINUTE)
        row(conn, "dead-before", "dead_letter", dead_reason="attempts_exhausted",
            finished_at=T0 - 2 * DAY)  # fmt: skip
        # superseded rows gave nothing up
        ticket(conn, "superseded", 20 * MINUTE)
        row(conn, "superseded", "dead_letter", dead_reason="superseded", finished_at=T0)
        # not due: looked up after the change started
        ticket(conn, "fresh", 20 * MINUTE)
        looked_up(conn, "fresh", 10 * MINUTE)
        # not due: changed within the visibility delay (its event may still come)
        ticket(conn, "recent", QUIET - MINUTE)
        # not due: older than the pass looks back (backfill's and refresh's business)
        ticket(conn, "old", 8 * DAY)
        # not due: open work of any kind looks it up anyway
        for kind in ("enrich", "refresh", "backfill"):
            ticket(conn, f"queued-{kind}", 20 * MINUTE)
            row(conn, f"queued-{kind}", "queued", kind=kind)
        ticket(conn, "running", 20 * MINUTE)
        row(conn, "running", "leased", kind="refresh")
        # not due: the queue gave up on it after the change (poison, cancelled, failed)
        for state, reason in (("dead_letter", "attempts_exhausted"), ("dead_letter", "cancelled"),
                              ("failed", None)):  # fmt: skip
            key = f"gave-up-{reason or state}"
            ticket(conn, key, 20 * MINUTE)
            row(conn, key, state, dead_reason=reason, finished_at=T0 - 5 * MINUTE)
        ticket(conn, "x" * 201, 20 * MINUTE)  # longer than a queue key may be

    before = sample("enrichq_reconciled_total", tenant="acme")
    ownerless_before = sample("enrichq_reconciled_total", tenant="")
    listener = psycopg.connect(db_url.replace("postgresql+psycopg", "postgresql"), autocommit=True)
    try:
        listener.execute("LISTEN enrichq_queue")
        report = passes.reconcile_pass(mirror, settings, now=T0, owner="h:1")
        heard = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    finally:
        listener.close()
    assert report.ok, report.error
    assert heard == ["enrich"]
    with mirror.connect() as conn:
        assert reconciled(conn) == ["changed", "dead-before", "never", "ownerless", "superseded"]
        rows = conn.execute(sa.select(queue).where(queue.c.reason == "reconcile")).all()
        run = conn.execute(sa.select(runs)).one()
    for r in rows:
        assert (r.kind, r.state, r.visible_at, r.attempts, r.max_attempts) == (
            "enrich", "queued", T0, 0, 7)  # fmt: skip
        # the tenant and its plan's priority, like any enqueue; ownerless: the middle plan
        assert (r.tenant, r.priority) == ((None, 1) if r.key == "ownerless" else ("acme", 2))
    assert sample("enrichq_reconciled_total", tenant="acme") == before + 4
    assert sample("enrichq_reconciled_total", tenant="") == ownerless_before + 1
    assert (run.counts["task"], run.counts["enqueued"], run.stop_reason) == (
        "reconcile", 5, "no_work")  # fmt: skip
    # a second pass finds them queued
    assert reconcile.run_once(mirror, settings, now=T0).enqueued == 0


def test_a_ticket_that_changes_again_after_its_lookup_is_reconciled_again(
    mirror: sa.Engine, db_url: str
) -> None:
    settings = make_settings(db_url)
    with mirror.begin() as conn:
        ticket(conn, "T-1", 20 * MINUTE)
    assert reconcile.run_once(mirror, settings, now=T0).by_tenant == {"acme": 1}
    with mirror.begin() as conn:  # looked up, done
        conn.execute(
            sa.text("UPDATE enrichq.queue SET state = 'done', finished_at = :t"), {"t": T0}
        )
        looked_up(conn, "T-1", -MINUTE)
    assert reconcile.run_once(mirror, settings, now=T0 + 20 * MINUTE).enqueued == 0
    with mirror.begin() as conn:  # changed again, its event lost too
        conn.execute(sa.text("UPDATE helpdesk.tickets SET updated_at = :t"), {"t": T0 + 5 * MINUTE})
    assert reconcile.run_once(mirror, settings, now=T0 + 20 * MINUTE).enqueued == 1


def test_reconcile_walks_the_recent_tickets_a_page_at_a_time(
    mirror: sa.Engine, db_url: str
) -> None:
    settings = make_settings(db_url)
    with mirror.begin() as conn:
        for i in range(25):
            ticket(conn, f"T-{i:02d}", DAY + timedelta(minutes=i % 4))  # ties included
    statements: list[int] = []

    @sa.event.listens_for(mirror, "after_cursor_execute")
    def pages(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "'reconcile'" in statement:
            statements.append(cursor.rowcount)

    result = reconcile.run_once(mirror, settings, now=T0, batch_size=10)
    sa.event.remove(mirror, "after_cursor_execute", pages)
    assert (result.enqueued, result.scanned, result.pages) == (25, 25, 3)
    assert len(statements) == 3  # no statement enqueues more than a page
    with mirror.connect() as conn:
        assert reconciled(conn) == [f"T-{i:02d}" for i in range(25)]


def test_a_pass_told_to_stop_ends_between_pages(mirror: sa.Engine, db_url: str) -> None:
    settings = make_settings(db_url)
    with mirror.begin() as conn:
        for i in range(25):
            ticket(conn, f"T-{i:02d}", DAY + timedelta(seconds=i))
    asked = iter([False, True])
    result = reconcile.run_once(
        mirror, settings, now=T0, batch_size=10, should_stop=lambda: next(asked)
    )
    assert (result.enqueued, result.pages, result.stopped) == (10, 1, True)


def test_reconciled_rows_wait_out_a_pause_like_any_enqueue(mirror: sa.Engine, db_url: str) -> None:
    settings = make_settings(db_url)
    with mirror.begin() as conn:
        ticket(conn, "A-1", 20 * MINUTE, tenant="acme")
        ticket(conn, "G-1", 20 * MINUTE, tenant="globex")
        pauses.pause(conn, PauseScope.build(kind="enrich", tenant="acme"), actor="ops", now=T0)
    assert reconcile.run_once(mirror, settings, now=T0).by_tenant == {"acme": 1, "globex": 1}

    def claimable() -> list[str]:
        with mirror.connect() as conn, conn.begin() as tx:
            jobs = queue_ops.claim(conn, owner="w", limit=10, lease_seconds=60, now=T0 + MINUTE)
            tx.rollback()
        return sorted(j.key for j in jobs)

    assert claimable() == ["G-1"]
    with mirror.begin() as conn:
        pauses.resume(conn, PauseScope("enrich", "acme"), actor="ops")
    assert claimable() == ["A-1", "G-1"]


def test_the_pass_without_the_mirror_is_recorded_as_an_error(
    db_engine: sa.Engine, db_url: str
) -> None:
    settings = make_settings(db_url, tickets_table="nowhere.tickets")
    report = passes.reconcile_pass(db_engine, settings, now=T0)
    assert not report.ok
    assert report.error is not None
    assert "does not exist" in report.error


def schedule_of(settings: Settings, engine: sa.Engine) -> dict[str, float]:
    tasks = _Tasks(engine, settings, "", None, "h:1", lambda: False)  # type: ignore[arg-type]  # no hook needed to list the schedule
    return {name: seconds for name, _, seconds in tasks.schedule()}


def test_the_interval_setting_schedules_the_pass_or_turns_it_off(
    db_engine: sa.Engine, db_url: str
) -> None:
    assert schedule_of(make_settings(db_url), db_engine)["reconcile"] == 900
    assert (
        schedule_of(make_settings(db_url, reconcile_interval_seconds=60), db_engine)["reconcile"]
        == 60
    )
    assert "reconcile" not in schedule_of(
        make_settings(db_url, reconcile_interval_seconds=0), db_engine
    )


@pytest.mark.parametrize("value", ["0.5", "-1", "86401", "inf", "nan"])
def test_an_interval_out_of_bounds_is_refused_naming_the_field(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENRICHQ_RECONCILE_INTERVAL_SECONDS", value)
    with pytest.raises((SettingsError, ValueError), match=r"(?i)reconcile_interval_seconds"):
        Settings.load()
