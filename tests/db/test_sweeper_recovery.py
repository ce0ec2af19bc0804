"""Lease recovery (DESIGN §3, sweep): promote the newest expired row per key, dead-letter
the rest with a reason, hand spent rows to the gave-up hook, never trip the queued-key
index, and leave alone a row its worker settled after the scan."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from tests.support.settings import make_settings

from enrichq_schema.states import NOTIFY_CHANNEL
from enrichq_schema.tables import LEASED_KEY_INDEX, queue
from enrichq_sweeper import passes, recovery
from enrichq_sweeper.common import sql as sweeper_sql
from enrichq_sweeper.recovery import GaveUp

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
EXPIRED = T0 - timedelta(seconds=5)
LIVE = T0 + timedelta(seconds=30)
HOOK_PATH = "tests.db.test_sweeper_recovery:record_gave_up"

# What the gave-up hook below was handed, batch by batch.
GAVE_UP: list[list[GaveUp]] = []


def record_gave_up(rows: Sequence[GaveUp]) -> None:
    """A gave-up hook for the tests: remember what it saw."""
    GAVE_UP.append(list(rows))


def put(
    conn: sa.Connection,
    key: str,
    state: str = "leased",
    *,
    kind: str = "enrich",
    attempts: int = 1,
    max_attempts: int = 5,
    expires: datetime = EXPIRED,
    tenant: str | None = None,
) -> int:
    """Insert one queue row in `state`, consistent with the table's CHECK constraints."""
    values: dict[str, object] = {
        "kind": kind,
        "key": key,
        "tenant": tenant,
        "reason": "created",
        "state": state,
        "attempts": attempts,
        "max_attempts": max_attempts,
        "visible_at": T0 - timedelta(minutes=10),
    }
    if state == "leased":
        values.update(lease_owner="w-old", lease_expires_at=expires, heartbeat_at=expires)
    if state in {"done", "failed", "dead_letter"}:
        values["finished_at"] = T0 - timedelta(minutes=1)
    if state == "dead_letter":
        values["dead_reason"] = "attempts_exhausted"
    return int(conn.execute(sa.insert(queue).values(**values).returning(queue.c.id)).scalar_one())


def get(conn: sa.Connection, row_id: int) -> sa.Row[tuple[object, ...]]:
    return conn.execute(sa.select(queue).where(queue.c.id == row_id)).one()


def recover_all(conn: sa.Connection, batch_size: int = 100) -> recovery.BatchOutcome:
    """Scan and recover in the caller's transaction (one page)."""
    page = recovery.scan(conn, after_id=0, batch_size=batch_size, now=T0)
    return recovery.recover_batch(conn, page, now=T0)


# -- per-key decisions (in one rolled-back transaction)


def test_an_expired_lease_goes_back_to_the_queue_visible_now(conn: sa.Connection) -> None:
    expired = put(conn, "T-1")
    outcome = recover_all(conn)
    assert (outcome.promoted, outcome.superseded, outcome.exhausted) == ((expired,), (), ())
    row = get(conn, expired)
    assert (row.state, row.visible_at, row.lease_owner, row.lease_expires_at) == (
        "queued",
        T0,
        None,
        None,
    )
    assert (row.finished_at, row.dead_reason, row.last_error) == (None, None, "lease expired")


def test_a_ticket_never_holds_two_leases_for_the_sweeper_to_choose_between(
    conn: sa.Connection,
) -> None:
    """The newest-expired-row-per-ticket rule has nothing left to choose: the database
    refuses a second lease of a key, whatever its kind."""
    put(conn, "T-1")
    with pytest.raises(sa.exc.IntegrityError, match=LEASED_KEY_INDEX), conn.begin_nested():
        put(conn, "T-1", kind="refresh")


