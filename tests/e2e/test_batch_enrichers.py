"""The batch enricher contract (issue 16), through a real worker against real PostgreSQL:
a result or an exception per ticket, each exception that ticket's outcome; a ticket left
out of the mapping is a transient error; a call that fails is transient for all its
tickets; one invalid result fails its ticket alone."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from tests.support.db import q
from tests.support.settings import make_settings
from tests.support.world import seeded

from enrichq_service.worker import Worker

OUTCOMES = "tests.support.enrichers:batch_outcomes"


def drain(db_url: str, engine: sa.Engine, **settings: Any) -> None:
    # retries come back an hour later, so the drain sees each ticket's first outcome only
    cfg = make_settings(
        db_url, backoff_base_seconds=3600, backoff_cap_seconds=3600, concurrency=1, **settings
    )
    assert Worker(cfg, engine).run(drain=True).stop_reason == "no_work"


def test_each_ticket_of_a_batch_gets_its_own_outcome(db_url: str, db_engine: sa.Engine) -> None:
    extra = ("bad-1", "defer-1", "gone-1", "odd-1", "perm-1", "trans-1")
    keys = seeded(db_engine, 12, extra=extra)
    drain(db_url, db_engine, batch_enricher=OUTCOMES)
    got = {
        k: (state, attempts, error or "")
        for k, state, attempts, error in q(
            db_engine, "SELECT key, state, attempts, last_error FROM enrichq.queue"
        )
    }
    want = {
        "perm-1": ("failed", 1, "cannot be looked up"),  # PermanentError: fail
        "bad-1": ("failed", 1, "orders[0].order_id: contains a NUL byte"),  # invalid: fail
        "defer-1": ("queued", 0, ""),  # Deferral: the attempt given back
        "trans-1": ("queued", 1, "TransientError: warehouse busy"),  # retry
        "odd-1": ("queued", 1, "ValueError: unexpected"),  # any other exception: retry
        "gone-1": ("queued", 1, "returned nothing for it"),  # missing: transient, retry
    }
    for key, (state, attempts, error) in want.items():
        assert got[key][:2] == (state, attempts), (key, got[key])
        assert error in got[key][2], (key, got[key])
    [(until,)] = q(
        db_engine,
        "SELECT round(extract(epoch FROM visible_at - now()) / 60) FROM enrichq.queue"
        " WHERE key = 'defer-1'",
    )
    assert 55 <= until <= 60  # deferred until the enricher's time, an hour on
    ordinary = [k for k in keys if k not in extra]
    assert {got[k][:2] for k in ordinary} == {("done", 1)}
    assert q(db_engine, "SELECT ticket_id, order_id FROM enrichq.ticket_orders ORDER BY 1") == [
        (k, f"O-{k}") for k in ordinary
    ]
    # one call for all of them; the tickets it answered (the invalid one too) carry its
    # warehouse job and are charged their bytes
    log = {
        k: (job, billed)
        for k, job, billed in q(
            db_engine, "SELECT ticket_id, job_id, bytes_billed FROM enrichq.lookup_log"
        )
    }
    assert set(log) == set(keys)  # the deferred one too, as a lookup that was deferred
    assert {log[k] for k in [*ordinary, "bad-1"]} == {("batch-job", 7)}
    assert q(db_engine, "SELECT bytes_billed FROM enrichq.budget_ledger") == [
        (7 * (len(ordinary) + 1),)
    ]


def test_a_batch_call_that_fails_is_transient_for_all_its_tickets(
    db_url: str, db_engine: sa.Engine
) -> None:
    keys = seeded(db_engine, 8, extra=("boom-1",))
    drain(db_url, db_engine, batch_enricher=OUTCOMES)
    got = q(db_engine, "SELECT state, attempts, last_error FROM enrichq.queue")
    assert len(got) == len(keys)
    assert {(state, attempts) for state, attempts, _ in got} == {("queued", 1)}
    assert {error for _, _, error in got} == {"ConnectionError: warehouse connection reset"}


def test_a_failed_warehouse_query_is_transient_for_its_whole_batch(
    db_url: str, db_engine: sa.Engine
) -> None:
    """The built-in lookup against a table that is not there: every ticket of the batch is
    retried (none failed), and each lookup is logged as an error."""
    keys = seeded(db_engine, 15)
    drain(db_url, db_engine, orders_table="warehouse.no_such_orders")
    got = q(db_engine, "SELECT state, attempts, last_error FROM enrichq.queue")
    assert len(got) == len(keys)
    assert {(state, attempts) for state, attempts, _ in got} == {("queued", 1)}
    assert all("no_such_orders" in error for _, _, error in got), got
    assert q(db_engine, "SELECT status, count(*) FROM enrichq.lookup_log GROUP BY 1") == [
        ("error", len(keys))
    ]


def test_answers_under_unasked_ids_are_dropped_but_their_bytes_are_charged(
    db_url: str, db_engine: sa.Engine
) -> None:
    """A batch enricher that answers for 3 tickets under ids it was not asked for, 3,000
    bytes billed each: the tickets are missing (transient), the answers are dropped, logged
    and counted, and the query's 9,000 bytes are charged to the batch's tickets."""
    from prometheus_client import REGISTRY

    keys = seeded(db_engine, 3)
    before = REGISTRY.get_sample_value("enrichq_batch_unasked_answers_total") or 0.0
    drain(db_url, db_engine, batch_enricher="tests.support.enrichers:unasked_keys")
    after = REGISTRY.get_sample_value("enrichq_batch_unasked_answers_total") or 0.0
    assert after - before == 3
    assert q(db_engine, "SELECT DISTINCT state, attempts FROM enrichq.queue") == [("queued", 1)]
    assert q(db_engine, "SELECT sum(bytes_billed), count(*) FROM enrichq.lookup_log") == [
        (9000, len(keys))
    ]
    assert q(db_engine, "SELECT DISTINCT job_id FROM enrichq.lookup_log") == [("unasked-job",)]
    assert q(db_engine, "SELECT bytes_billed FROM enrichq.budget_ledger") == [(9000,)]
    assert q(db_engine, "SELECT count(*) FROM enrichq.ticket_orders") == [(0,)]
