"""Scrape-time metrics: /metrics matches the database, reads are cached, errors never raise."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.pg import Databases
from tests.support.settings import make_settings

from enrichq_schema.db import create_engine
from enrichq_service import queue
from enrichq_service.http import create_app
from enrichq_service.observe import (
    QueueCollector,
    register_queue_collector,
    set_build_info,
    start_metrics_server,
)
from enrichq_service.queue import EnqueueRequest
from enrichq_sweeper import counts

SECRET = "whsec-metrics-test-77c1e2"
DB_GAUGES = {
    "enrichq_queue_rows",
    "enrichq_queue_dead_letters",
    "enrichq_queue_oldest_visible_age_seconds",
    "enrichq_queue_live_leases",
    "enrichq_queue_expired_leases",
    "enrichq_queue_dead_tuples",
    "enrichq_queue_last_autovacuum_timestamp_seconds",
    "enrichq_oldest_transaction_age_seconds",
    "enrichq_budget_bytes_billed_today",
    "enrichq_queue_counted_timestamp_seconds",
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


class StatementCounter:
    """Counts the statements an engine sends to the database."""

    def __init__(self, engine: sa.Engine) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._engine = engine
        sa.event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, *_: Any) -> None:
        with self._lock:
            self.count += 1

    def close(self) -> None:
        sa.event.remove(self._engine, "before_cursor_execute", self._seen)


@pytest.fixture
def statements(db_engine: sa.Engine) -> Iterator[StatementCounter]:
    counter = StatementCounter(db_engine)
    yield counter
    counter.close()


def errors_counted() -> float:
    return REGISTRY.get_sample_value("enrichq_observe_errors_total") or 0.0


def test_metrics_endpoint_matches_the_database(db_url: str, db_engine: sa.Engine) -> None:
    cfg = make_settings(db_url, max_attempts=1, webhook_secret=SECRET)
    past = datetime.now(UTC) - timedelta(hours=1)
    with db_engine.begin() as conn:
        queue.enqueue(
            conn,
            [EnqueueRequest.build(key=f"T-{i}", tenant=["a", "b", None][i % 3]) for i in range(6)],
            settings=cfg,
        )
        queue.enqueue(
            conn,
            [EnqueueRequest.build(key=f"R-{i}", kind="refresh") for i in range(2)],
            settings=cfg,
        )
        # A row visible an hour ago, claimed then with a 60 s lease: expired now.
        queue.enqueue(conn, [EnqueueRequest.build(key="T-old")], settings=cfg, now=past)
        assert (
            len(
                queue.claim(
                    conn, kinds=("enrich",), owner="w0", limit=1, lease_seconds=60, now=past
                )
            )
            == 1
        )
    with db_engine.begin() as conn:
        a, b, _c = queue.claim(conn, kinds=("enrich",), owner="w1", limit=3, lease_seconds=60)
        queue.complete(conn, owner="w1", jobs=[a])
        queue.retry(
            conn, owner="w1", failures=[(b, "boom")], backoff_base_seconds=0, backoff_cap_seconds=0
        )
        queue.claim(conn, kinds=("refresh",), owner="w1", limit=1, lease_seconds=60)
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.budget_ledger (day, bytes_billed, lookups)"
                " VALUES (CAST(timezone('UTC', now()) AS date), 123456789, 3)"
            )
        )
    with db_engine.connect() as conn:
        by_state = {
            (k, s): n
            for k, s, n in conn.execute(
                sa.text("SELECT kind, state, count(*) FROM enrichq.queue GROUP BY kind, state")
            )
        }
        dead = {
            (k, r): n
            for k, r, n in conn.execute(
                sa.text(
                    "SELECT kind, dead_reason, count(*) FROM enrichq.queue"
                    " WHERE state = 'dead_letter' GROUP BY kind, dead_reason"
                )
            )
        }
        live, expired = conn.execute(
            sa.text(
                "SELECT count(*) FILTER (WHERE lease_expires_at > now()),"
                " count(*) FILTER (WHERE lease_expires_at <= now())"
                " FROM enrichq.queue WHERE state = 'leased'"
            )
        ).one()
        age_before = conn.execute(
            sa.text(
                "SELECT extract(epoch FROM now() - min(visible_at)) FROM enrichq.queue"
                " WHERE state = 'queued' AND kind = 'enrich' AND visible_at <= now()"
            )
        ).scalar_one()

    # the sweeper leader's count of terminal rows, which the scrape reads
    counts.run_once(db_engine, statement_timeout_seconds=5)
    with TestClient(create_app(cfg, db_engine)) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert SECRET not in response.text
    samples = parse(response.text)

    assert names(samples) >= DB_GAUGES
    # Sanity of the scenario itself, so the comparison below compares something.
    assert by_state[("enrich", "dead_letter")] == 1
    assert by_state[("enrich", "leased")] == 2
    assert (live, expired) == (2, 1)
    assert by_state[("enrich", "done")] == 1
    for kind in ("enrich", "refresh"):
        for state in ("queued", "leased", "done", "failed", "dead_letter"):
            got = samples[("enrichq_queue_rows", (("kind", kind), ("state", state)))]
            assert got == by_state.get((kind, state), 0), (kind, state)
        for reason in ("attempts_exhausted", "superseded"):
            got = samples[("enrichq_queue_dead_letters", (("kind", kind), ("reason", reason)))]
            assert got == dead.get((kind, reason), 0), (kind, reason)
    assert samples[("enrichq_queue_counted_timestamp_seconds", ())] > past.timestamp()
    assert samples[("enrichq_queue_live_leases", ())] == live
    assert samples[("enrichq_queue_expired_leases", ())] == expired
    assert samples[("enrichq_budget_bytes_billed_today", ())] == 123456789
    assert samples[("enrichq_queue_oldest_visible_age_seconds", (("kind", "enrich"),))] >= float(
        age_before
    )
    assert samples[("enrichq_queue_oldest_visible_age_seconds", (("kind", "refresh"),))] >= 0
    assert samples[("enrichq_queue_dead_tuples", ())] >= 0
    assert samples[("enrichq_oldest_transaction_age_seconds", ())] >= 0
    assert samples[("enrichq_queue_last_autovacuum_timestamp_seconds", ())] >= 0
    # Process metrics are there too: the ingest counter and the build.
    assert ("enrichq_events_total", (("result", "accepted"),)) in samples
    assert any(name == "enrichq_build_info" for name, _ in samples)


def test_terminal_counts_are_absent_until_the_sweeper_has_counted(
    db_url: str, db_engine: sa.Engine
) -> None:
    """Before any sweeper has counted done, failed and dead-letter rows, /metrics leaves
    those samples out instead of showing 0: a dashboard must not read 'no dead letters'
    from a count nobody made. Open rows are counted live and are always there."""
    cfg = make_settings(db_url, webhook_secret=SECRET)
    with db_engine.begin() as conn:
        queue.enqueue(conn, [EnqueueRequest.build(key="T-1")], settings=cfg)
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.queue (kind, key, reason, state, max_attempts, attempts,"
                " dead_reason, finished_at) VALUES ('enrich', 'T-2', 'manual', 'dead_letter',"
                " 5, 5, 'attempts_exhausted', now())"
            )
        )

    registry = CollectorRegistry()
    registry.register(QueueCollector(db_engine, cache_seconds=0.0))

    def scrape() -> Samples:
        return parse(generate_latest(registry).decode())

    before = scrape()
    states = {dict(labels)["state"] for name, labels in before if name == "enrichq_queue_rows"}
    assert states == {"queued", "leased"}
    assert not any(name == "enrichq_queue_dead_letters" for name, _ in before)
    assert before[("enrichq_queue_counted_timestamp_seconds", ())] == 0
    counts.run_once(db_engine, statement_timeout_seconds=5)
    after = scrape()
    assert after[("enrichq_queue_rows", (("kind", "enrich"), ("state", "dead_letter")))] == 1
    assert after[("enrichq_queue_rows", (("kind", "enrich"), ("state", "done")))] == 0
    assert (
        after[("enrichq_queue_dead_letters", (("kind", "enrich"), ("reason", "superseded")))] == 0
    )


def test_a_scrape_storm_runs_the_queries_once_per_cache_period(
    db_engine: sa.Engine, statements: StatementCounter
) -> None:
    clock = [1000.0]
    registry = CollectorRegistry()
    registry.register(QueueCollector(db_engine, cache_seconds=5.0, clock=lambda: clock[0]))
    assert statements.count == 0  # registering reads nothing

    first = generate_latest(registry)
    per_read = statements.count
    assert per_read >= 8
    for _ in range(99):
        assert generate_latest(registry) == first
    assert statements.count == per_read

    clock[0] += 4.9
    generate_latest(registry)
    assert statements.count == per_read
    clock[0] += 0.1
    generate_latest(registry)
    assert statements.count == 2 * per_read


def test_concurrent_scrapes_share_one_read(
    db_engine: sa.Engine, statements: StatementCounter
) -> None:
    registry = CollectorRegistry()
    registry.register(QueueCollector(db_engine, cache_seconds=3600))
    start = threading.Barrier(10)
    outputs: list[bytes] = []

    def scrape() -> None:
        start.wait(timeout=30)
        for _ in range(10):
            outputs.append(generate_latest(registry))

    threads = [threading.Thread(target=scrape) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(outputs) == 100
    assert len(set(outputs)) == 1
    baseline = StatementCounter(db_engine)
    try:
        fresh = CollectorRegistry()
        fresh.register(QueueCollector(db_engine, cache_seconds=3600))
        generate_latest(fresh)
    finally:
        baseline.close()
    assert statements.count == 2 * baseline.count  # the storm's one read, and this one


def test_a_database_error_yields_no_gauges_and_counts_instead_of_raising(
    databases: Databases,
) -> None:
    # A real database without the enrichq schema: every observe query fails.
    engine = create_engine(databases.create_empty("metrics_error"), pool_size=1)
    clock = [0.0]
    try:
        registry = CollectorRegistry()
        registry.register(QueueCollector(engine, cache_seconds=5.0, clock=lambda: clock[0]))
        before = errors_counted()
        assert not DB_GAUGES & names(parse(generate_latest(registry).decode()))
        assert errors_counted() == before + 1
        # The failure is cached like a success: a storm does not hammer a sick database.
        generate_latest(registry)
        assert errors_counted() == before + 1
        clock[0] += 5.0
        generate_latest(registry)
        assert errors_counted() == before + 2
    finally:
        engine.dispose()


def test_register_is_idempotent_and_rebinds(db_engine: sa.Engine) -> None:
    first = register_queue_collector(db_engine)
    again = register_queue_collector(db_engine, cache_seconds=0.0)
    assert again is first
    assert again.engine is db_engine
    families = [
        f
        for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())
        if f.name == "enrichq_queue_rows"
    ]
    assert len(families) == 1
    assert families[0].samples


def test_build_info_and_the_standalone_metrics_server(db_engine: sa.Engine) -> None:
    ver = set_build_info("shadow")
    assert ver
    assert start_metrics_server(0) is None  # port 0 = disabled

    register_queue_collector(db_engine, cache_seconds=0.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_metrics_server(port, addr="127.0.0.1")
    assert server is not None
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    finally:
        server.stop()
    assert response.status_code == 200
    samples = parse(response.text)
    assert samples[("enrichq_build_info", (("mode", "shadow"), ("version", ver)))] == 1
    assert samples[("enrichq_queue_rows", (("kind", "enrich"), ("state", "queued")))] == 0
