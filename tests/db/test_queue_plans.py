"""The hot queue statements read only open rows: EXPLAIN proves it with a long history.

The table holds 200,000 terminal rows and a few hundred open ones (ANALYZEd), like a
queue that has run for a while. Every plan is walked node by node: no statement may scan
enrichq.queue sequentially, and the scans it does use are the partial indexes over open
rows (DESIGN §3 "Indexes") or, for lookups by id, the primary key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.pg import Databases
from tests.support.plans import (
    SCAN_TYPES,
    explain,
    indexes_used,
    queue_scans,
    scans_of,
    walk,
    work,
)

from enrichq_schema.db import create_engine
from enrichq_schema.queries import Queries, load
from enrichq_schema.states import NOTIFY_CHANNEL, OWNERLESS_PRIORITY
from enrichq_service import queue
from enrichq_service.queue import KEY_LOCK_SPACE

QUEUE_SQL = load("enrichq_service", "sql/queue.sql")
OBSERVE_SQL = load("enrichq_service", "sql/observe.sql")
SWEEPER_SQL = load("enrichq_sweeper", "sql/sweeper.sql")

TERMINAL_ROWS = 200_000
OWNER = "w-1"
BATCH = 50

FILL = """
INSERT INTO enrichq.tenants (tenant, plan, priority)
VALUES ('acme', 'standard', 1), ('globex', 'priority', 2), ('initech', 'free', 0);

-- the history: done, failed and dead-letter rows of both kinds and every tenant
INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, state, visible_at, attempts,
                           max_attempts, finished_at, dead_reason, last_error, created_at)
SELECT CASE WHEN g % 10 = 0 THEN 'refresh' ELSE 'enrich' END, 'H-' || g,
       (ARRAY['acme', 'globex', 'initech', NULL])[1 + g % 4], 1, 'created',
       (ARRAY['done', 'done', 'done', 'failed', 'dead_letter'])[1 + g % 5],
       now() - interval '2 days', 1, 5, now() - make_interval(secs => g),
       CASE WHEN g % 5 = 4 THEN 'attempts_exhausted' END,
       CASE WHEN g % 5 >= 3 THEN 'boom' END, now() - interval '3 days'
FROM generate_series(1, :terminal) AS g;

-- the backlog: visible now, visible in 5 minutes, visible 5 minutes ago
INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, visible_at, max_attempts)
SELECT CASE WHEN g % 10 = 0 THEN 'refresh' ELSE 'enrich' END, 'Q-' || g,
       (ARRAY['acme', 'globex', 'initech', NULL])[1 + g % 4], 1, 'updated',
       now() + make_interval(secs => (g % 3 - 1) * 300), 5
FROM generate_series(1, 300) AS g;

-- in-flight work of ten workers: some leases live, some expired
INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, state, visible_at, attempts,
                           max_attempts, lease_owner, lease_expires_at, heartbeat_at, claim_token)
SELECT 'enrich', 'L-' || g, NULL, 1, 'updated', 'leased', now() - interval '5 minutes', 1, 5,
       'w-' || (g % 10), now() + make_interval(secs => (g % 4 - 1) * 60), now(),
       gen_random_uuid()
FROM generate_series(1, 200) AS g;

INSERT INTO enrichq.tenant_served (kind, tenant, bucket, served)
SELECT 'enrich', t, date_trunc('hour', now()) - make_interval(hours => h), 10
FROM unnest(ARRAY['', 'acme', 'globex', 'initech']) AS t, generate_series(0, 24) AS h;
"""


@dataclass(frozen=True)
class History:
    """The filled database: its engine, the queue's indexes, and the leases OWNER holds."""

    engine: sa.Engine
    partial_indexes: frozenset[str]
    primary_key: str
    held_ids: list[int]
    held_tokens: list[str]


@pytest.fixture(scope="module")
def history(databases: Databases) -> Iterator[History]:
    url = databases.clone("plans")
    engine = create_engine(url, pool_size=2)
    try:
        with engine.begin() as conn:
            for statement in filter(str.strip, FILL.split(";")):
                conn.execute(sa.text(statement), {"terminal": TERMINAL_ROWS})
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE enrichq.queue"))
            conn.execute(sa.text("ANALYZE"))
        with engine.connect() as conn:
            indexes = conn.execute(
                sa.text(
                    "SELECT c.relname, i.indpred IS NOT NULL AS partial, i.indisprimary"
                    " FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid"
                    " WHERE i.indrelid = 'enrichq.queue'::regclass"
                )
            ).all()
            held = conn.execute(
                sa.text(
                    "SELECT id, claim_token FROM enrichq.queue"
                    " WHERE state = 'leased' AND lease_owner = :owner ORDER BY id"
                ),
                {"owner": OWNER},
            ).all()
        yield History(
            engine=engine,
            partial_indexes=frozenset(r.relname for r in indexes if r.partial),
            primary_key=next(r.relname for r in indexes if r.indisprimary),
            held_ids=[r.id for r in held],
            held_tokens=[str(r.claim_token) for r in held],
        )
    finally:
        engine.dispose()
        databases.drop(url)