def test_expired_lease_of_a_ticket_already_queued_is_superseded_by_that_row(
    conn: sa.Connection,
) -> None:
    expired = put(conn, "T-1")
    queued = put(conn, "T-1", state="queued", attempts=0)
    outcome = recover_all(conn)
    assert outcome.promoted == ()
    assert outcome.superseded == ((expired, queued),)
    assert get(conn, queued).state == "queued"
    row = get(conn, expired)
    assert (row.state, row.dead_reason, row.superseded_by, row.finished_at) == (
        "dead_letter",
        "superseded",
        queued,
        T0,
    )
    assert row.lease_owner is None


def test_a_queued_row_of_another_kind_does_not_supersede(conn: sa.Connection) -> None:
    """Queued rows merge per (kind, key): an enrich lease goes back beside a queued refresh."""
    enrich = put(conn, "T-1", kind="enrich")
    put(conn, "T-1", kind="refresh", state="queued", attempts=0)
    refresh = put(conn, "T-2", kind="refresh")
    outcome = recover_all(conn)
    assert sorted(outcome.promoted) == sorted([enrich, refresh])
    assert outcome.promoted_kinds == {"enrich", "refresh"}


def test_a_page_comes_in_the_lock_order_the_sweeper_would_sort_it_in(
    conn: sa.Connection,
) -> None:
    # the server sorts a pass's page (COLLATE "C"): byte order of UTF-8, as lock_order
    keys = ["b", "a", "é", "Z", "a-1", "a 1", "ä", "日本", "A", "ß", "a\u00a0"]
    for i, key in enumerate(keys):
        put(conn, key, kind="refresh" if i % 3 == 0 else "enrich")
    put(conn, "z-live", expires=T0 + timedelta(minutes=1))
    expected = sorted(
        recovery.scan(conn, after_id=0, batch_size=100, now=T0), key=recovery.lock_order
    )
    page = recovery.scan_page(conn, after_id=0, batch_size=100, now=T0)
    assert page.ids == tuple(e.id for e in expected)
    assert page.last_id == max(e.id for e in expected)
    later = recovery.scan_page(conn, after_id=page.last_id, batch_size=100, now=T0)
    assert later == recovery.ExpiredPage((), 0)


def test_live_leases_and_other_states_are_not_touched(conn: sa.Connection) -> None:
    live = put(conn, "T-1", expires=LIVE)
    done = put(conn, "T-2", state="done")
    expired = put(conn, "T-3")
    outcome = recover_all(conn)
    assert outcome.promoted == (expired,)
    assert get(conn, live).state == "leased"
    assert get(conn, done).state == "done"


def test_spent_row_is_dead_lettered_whatever_is_queued(conn: sa.Connection) -> None:
    spent = put(conn, "T-1", attempts=5, max_attempts=5)
    put(conn, "T-1", state="queued", attempts=0)
    other = put(conn, "T-2", attempts=2)
    outcome = recover_all(conn)
    assert outcome.promoted == (other,)
    assert [g.id for g in outcome.exhausted] == [spent]
    row = get(conn, spent)
    assert (row.state, row.dead_reason, row.superseded_by) == (
        "dead_letter",
        "attempts_exhausted",
        None,
    )


def test_a_row_completed_between_scan_and_write_is_untouched(db_engine: sa.Engine) -> None:
    with db_engine.begin() as setup:
        finished_by_worker = put(setup, "T-1")
        other = put(setup, "T-2")
    with db_engine.begin() as sweeper:
        page = recovery.scan(sweeper, after_id=0, batch_size=100, now=T0)
        assert {e.id for e in page} == {finished_by_worker, other}
        # the worker settles its row in its own transaction after the scan
        with db_engine.begin() as worker:
            worker.execute(
                sa.update(queue)
                .where(queue.c.id == finished_by_worker)
                .values(
                    state="done",
                    finished_at=T0,
                    lease_owner=None,
                    lease_expires_at=None,
                    last_error=None,
                )
            )
        outcome = recovery.recover_batch(sweeper, page, now=T0)
    assert outcome.promoted == (other,)
    with db_engine.connect() as check:
        row = get(check, finished_by_worker)
    assert (row.state, row.last_error, row.dead_reason) == ("done", None, None)


