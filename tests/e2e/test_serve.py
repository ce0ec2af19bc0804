"""`enrichq serve` as a real process: a signed event becomes enriched rows."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from tests.support.db import q
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.web import answers, event, free_port, post_event

from enrichq_service import seed

pytestmark = pytest.mark.slow
SECRET = "e2e-secret-not-for-production"


def test_event_posted_over_http_is_enriched(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    with db_engine.begin() as conn:
        seed.seed_world(conn, tickets=20)
        ticket = conn.execute(
            sa.text(
                "SELECT t.id FROM helpdesk.tickets t "
                "JOIN warehouse.customers c ON lower(c.email) = lower(t.requester_email) "
                "JOIN warehouse.orders o ON o.customer_id = c.customer_id "
                "GROUP BY t.id ORDER BY count(*) DESC, t.id LIMIT 1"
            )
        ).scalar_one()
    port = free_port()
    serve = spawn(
        ["serve"],
        enrichq_env(
            db_url,
            http_host="127.0.0.1",
            http_port=port,
            webhook_secret=SECRET,
            delay_created_seconds=0,
            poll_seconds=0.2,
        ),
        log=tmp_path / "serve.log",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(f"{base}/readyz"), timeout=60, what="/readyz")
        response = post_event(base, SECRET, event(ticket, tenant="acme"))
        assert response.status_code == 202, response.text
        assert response.json()["inserted"] == 1
        done = "SELECT count(*) FROM enrichq.queue WHERE state = 'done'"
        wait_for(lambda: q(db_engine, done) == [(1,)], timeout=60, what="the ticket done")
        expected = q(
            db_engine,
            "SELECT o.order_id FROM helpdesk.tickets t "
            "JOIN warehouse.customers c ON lower(c.email) = lower(t.requester_email) "
            "JOIN warehouse.orders o ON o.customer_id = c.customer_id "
            "WHERE t.id = :t ORDER BY 1",
            t=ticket,
        )
        assert expected
        got = q(
            db_engine,
            "SELECT order_id FROM enrichq.ticket_orders WHERE ticket_id = :t ORDER BY 1",
            t=ticket,
        )
        assert got == expected
        assert q(db_engine, "SELECT ticket_id, status, rows FROM enrichq.lookup_log") == [
            (ticket, "ok", len(expected))
        ]
        assert q(db_engine, "SELECT key, reason, tenant, attempts FROM enrichq.queue") == [
            (ticket, "created", "acme", 1)
        ]
        families = {
            f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
        }
        outcomes = {
            (s.labels["kind"], s.labels["outcome"]): s.value
            for s in families["enrichq_job_outcomes"].samples
            if s.name == "enrichq_job_outcomes_total"
        }
        assert outcomes[("enrich", "done")] == 1
        assert SECRET not in httpx.get(f"{base}/metrics").text
    finally:
        assert stop(serve) == 0
    assert SECRET not in (tmp_path / "serve.log").read_text()


def test_ingest_stays_up_when_the_worker_inside_serve_stops(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """The help-desk table renamed under a running serve makes its worker stop on an error
    (a misnamed one is refused at start-up: tests/db/test_mirror_at_startup.py). Before, the
    whole process exited 1 and the next POST got 'connection refused' (events lost
    upstream); now ingest keeps accepting, /readyz says what stopped, /healthz does not ask
    for a restart, and the stop is counted."""
    with db_engine.begin() as conn:
        seed.seed_world(conn, tickets=5)
    port = free_port()
    serve = spawn(
        ["serve"],
        enrichq_env(
            db_url,
            http_host="127.0.0.1",
            http_port=port,
            webhook_secret=SECRET,
            delay_created_seconds=0,
            poll_seconds=0.2,
        ),
        log=tmp_path / "serve.log",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(f"{base}/readyz"), timeout=60, what="/readyz")
        with db_engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE helpdesk.tickets RENAME TO tickets_gone"))
        first = post_event(base, SECRET, event("T-000001", tenant="acme"))
        assert first.status_code == 202, first.text

        def degraded() -> bool:
            body = httpx.get(f"{base}/readyz").json()
            return bool(body.get("status") == "ingest only")

        wait_for(degraded, timeout=60, what="/readyz to say the worker stopped")
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 200
        assert "worker stopped on an error" in ready.json()["detail"]
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert (
            'enrichq_worker_errors_total{thread="serve"} 1.0' in httpx.get(f"{base}/metrics").text
        )
        assert serve.poll() is None
        second = post_event(base, SECRET, event("T-000002", tenant="acme"))
        assert second.status_code == 202, second.text
        queued = "SELECT count(*) FROM enrichq.queue WHERE key = 'T-000002'"
        assert q(db_engine, queued) == [(1,)]
    finally:
        code = stop(serve)
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert "serve: its worker stopped on an error" in (tmp_path / "serve.log").read_text()