def assert_reads_only_open_rows(
    plan: dict[str, Any], history: History, *, expected: set[str], by_id: bool
) -> None:
    scans = queue_scans(plan)
    seq = [n for n in scans if n["Node Type"] == "Seq Scan"]
    assert not seq, f"sequential scan of enrichq.queue: {seq}"
    assert all(n["Node Type"] != "Tid Scan" for n in scans)
    used = indexes_used(plan)
    allowed = set(history.partial_indexes) | ({history.primary_key} if by_id else set())
    assert used <= allowed, f"reads indexes over the whole history: {used - allowed}"
    assert expected <= used, f"expected {expected} among the indexes used, got {used}"


# -- the statements, with realistic parameters


def _held(history: History, **extra: Any) -> dict[str, Any]:
    return {"ids": history.held_ids, "tokens": history.held_tokens, "owner": OWNER, "now": None}


SETTLE_ACTIONS = ("complete", "retry", "fail", "defer")


def _settle(history: History) -> dict[str, Any]:
    """Every action at once, as a worker's settle group has them."""
    n = len(history.held_ids)
    return _held(history) | {
        "actions": [SETTLE_ACTIONS[i % 4] for i in range(n)],
        "errors": ["timeout"] * n,
        "untils": [None] * n,
        "delays": [5.0 if SETTLE_ACTIONS[i % 4] == "retry" else None for i in range(n)],
    }


CLAIM_KINDS = ["enrich", "refresh"]
CLAIM_PARAMS = {
    "kinds": CLAIM_KINDS,
    "owner": OWNER,
    "limit": BATCH,
    "lease_seconds": 60.0,
    "key_lock_space": KEY_LOCK_SPACE,
    "now": None,
}

STATEMENTS: dict[str, tuple[Queries, str, Callable[[History], dict[str, Any]], set[str], bool]] = {
    # name: (file, query, params, indexes that must appear, lookups by id allowed)
    "claim": (
        QUEUE_SQL,
        "queue_claim_batch",
        lambda h: dict(CLAIM_PARAMS),
        {"queue_claim_idx"},
        True,
    ),
    "heartbeat": (
        QUEUE_SQL,
        "queue_heartbeat",
        lambda h: _held(h) | {"lease_seconds": 60.0},
        set(),
        True,
    ),
    "settle": (QUEUE_SQL, "queue_settle", _settle, {"queue_queued_key_uq"}, True),
    "leases_not_held": (
        QUEUE_SQL,
        "queue_leases_not_held",
        lambda h: {"owner": OWNER, "held_ids": h.held_ids, "now": None},
        set(),
        False,
    ),
    "enqueue_merge": (
        QUEUE_SQL,
        "queue_enqueue",
        lambda h: {
            "kinds": ["enrich"] * 20,
            "keys": [f"Q-{i}" for i in range(1, 21)],
            "tenants": [None] * 20,
            "reasons": ["updated"] * 20,
            "payloads": ["{}"] * 20,
            "delays": [120.0] * 20,
            "max_attempts": [5] * 20,
            "middle_priority": OWNERLESS_PRIORITY,
            "channel": NOTIFY_CHANNEL,
            "window_seconds": 30.0,
            "now": None,
        },
        # a merge finds its queued row through the arbiter of ON CONFLICT (the queued-key
        # index, not a scan node of the plan): the statement scans no queue rows at all
        set(),
        False,
    ),
    "sweeper_expired_scan": (
        SWEEPER_SQL,
        "recovery_scan",
        lambda h: {"now": None, "after_id": 0, "batch_size": 1000},
        {"queue_leased_expiry_idx"},
        False,
    ),
    "sweeper_expired_scan_page": (
        SWEEPER_SQL,
        "recovery_scan_page",
        lambda h: {"now": None, "after_id": 0, "batch_size": 1000},
        {"queue_leased_expiry_idx"},
        False,
    ),
    "observe_open_counts": (OBSERVE_SQL, "observe_open_counts", lambda h: {}, set(), False),
    "observe_oldest_visible": (
        OBSERVE_SQL,
        "observe_oldest_visible",
        lambda h: {"now": None},
        {"queue_claim_idx"},
        False,
    ),
    "observe_leases": (OBSERVE_SQL, "observe_leases", lambda h: {"now": None}, set(), False),
    "observe_dead_letters": (
        OBSERVE_SQL,
        "observe_dead_letters_by_reason",
        lambda h: {},
        {"queue_dead_finished_idx"},  # index-only: it carries the dead reason
        False,
    ),
}


