"""The worker end to end, in process: enrichment results, outcomes, budget, run log."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from tests.support.db import q
from tests.support.settings import make_settings
from tests.support.world import enqueue, seeded

from enrichq_service.worker import Worker

EXPECTED_ORDERS = """
SELECT t.id AS ticket_id, o.order_id
FROM helpdesk.tickets AS t
JOIN warehouse.customers AS c ON lower(c.email) = lower(t.requester_email)
JOIN warehouse.orders AS o ON o.customer_id = c.customer_id
"""


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def test_drain_enriches_every_ticket_with_its_orders(db_url: str, db_engine: sa.Engine) -> None:
    seeded(db_engine, 120, tenant="acme")
    result = Worker(make_settings(db_url, concurrency=4), db_engine).run(drain=True)
    assert result.stop_reason == "no_work"
    assert result.counts["done"] == 120
    assert q(db_engine, "SELECT state, count(*) FROM enrichq.queue GROUP BY 1") == [("done", 120)]
    got = set(q(db_engine, "SELECT ticket_id, order_id FROM enrichq.ticket_orders"))
    assert got == set(q(db_engine, EXPECTED_ORDERS))
    # every ticket has an enrichment row, also those whose customer has no orders
    assert scalar(db_engine, "SELECT count(*) FROM enrichq.ticket_enrichments") == 120
    assert (
        scalar(db_engine, "SELECT count(*) FROM enrichq.ticket_enrichments WHERE order_count = 0")
        > 0
    )
    # one lookup log row per lookup; empty results say so
    log = dict(q(db_engine, "SELECT status, count(*) FROM enrichq.lookup_log GROUP BY 1"))
    assert log["ok"] + log["empty"] == 120
    run = q(
        db_engine,
        "SELECT component, stop_reason, counts->>'done', finished_at IS NOT NULL FROM enrichq.runs",
    )
    assert run == [("worker", "no_work", "120", True)]


def test_a_run_whose_start_could_not_be_logged_is_logged_when_it_ends(
    db_url: str, db_engine: sa.Engine
) -> None:
    # the database refuses the run log's first insert, as it does when a worker starts in
    # an outage, and its first update, so the end's first try rolls back the row it opened
    # (a sequence is not rolled back: only the first of each fails)
    with db_engine.begin() as conn:
        for op in ("insert", "update"):
            conn.execute(sa.text(f"CREATE SEQUENCE runs_{op}s"))
            conn.execute(
                sa.text(
                    f"CREATE FUNCTION refuse_first_{op}() RETURNS trigger LANGUAGE plpgsql AS $$"
                    f" BEGIN IF nextval('runs_{op}s') = 1 THEN"
                    "   RAISE EXCEPTION 'the run log is unavailable'; END IF;"
                    " RETURN NEW; END $$"
                )
            )
            conn.execute(
                sa.text(
                    f"CREATE TRIGGER refuse_first_{op} BEFORE {op} ON enrichq.runs"
                    f" FOR EACH ROW EXECUTE FUNCTION refuse_first_{op}()"
                )
            )
    seeded(db_engine, 5, tenant="acme")
    before = scalar(db_engine, "SELECT now()")
    result = Worker(make_settings(db_url), db_engine).run(drain=True)
    assert result.counts["done"] == 5
    # the start refused, then the end's first try refused after it opened the row
    assert scalar(db_engine, "SELECT last_value FROM runs_inserts") == 3
    assert scalar(db_engine, "SELECT last_value FROM runs_updates") == 2
    run = q(
        db_engine,
        "SELECT component, stop_reason, counts->>'done', started_at >= :before,"
        " started_at <= finished_at FROM enrichq.runs",
        before=before,
    )
    assert run == [("worker", "no_work", "5", True, True)]


def test_a_new_lookup_replaces_the_previous_result(db_url: str, db_engine: sa.Engine) -> None:
    [key] = seeded(db_engine, 1, enqueued=False)
    settings = make_settings(db_url)
    enqueue(db_engine, [key], tenant="acme")
    Worker(settings, db_engine).run(drain=True)
    with db_engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM warehouse.orders"))
    enqueue(db_engine, [key], tenant="acme")
    Worker(settings, db_engine).run(drain=True)
    assert scalar(db_engine, "SELECT count(*) FROM enrichq.ticket_orders") == 0
    assert scalar(db_engine, "SELECT order_count FROM enrichq.ticket_enrichments") == 0


def test_ticket_missing_from_the_mirror_is_retried_then_dead_lettered(
    db_url: str, db_engine: sa.Engine
) -> None:
    seeded(db_engine, 1, enqueued=False)
    enqueue(db_engine, ["T-not-mirrored"], tenant="acme")
    settings = make_settings(db_url, max_attempts=2, backoff_base_seconds=0, backoff_cap_seconds=0)
    # max_attempts is fixed per row at enqueue
    with db_engine.begin() as conn:
        conn.execute(sa.text("UPDATE enrichq.queue SET max_attempts = 2"))
    result = Worker(settings, db_engine).run(drain=True)
    assert result.counts["retry"] == 1
    assert result.counts["dead_letter"] == 1
    state, reason, attempts, error = q(
        db_engine, "SELECT state, dead_reason, attempts, last_error FROM enrichq.queue"
    )[0]
    assert (state, reason, attempts) == ("dead_letter", "attempts_exhausted", 2)
    assert "not in the help-desk mirror" in error


def test_permanent_error_fails_and_deferral_keeps_the_attempt(
    db_url: str, db_engine: sa.Engine
) -> None:
    keys = seeded(db_engine, 2, enqueued=False)
    enqueue(db_engine, keys[:1], tenant="acme")
    failing = make_settings(db_url, enricher="tests.support.enrichers:permanent")
    Worker(failing, db_engine).run(drain=True)
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("failed", 1)]
    assert "malformed requester" in scalar(db_engine, "SELECT last_error FROM enrichq.queue")

    enqueue(db_engine, keys[1:], tenant="acme")
    deferring = make_settings(db_url, enricher="tests.support.enrichers:defer_an_hour")
    result = Worker(deferring, db_engine).run(drain=True)
    assert result.counts["deferred"] == 1
    state, attempts, wait = q(
        db_engine,
        "SELECT state, attempts, extract(epoch FROM visible_at - now()) FROM enrichq.queue "
        "WHERE key = :k",
        k=keys[1],
    )[0]
    assert (state, attempts) == ("queued", 0)
    assert 3000 < wait <= 3600
    # a deferral is not a failure, but its lookup is recorded
    assert (
        scalar(db_engine, "SELECT status FROM enrichq.lookup_log WHERE ticket_id = :k", k=keys[1])
        == "deferred"
    )


def test_unexpected_exceptions_are_transient(db_url: str, db_engine: sa.Engine) -> None:
    seeded(db_engine, 1, tenant="acme")
    settings = make_settings(db_url, enricher="tests.support.enrichers:flaky")
    result = Worker(settings, db_engine).run(drain=True)
    assert result.counts["retry"] == 1
    [(state, attempts, error)] = q(
        db_engine, "SELECT state, attempts, last_error FROM enrichq.queue"
    )
    assert (state, attempts) == ("queued", 1)
    assert error == "ValueError: warehouse hiccup"


def test_unknown_kind_and_malformed_payload_fail_with_the_reason(
    db_url: str, db_engine: sa.Engine
) -> None:
    keys = seeded(db_engine, 2, enqueued=False)
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.queue (kind, key, reason, max_attempts, payload) VALUES "
                "('enrich', :a, 'manual', 3, '[1, 2]'), ('teleport', :b, 'manual', 3, '{}')"
            ),
            {"a": keys[0], "b": keys[1]},
        )
    worker = Worker(make_settings(db_url), db_engine, kinds=("enrich", "teleport"))
    worker.run(drain=True)
    got = dict(q(db_engine, "SELECT key, state || ': ' || last_error FROM enrichq.queue"))
    assert got == {
        keys[0]: "failed: PermanentError: payload must be a JSON object",
        keys[1]: "failed: PermanentError: unknown kind 'teleport'",
    }
    assert scalar(db_engine, "SELECT count(*) FROM enrichq.ticket_orders") == 0


def test_budget_exhausted_defers_with_attempts_unchanged(db_url: str, db_engine: sa.Engine) -> None:
    seeded(db_engine, 12, tenant="acme")
    settings = make_settings(
        db_url, enricher="tests.support.enrichers:tagged", daily_bytes_budget=2500, concurrency=1
    )
    result = Worker(settings, db_engine).run(drain=True)
    assert result.stop_reason == "budget_exhausted"
    # 1,000 bytes a lookup: the third lookup crosses 2,500, then nothing more is looked up
    assert scalar(db_engine, "SELECT bytes_billed FROM enrichq.budget_ledger") == 3000
    assert scalar(db_engine, "SELECT count(*) FROM enrichq.lookup_log") == 3
    assert scalar(db_engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'done'") == 3
    assert result.counts["deferred"] == 9
    # the other nine were claimed, then given back until midnight UTC, attempts unchanged
    queued = q(
        db_engine,
        "SELECT attempts, visible_at = (date_trunc('day', now() AT TIME ZONE 'UTC') "
        "+ interval '1 day') AT TIME ZONE 'UTC' FROM enrichq.queue WHERE state = 'queued'",
    )
    assert queued == [(0, True)] * 9


def test_attempt_past_its_deadline_is_abandoned_and_retried(
    db_url: str, db_engine: sa.Engine, monkeypatch: Any
) -> None:
    seeded(db_engine, 1, tenant="acme")
    monkeypatch.setenv("ENRICHQ_TEST_SLOW_SECONDS", "30")
    settings = make_settings(
        db_url,
        enricher="tests.support.enrichers:slow",
        attempt_deadline_seconds=0.5,
        shutdown_grace_seconds=0,
    )
    result = Worker(settings, db_engine).run(drain=True)
    assert result.counts["retry"] == 1
    [(state, attempts, error)] = q(
        db_engine, "SELECT state, attempts, last_error FROM enrichq.queue"
    )
    assert (state, attempts) == ("queued", 1)
    assert "deadline" in error
    assert scalar(db_engine, "SELECT count(*) FROM enrichq.ticket_orders") == 0
