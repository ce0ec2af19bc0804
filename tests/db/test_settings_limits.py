"""Each numeric setting's largest accepted value works where enrichq uses it (issue 31).

`tests/unit/test_settings.py` proves that inf, nan and anything past a setting's bound is
refused at start-up; these tests prove the bound is not too generous: a worker, the
sweeper and the built-in lookup configured with every number at its largest still run
against real PostgreSQL, where each duration becomes a millisecond setting, an interval
or a timestamp, and each count a bound parameter.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from tests.support.db import q
from tests.support.settings import at_their_largest, bounds, numeric_settings
from tests.support.world import enqueue, seeded

from enrichq_schema.settings import Settings
from enrichq_service import queue
from enrichq_service.enrich import SQL as ENRICH_SQL
from enrichq_service.enrich import EnrichContext, read_tickets, warehouse_lookup_batch
from enrichq_service.worker.engines import build_engines
from enrichq_sweeper import retention
from enrichq_sweeper.common import set_statement_timeout

OWNER = "limits"
MS_MAX = 2**31 - 1  # PostgreSQL's integer settings


def test_the_worker_engines_take_the_largest_statement_timeout_and_lease(db_url: str) -> None:
    """statement_timeout and idle_in_transaction_session_timeout (one lease), in ms."""
    settings = at_their_largest(db_url)
    engines = build_engines(settings, db_url)
    try:
        for engine in (engines.queue, engines.claims):
            with engine.begin() as conn:
                timeouts = conn.execute(
                    sa.text(
                        "SELECT name, setting FROM pg_settings WHERE name IN"
                        " ('statement_timeout', 'idle_in_transaction_session_timeout')"
                        " ORDER BY name"
                    )
                ).all()
            # in milliseconds, as the server keeps them
            assert [tuple(t) for t in timeouts] == [
                ("idle_in_transaction_session_timeout", str(int(settings.lease_seconds * 1000))),
                ("statement_timeout", str(int(settings.statement_timeout_seconds * 1000))),
            ]
            # the sweeper's and parity's statement timeout, set per transaction
        with engines.queue.begin() as conn:
            set_statement_timeout(conn, settings.statement_timeout_seconds)
            [(shown,)] = conn.execute(
                sa.text("SELECT setting FROM pg_settings WHERE name = 'statement_timeout'")
            )
        assert shown == str(int(settings.statement_timeout_seconds * 1000))
        assert int(settings.statement_timeout_seconds * 1000) <= MS_MAX
    finally:
        engines.dispose()


def test_the_built_in_lookup_runs_under_the_largest_attempt_deadline(
    db_url: str, db_engine: sa.Engine
) -> None:
    """The attempt's remaining time becomes the lookup's statement_timeout, in ms."""
    keys = seeded(db_engine, 3, enqueued=False)
    settings = at_their_largest(db_url)
    with db_engine.connect() as conn:
        tickets = list(read_tickets(conn, settings, keys).values())
    context = EnrichContext(
        settings, db_engine, deadline=time.monotonic() + settings.attempt_deadline_seconds
    )
    found = warehouse_lookup_batch(tickets, context)
    assert sorted(found) == sorted(keys)
    assert not [v for v in found.values() if isinstance(v, BaseException)]
    assert sum(len(v.orders) for v in found.values() if not isinstance(v, BaseException)) > 0


def test_the_queue_takes_the_largest_delays_lease_aging_and_backoff(
    db_url: str, db_engine: sa.Engine
) -> None:
    """Delays become now() + an interval rounded up to the lookup window's boundary (a
    timestamp), the lease make_interval(secs => …), the aging a divisor, the backoff
    (capped before it reaches the statement) an interval."""
    settings = at_their_largest(db_url)
    window = settings.lookup_window_seconds
    assert window > 0
    with db_engine.begin() as conn:
        queue.enqueue(
            conn,
            [
                queue.EnqueueRequest.build(key="T-new", reason="created"),
                queue.EnqueueRequest.build(key="T-old", reason="updated"),
            ],
            settings=settings,
        )
    delays = q(
        db_engine,
        "SELECT key, extract(epoch FROM visible_at - created_at), extract(epoch FROM visible_at)"
        " FROM enrichq.queue ORDER BY key",
    )
    # each the delay, then at most one window more, to the window's next boundary
    for (key, delay, at), wanted in zip(
        delays, (settings.delay_created_seconds, settings.delay_updated_seconds), strict=True
    ):
        assert wanted - 1e-3 <= float(delay) <= wanted + window, key
        assert float(at) % window == 0, key
    assert [k for k, _, _ in delays] == ["T-new", "T-old"]

    enqueue(db_engine, ["T-now"])
    with db_engine.begin() as conn:
        # the most attempts a row may have, short of spent: the backoff's largest power of 2
        conn.execute(
            sa.text(
                "UPDATE enrichq.queue SET max_attempts = :m, attempts = :m - 2 WHERE key = 'T-now'"
            ),
            {"m": settings.max_attempts},
        )
        [job] = queue.claim(
            conn,
            owner=OWNER,
            limit=settings.concurrency,
            lease_seconds=settings.lease_seconds,
            aging_seconds=settings.priority_aging_seconds,
        )
        lost = queue.heartbeat(conn, owner=OWNER, jobs=[job], lease_seconds=settings.lease_seconds)
        assert lost == set()
        outcomes = queue.settle(
            conn,
            owner=OWNER,
            settles=[queue.Settle(job, queue.SettleAction.RETRY, error="again")],
            backoff_base_seconds=settings.backoff_base_seconds,
            backoff_cap_seconds=settings.backoff_cap_seconds,
        )
    assert [o.value for o in outcomes.values()] == ["retry"]
    [(backoff,)] = q(
        db_engine,
        "SELECT extract(epoch FROM visible_at - updated_at) FROM enrichq.queue WHERE key = 'T-now'",
    )
    assert settings.backoff_cap_seconds / 2 - 1 <= float(backoff) <= settings.backoff_cap_seconds


def test_admission_takes_the_largest_budget_cap_and_lease(db_engine: sa.Engine) -> None:
    from enrichq_service.worker.admission import ADMISSION_LOCK_SPACE

    """The budget and cap are bound parameters of the admission, the lease an interval."""
    settings = at_their_largest()
    token = uuid.uuid4()
    with db_engine.begin() as conn:
        row = conn.execute(
            ENRICH_SQL("admission_take"),
            {
                "now": None,
                "cap": settings.warehouse_max_concurrency,
                "budget": settings.daily_bytes_budget,
                "expected": None,
                "token": str(token),
                "owner": OWNER,
                "lease_seconds": settings.lease_seconds,
                "lock_space": ADMISSION_LOCK_SPACE,
            },
        ).one()
        assert row.refused is None
        conn.execute(
            ENRICH_SQL("admission_extend"),
            {
                "owner": OWNER,
                "tokens": [str(token)],
                "lease_seconds": settings.lease_seconds,
                "now": None,
            },
        )


def test_retention_takes_the_largest_periods_and_statement_timeout(db_engine: sa.Engine) -> None:
    """Retention periods become now() - an interval; the dedupe window too."""
    settings = at_their_largest()
    result = retention.run_once(
        db_engine,
        retention_days=settings.retention_days,
        dead_letter_retention_days=settings.dead_letter_retention_days,
        statement_timeout_seconds=settings.statement_timeout_seconds,
        event_dedupe_hours=settings.event_dedupe_hours,
    )
    assert result is not None


def test_the_processes_take_the_largest_waits_and_schedules() -> None:
    """Waits (poll, heartbeat, shutdown grace) are threading timeouts; the sweeper's
    periods APScheduler intervals; parity's ages and windows timedeltas."""
    from apscheduler.triggers.interval import IntervalTrigger

    settings = at_their_largest()
    lock = threading.Lock()
    for seconds in (
        settings.poll_seconds,
        settings.heartbeat_seconds,
        settings.shutdown_grace_seconds,
        settings.attempt_deadline_seconds,
    ):
        assert lock.acquire(timeout=seconds)  # OverflowError past threading.TIMEOUT_MAX
        lock.release()
    now = datetime.now(UTC)
    for seconds in (
        settings.sweep_interval_seconds,
        settings.refresh_interval_seconds,
        settings.reconcile_interval_seconds,
        settings.parity_interval_hours * 3600,
    ):
        fire = IntervalTrigger(seconds=seconds, timezone=UTC).get_next_fire_time(None, now)
        assert fire is not None
    assert now - timedelta(hours=settings.parity_max_age_hours) < now
    assert now - timedelta(days=settings.parity_window_days) < now
    assert (
        now - timedelta(seconds=settings.delay_created_seconds + settings.parity_grace_seconds)
        < now
    )