def test_the_fixture_is_a_long_history_with_open_work(history: History) -> None:
    with history.engine.connect() as conn:
        counts: dict[str, int] = dict(
            conn.execute(sa.text("SELECT state, count(*) FROM enrichq.queue GROUP BY state")).all()
        )
    assert counts["done"] + counts["failed"] + counts["dead_letter"] == TERMINAL_ROWS
    assert counts["queued"] == 300
    assert counts["leased"] == 200
    assert len(history.held_ids) == 20
    assert "queue_claim_idx" in history.partial_indexes


@pytest.mark.parametrize("statement", sorted(STATEMENTS))
def test_statement_reads_only_open_rows(history: History, statement: str) -> None:
    queries, name, params, expected, by_id = STATEMENTS[statement]
    with history.engine.connect() as conn:
        plan = explain(conn, queries[name].sql, params(history))
    assert_reads_only_open_rows(plan, history, expected=expected, by_id=by_id)


PREPARED = sorted(name for name, entry in STATEMENTS.items() if entry[0][entry[1]].prepared)


def test_the_prepared_statements_are_the_claim_loops() -> None:
    assert PREPARED == ["claim", "heartbeat", "settle"]


@pytest.mark.parametrize("statement", PREPARED)
def test_prepared_statement_generic_plan_reads_only_open_rows(
    history: History, statement: str
) -> None:
    """A prepared statement may run on its generic plan (the claim engine forces it): that
    plan, made without the values, must read the same indexes."""
    queries, name, params, expected, by_id = STATEMENTS[statement]
    with history.engine.connect() as conn, conn.begin():
        plan = explain(conn, queries[name].sql, params(history), generic=True)
    assert_reads_only_open_rows(plan, history, expected=expected, by_id=by_id)


def test_ticket_read_generic_plan_probes_the_mirror_by_id(history: History) -> None:
    """The claim engine's other statement, on the default mirror table."""
    from enrichq_service.enrich import SQL as ENRICH_SQL
    from enrichq_service.seed import SQL as SEED_SQL

    with history.engine.connect() as conn, conn.begin() as tx:
        conn.execute(SEED_SQL("seed_create_helpdesk"))
        conn.execute(
            sa.text(
                "INSERT INTO helpdesk.tickets (id) SELECT 'T-' || g FROM generate_series(1, 20000) g"
            )
        )
        conn.execute(sa.text("ANALYZE helpdesk.tickets"))
        sql = ENRICH_SQL["enrich_read_tickets"].sql.format(tickets="helpdesk.tickets")
        plan = explain(conn, sql, {"ids": ["T-1", "T-2", "T-3"]}, analyze=True, generic=True)
        tx.rollback()
    scans = [n for n in walk(plan) if n["Node Type"] in SCAN_TYPES]
    assert scans
    assert all(n["Node Type"] != "Seq Scan" for n in scans), scans
    assert sum(n["Actual Rows"] * n["Actual Loops"] for n in scans) == 3


def test_open_counts_read_only_the_open_row_indexes(history: History) -> None:
    with history.engine.connect() as conn:
        plan = explain(conn, OBSERVE_SQL["observe_open_counts"].sql, {})
    used = indexes_used(plan)
    assert used, "counts open rows without an index"
    assert all(history.partial_indexes.__contains__(name) for name in used)
    assert "queue_dead_reason_idx" not in used
    assert "queue_finished_idx" not in used
    assert "queue_dead_finished_idx" not in used


# -- claim work is bounded by the batch, not by the backlog or the in-flight leases


# Live leases of other keys, held by a busy fleet of workers.
LEASES = (
    "INSERT INTO enrichq.queue (kind, key, reason, state, visible_at, attempts, max_attempts,"
    "  lease_owner, lease_expires_at)"
    " SELECT 'enrich', 'BL-' || g, 'manual', 'leased', now() - interval '1 hour', 1, 5,"
    "  'w-busy-' || (g % 100), now() + interval '1 hour'"
    " FROM generate_series(1, :n) AS g"
)