# -- whole passes (commit per batch)


def test_last_attempt_goes_to_the_configured_gave_up_hook(
    db_engine: sa.Engine, db_url: str
) -> None:
    settings = make_settings(db_url, gave_up_hook=HOOK_PATH)
    hook = recovery.load_hook(settings.gave_up_hook)
    seen: list[list[GaveUp]] = importlib.import_module("tests.db.test_sweeper_recovery").GAVE_UP
    seen.clear()
    with db_engine.begin() as conn:
        spent = put(conn, "T-1", attempts=3, max_attempts=3, tenant="acme")
        fine = put(conn, "T-2", attempts=1, max_attempts=3)
    report = passes.recovery_pass(db_engine, settings, gave_up_hook=hook, now=T0)
    assert report.ok
    assert report.counts["exhausted"] == 1
    assert report.counts["promoted"] == 1
    assert [[g.id for g in batch] for batch in seen] == [[spent]]
    [gave_up] = seen[0]
    assert (gave_up.key, gave_up.tenant, gave_up.attempts, gave_up.lease_owner) == (
        "T-1",
        "acme",
        3,
        "w-old",
    )
    assert gave_up.lease_expires_at == EXPIRED
    with db_engine.connect() as conn:
        assert get(conn, spent).dead_reason == "attempts_exhausted"
        assert get(conn, fine).state == "queued"


def test_a_failing_hook_is_counted_and_the_pass_goes_on(db_engine: sa.Engine) -> None:
    def broken(rows: Sequence[GaveUp]) -> None:
        raise RuntimeError("compensation service down")

    with db_engine.begin() as conn:
        spent = put(conn, "T-1", attempts=5, max_attempts=5)
    result = recovery.run_once(db_engine, now=T0, gave_up_hook=broken)
    assert (result.exhausted, result.hook_errors) == (1, 1)
    with db_engine.connect() as conn:
        assert get(conn, spent).state == "dead_letter"


def test_pass_writes_one_run_row_with_counts(db_engine: sa.Engine, db_url: str) -> None:
    settings = make_settings(db_url)
    with db_engine.begin() as conn:
        put(conn, "T-1")
        put(conn, "T-2")
        put(conn, "T-2", state="queued", attempts=0)
    report = passes.recovery_pass(db_engine, settings, now=T0, owner="host-a:1")
    with db_engine.connect() as conn:
        [run] = conn.execute(sa.text("SELECT * FROM enrichq.runs")).all()
    assert (run.component, run.owner, run.stop_reason, run.error) == (
        "sweeper",
        "host-a:1",
        "no_work",
        None,
    )
    assert run.finished_at is not None
    assert run.counts["task"] == "recovery"
    assert (run.counts["promoted"], run.counts["superseded"], run.counts["exhausted"]) == (1, 1, 0)
    assert run.counts["pruned"] == 0
    assert run.counts["duration_seconds"] >= 0
    assert report.counts == run.counts


