"""`enrichq serve` as a real process: a signed event becomes enriched rows."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from tests.support.db import q
from tests.support.procs import enrichq_env, spawn, stop, wait_for

from enrichq_service import seed
from enrichq_service.http import sign

pytestmark = pytest.mark.slow
SECRET = "e2e-secret-not-for-production"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def signed(body: bytes) -> dict[str, str]:
    stamp = str(int(time.time()))
    return {
        "Content-Type": "application/json",
        "X-Enrichq-Timestamp": stamp,
        "X-Enrichq-Signature": sign(SECRET, stamp, body),
    }


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
        wait_for(lambda: _ready(base), timeout=60, what="/readyz")
        body = json.dumps(
            {
                "ticket_id": ticket,
                "type": "created",
                "tenant": "acme",
                "occurred_at": "2026-01-05T12:00:00Z",
            }
        ).encode()
        response = httpx.post(f"{base}/v1/events", content=body, headers=signed(body))
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


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