def _claim_plan_with(conn: sa.Connection, extra_rows_sql: str, generic: bool) -> dict[str, Any]:
    """Add rows inside the caller's transaction and run the claim under EXPLAIN ANALYZE."""
    conn.execute(sa.text(extra_rows_sql))
    return _claim_plan(conn, generic)


def _claim_plan(conn: sa.Connection, generic: bool) -> dict[str, Any]:
    """ANALYZE what the caller's transaction added, evaluate the claim-order heads as the
    claim does first (every due one), then run the claim under EXPLAIN ANALYZE."""
    conn.execute(sa.text("ANALYZE enrichq.queue"))
    while queue.refresh_heads(conn, kinds=CLAIM_KINDS, pairs=(), aging_seconds=600.0):
        pass
    conn.execute(sa.text("ANALYZE enrichq.queue_heads"))
    _, name, params, _, _ = STATEMENTS["claim"]
    sql = QUEUE_SQL[name].sql
    return explain(conn, sql, params(None), analyze=True, generic=generic)  # type: ignore[arg-type]  # the claim's params take no history


PLANS = pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])


@PLANS
def test_claim_reads_a_batch_not_the_whole_backlog(history: History, generic: bool) -> None:
    """A 5,000-row visible backlog of the first tenant served, 2,000 jobs in flight: the
    claim reads about one batch of the backlog."""
    with history.engine.connect() as conn, conn.begin() as tx:
        conn.execute(sa.text(LEASES), {"n": 2000})
        plan = _claim_plan_with(
            conn,
            "INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, visible_at,"
            "  max_attempts)"
            " SELECT 'enrich', 'B-' || g, 'globex', 2, 'manual',"
            "  now() - make_interval(secs => g), 5"
            " FROM generate_series(1, 5000) AS g",
            generic,
        )
        tx.rollback()
    rows, _ = work(plan, lambda name: name == "queue_claim_idx")
    assert rows <= 4 * BATCH, f"the claim read {rows:.0f} queued rows to lease {BATCH}"


@PLANS
def test_a_paused_backlog_costs_the_claim_nothing(history: History, generic: bool) -> None:
    """A 5,000-row visible backlog of a paused tenant, ahead of everyone in claim order (the
    top plan, the oldest rows): the claim reads none of it, so it reads what it would read
    without that backlog, and leases only unpaused work."""
    paused_backlog = (
        "INSERT INTO enrichq.tenants (tenant, plan, priority) VALUES ('loud', 'priority', 2);"
        "INSERT INTO enrichq.pauses (kind, tenant, paused_by) VALUES (NULL, 'loud', 'ops');"
        "INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, visible_at,"
        "  max_attempts)"
        " SELECT 'enrich', 'P-' || g, 'loud', 2, 'manual',"
        "  now() - interval '1 day' - make_interval(secs => g), 5"
        " FROM generate_series(1, 5000) AS g"
    )
    with history.engine.connect() as conn, conn.begin() as tx:
        before = _claim_plan(conn, generic)
        tx.rollback()
    with history.engine.connect() as conn, conn.begin() as tx:
        plan = _claim_plan_with(conn, paused_backlog, generic)
        leased = conn.execute(
            sa.text("SELECT count(*) FROM enrichq.queue WHERE tenant = 'loud' AND state = 'leased'")
        ).scalar_one()
        tx.rollback()
    rows_before, _ = work(before, lambda name: name == "queue_claim_idx")
    rows, _ = work(plan, lambda name: name == "queue_claim_idx")
    assert leased == 0
    # the walk steps over the paused tenant with one probe, never through its rows
    assert rows <= rows_before + 2, (
        f"{rows:.0f} rows read with the pause, {rows_before:.0f} without"
    )


@PLANS
def test_claim_probes_live_leases_by_key(history: History, generic: bool) -> None:
    """20,000 live leases on other keys: checking the candidates' keys costs ~a probe each."""
    with history.engine.connect() as conn, conn.begin() as tx:
        conn.execute(sa.text(LEASES), {"n": 20_000})
        plan = _claim_plan(conn, generic)
        tx.rollback()
    rows, blocks = work(plan, lambda name: name.startswith("queue_leased"))
    assert rows <= 2 * BATCH, f"the claim read {rows:.0f} leased rows to check {BATCH} keys"
    assert blocks <= 6 * BATCH, f"the claim touched {blocks} buffers to check {BATCH} keys"