@pytest.mark.slow
def test_100k_expired_leases_recovered_in_bounded_batches(db_engine: sa.Engine) -> None:
    rows, batch = 100_000, 1000
    params = {"rows": rows, "expired": EXPIRED}
    with db_engine.begin() as conn:
        # every 97th row has spent its attempts; every 10th key has a queued row already
        conn.execute(
            sa.text(
                """
                INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts,
                                           lease_owner, lease_expires_at, visible_at)
                SELECT 'enrich', 'T-' || i, 'created', 'leased',
                       CASE WHEN i % 97 = 0 THEN 5 ELSE 1 END, 5, 'w-old',
                       CAST(:expired AS timestamptz), CAST(:expired AS timestamptz)
                FROM generate_series(1, :rows) AS i
                """
            ),
            params,
        )
        conn.execute(
            sa.text(
                """
                INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts,
                                           visible_at)
                SELECT 'enrich', 'T-' || i, 'updated', 'queued', 0, 5, CAST(:expired AS timestamptz)
                FROM generate_series(10, :rows, 10) AS i
                """
            ),
            params,
        )
    exhausted = sum(1 for i in range(1, rows + 1) if i % 97 == 0)
    superseded = sum(1 for i in range(1, rows + 1) if i % 97 and i % 10 == 0)

    result = recovery.run_once(db_engine, batch_size=batch, now=T0, gave_up_hook=None)
    assert result.exhausted == exhausted
    assert result.superseded == superseded
    assert result.promoted == rows - exhausted - superseded
    assert result.batches == rows // batch
    assert 0 < result.max_batch_rows <= batch

    with db_engine.connect() as conn:
        by_state: dict[str, int] = dict(
            conn.execute(sa.text("SELECT state, count(*) FROM enrichq.queue GROUP BY state")).all()
        )
        already_queued = rows // 10
        assert by_state == {
            "queued": result.promoted + already_queued,
            "dead_letter": exhausted + superseded,
        }
        wrong = conn.execute(
            sa.text(
                """
                SELECT count(*) FROM enrichq.queue AS d
                LEFT JOIN enrichq.queue AS w ON w.id = d.superseded_by
                WHERE d.state = 'dead_letter' AND d.dead_reason = 'superseded'
                  AND (w.state IS DISTINCT FROM 'queued' OR w.key <> d.key)
                """
            )
        ).scalar_one()
        assert wrong == 0
        spent = conn.execute(
            sa.text(
                "SELECT count(*) FROM enrichq.queue"
                " WHERE dead_reason = 'attempts_exhausted' AND attempts = max_attempts"
            )
        ).scalar_one()
        assert spent == exhausted


def index_names(plan: object) -> set[str]:
    """Every index an EXPLAIN (FORMAT JSON) plan reads."""
    if isinstance(plan, dict):
        found = {plan["Index Name"]} if "Index Name" in plan else set()
        return found.union(*(index_names(v) for v in plan.values()))
    if isinstance(plan, list):
        return set().union(*(index_names(v) for v in plan))
    return set()


def node_types(plan: object) -> set[str]:
    if isinstance(plan, dict):
        found = {plan["Node Type"]} if "Node Type" in plan else set()
        return found.union(*(node_types(v) for v in plan.values()))
    if isinstance(plan, list):
        return set().union(*(node_types(v) for v in plan))
    return set()


def test_the_batch_write_reaches_rows_by_id_and_the_queued_key_index(
    db_engine: sa.Engine,
) -> None:
    """It finds the page's rows by id and their keys' queued rows through the queued-key
    index (its text implies that index's predicate), so it never scans the table.

    Its own database: ANALYZE writes pg_class in place, which a rollback does not undo.
    """
    with db_engine.begin() as conn:
        # a table of some size with statistics, as autovacuum keeps it
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts,"
                " lease_owner, lease_expires_at)"
                " SELECT 'enrich', 'K-' || i, 'created', 'leased', 1, 5, 'w-' || (i % 50),"
                " CAST(:at AS timestamptz) + make_interval(secs => i)"
                " FROM generate_series(1, 5000) AS i"
            ),
            {"at": T0 - timedelta(hours=1)},
        )
        conn.execute(sa.text("ANALYZE enrichq.queue"))
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        plan = conn.execute(
            sa.text("EXPLAIN (FORMAT JSON) " + sweeper_sql()["recovery_recover_batch"].sql),
            {
                "ids": [1, 2],
                "lease_expired": "x",
                "channel": NOTIFY_CHANNEL,
                "now": T0,
            },
        ).scalar_one()
    indexes = index_names(plan)
    assert "queue_pkey" in indexes, indexes
    assert indexes & {"queue_queued_key_uq", "queue_claim_idx"}, indexes
    assert "Seq Scan" not in node_types(plan)