def test_every_number_is_covered_here() -> None:
    """A new numeric setting must be added to one of the uses above (or here, with why
    its largest value needs no database)."""
    used = {
        "statement_timeout_seconds", "lease_seconds", "attempt_deadline_seconds",
        "delay_created_seconds", "delay_updated_seconds", "max_attempts", "concurrency",
        "priority_aging_seconds", "backoff_base_seconds", "backoff_cap_seconds",
        "warehouse_max_concurrency", "daily_bytes_budget", "retention_days",
        "dead_letter_retention_days", "event_dedupe_hours", "poll_seconds",
        "heartbeat_seconds", "shutdown_grace_seconds", "sweep_interval_seconds",
        "refresh_interval_seconds", "parity_interval_hours", "parity_max_age_hours",
        "parity_grace_seconds", "parity_window_days", "reconcile_interval_seconds",
        "lookup_window_seconds",
    }  # fmt: skip
    # compared in Python only, or checked by their own tests: ports (the OS's range),
    # fractions (0 to 1), the network timeout (tests/db/test_network_timeouts.py), the
    # body size and signature tolerance (compared with a request's), pool sizes, ingest's
    # database wait (an anyio timeout, tests/db/test_http_zendesk.py), serve's HTTP bounds
    # (event-loop timers and counts, tests/db/test_http_robustness.py), the bytes one
    # BigQuery job may bill (its maximum_bytes_billed, an int64; tests/e2e/test_bigquery.py)
    elsewhere = {
        "http_port", "metrics_port", "parity_min_order_coverage",
        "parity_min_ticket_match_rate", "parity_max_shadow_fault_rate",
        "network_timeout_seconds", "max_body_bytes", "webhook_tolerance_seconds",
        "lookup_batch_size", "parity_concurrency", "ingest_database_timeout_seconds",
        "http_header_timeout_seconds", "http_body_timeout_seconds", "http_max_connections",
        "http_max_buffered_bytes", "max_bytes_per_query",
    }  # fmt: skip
    assert used | elsewhere == set(numeric_settings())
    assert all(bounds(name)[1] < float("inf") for name in numeric_settings())
    assert isinstance(at_their_largest(), Settings)