def test_the_generic_probe_plans_without_the_values(history: History) -> None:
    """Guard for the generic-plan tests above: the plan they check is made for `$n`."""
    _, name, params, _, _ = STATEMENTS["claim"]
    with history.engine.connect() as conn, conn.begin():
        generic = explain(conn, QUEUE_SQL[name].sql, params(history), generic=True)
        custom = explain(conn, QUEUE_SQL[name].sql, params(history))

    # the batch size reaches the plan as a parameter: the generic plan cannot know it is 50
    def limit_estimates(plan: dict[str, Any]) -> list[float]:
        return [n["Plan Rows"] for n in walk(plan) if n["Node Type"] == "Limit"]

    assert limit_estimates(custom)
    assert max(limit_estimates(custom)) <= BATCH
    assert limit_estimates(generic) != limit_estimates(custom)


# -- the claim's cost follows the batch, not the tenants with history or with queued rows

HISTORY_TENANTS = (
    "INSERT INTO enrichq.tenant_served (kind, tenant, bucket, served)"
    " SELECT 'enrich', 'hist-' || t, date_trunc('hour', now()) - make_interval(hours => h), 3"
    " FROM generate_series(1, :tenants) AS t, generate_series(0, 47) AS h"
)


@PLANS
def test_claim_reads_no_served_counts_of_tenants_with_history(
    history: History, generic: bool
) -> None:
    """5,000 tenants served over the last 48 hours: the claim reads none of their counts
    (the heads carry the served count of each pair with work; it only adds its own)."""
    with history.engine.connect() as conn, conn.begin() as tx:
        conn.execute(sa.text(HISTORY_TENANTS), {"tenants": 5000})
        conn.execute(sa.text("ANALYZE enrichq.tenant_served"))
        plan = _claim_plan(conn, generic)
        tx.rollback()
    assert scans_of(plan, "tenant_served") == []
    assert scans_of(plan, "queue_heads"), "the claim no longer reads the heads"


# 5,000 tenants, one queued row each: visible a minute ago, or in 10 minutes
SPREAD = (
    "INSERT INTO enrichq.queue (kind, key, tenant, priority, reason, visible_at, max_attempts)"
    " SELECT 'enrich', 'S-' || g, 'spread-' || g, 1, 'created',"
    "  now() + make_interval(secs => :offset), 5"
    " FROM generate_series(1, 5000) AS g"
)


@PLANS
@pytest.mark.parametrize("offset", [-60, 600], ids=["visible", "not-visible-yet"])
def test_claim_reads_a_few_heads_whatever_the_tenants_with_queued_rows(
    history: History, generic: bool, offset: int
) -> None:
    """5,000 more tenants with a queued row each, visible or not: the claim reads about a
    batch of heads and a batch of queued rows, not one probe per tenant (issue 26)."""
    with history.engine.connect() as conn, conn.begin() as tx:
        conn.execute(sa.text(SPREAD), {"offset": offset})
        plan = _claim_plan(conn, generic)
        leased = conn.execute(
            sa.text("SELECT count(*) FROM enrichq.queue WHERE state = 'leased'")
        ).scalar_one()
        tx.rollback()
    rows, _ = work(plan, lambda name: name == "queue_claim_idx")
    assert rows <= 4 * BATCH, f"the claim read {rows:.0f} queued rows to lease {BATCH}"
    heads, _ = work(plan, lambda name: True, relation="queue_heads")
    assert heads <= 2 * BATCH + 10, f"the claim read {heads:.0f} heads to lease {BATCH}"
    assert all(n["Node Type"] != "Seq Scan" for n in scans_of(plan, "queue_heads"))
    assert leased > 200  # it did lease a batch beside the fixture's leases


# -- what a scrape reads: open rows through their indexes, terminal rows from the counts


def scrape_statements(history: History) -> list[tuple[str, dict[str, Any]]]:
    """The statements one read of the /metrics database gauges runs, with their parameters."""
    from enrichq_service.observe import read_snapshot

    seen: list[tuple[str, dict[str, Any]]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        seen.append((statement, dict(parameters or {})))

    with history.engine.connect() as conn:
        sa.event.listen(conn, "before_cursor_execute", record)
        read_snapshot(conn)
        sa.event.remove(conn, "before_cursor_execute", record)
    return seen


def test_a_scrape_never_reads_the_history(history: History) -> None:
    statements = scrape_statements(history)
    assert len(statements) >= 6
    terminal = {"queue_finished_idx", "queue_dead_finished_idx", "queue_dead_reason_idx"}
    with history.engine.connect() as conn:
        for statement, parameters in statements:
            [document] = conn.exec_driver_sql(
                "EXPLAIN (FORMAT JSON) " + statement, parameters
            ).scalars()
            plan = document[0]["Plan"]
            scans = queue_scans(plan)
            assert all(n["Node Type"] != "Seq Scan" for n in scans), statement
            assert not indexes_used(plan) & terminal, statement
