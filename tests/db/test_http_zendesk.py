"""POST /v1/zendesk: Zendesk's webhooks as Zendesk sends and signs them (docs/zendesk.md),
Standard Webhooks on POST /v1/events, and ingest answering in time whatever the database
does."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from tests.support.settings import make_settings
from tests.support.web import signed
from tests.support.zendesk import (
    ZENDESK_PATH,
    encode,
    ticket_event,
    trigger_body,
    user_event,
    zendesk_headers,
)

from enrichq_schema.db import create_engine
from enrichq_schema.settings import Settings
from enrichq_service.http import create_app

SECRET = "dGhlIHNpZ25pbmcgc2VjcmV0IG9mIHRoZSBuZXcgd2ViaG9vaw"
OLD_SECRET = "b2xkIHNpZ25pbmcgc2VjcmV0IGJlZm9yZSB0aGUgcm90YXRpb24"
WHSEC = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OTHER_WHSEC = "whsec_" + base64.b64encode(b"another key, not the one configured").decode()


def queue_rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT id, key, tenant, reason, payload FROM enrichq.queue ORDER BY id")
            )
        )


def counted(result: str) -> float:
    return REGISTRY.get_sample_value("enrichq_events_total", {"result": result}) or 0.0


def deliver(client: TestClient, body: object, secret: str = SECRET, **kw: Any) -> Any:
    raw = encode(body)
    return client.post(ZENDESK_PATH, content=raw, headers=zendesk_headers(raw, secret, **kw))


@pytest.fixture
def app_settings(db_url: str) -> Settings:
    # a rotation in progress: the new secret first, the old one still accepted
    return make_settings(
        db_url,
        zendesk_signing_secret=f"{SECRET}, {OLD_SECRET}",
        webhook_secret=f"enrichq-hex-secret-1, {WHSEC}",
    )


@pytest.fixture
def client(app_settings: Settings, db_engine: sa.Engine) -> Iterator[TestClient]:
    with TestClient(create_app(app_settings, db_engine)) as c:
        yield c


# -- mappings


def test_a_zendesk_ticket_created_event_is_queued_as_created_for_its_brand(
    client: TestClient, db_engine: sa.Engine
) -> None:
    response = deliver(client, ticket_event("ticket.created", ticket="35436"))
    assert response.status_code == 202, response.text
    assert response.json()["inserted"] == 1
    [row] = queue_rows(db_engine)
    assert (row.key, row.tenant, row.reason) == ("35436", "360001234567", "created")
    assert row.payload["occurred_at"] == "2099-07-04T05:33:18+00:00"


@pytest.mark.parametrize(
    "kind", ["ticket.status_changed", "ticket.comment_added", "ticket.priority_changed"]
)
def test_every_other_ticket_event_is_queued_as_updated(
    client: TestClient, db_engine: sa.Engine, kind: str
) -> None:
    assert deliver(client, ticket_event(kind, ticket="77")).status_code == 202
    [row] = queue_rows(db_engine)
    assert (row.key, row.reason) == ("77", "updated")


def test_a_trigger_body_is_queued_with_its_event(client: TestClient, db_engine: sa.Engine) -> None:
    body = trigger_body("901", "created", brand_id="360009", occurred_at="2026-01-05T12:00Z")
    response = deliver(client, body, invocation_id="8350205582")
    assert response.status_code == 202, response.text
    [row] = queue_rows(db_engine)
    assert (row.key, row.tenant, row.reason) == ("901", "360009", "created")
    assert row.payload["occurred_at"] == "2026-01-05T12:00:00+00:00"
    assert deliver(client, trigger_body("902"), invocation_id="8350205583").status_code == 202
    assert [r.reason for r in queue_rows(db_engine)] == ["created", "updated"]


@pytest.mark.parametrize(("field", "expected"), [("organization_id", "5090000012"), ("none", None)])
def test_the_tenant_is_the_configured_ticket_field(
    db_url: str, db_engine: sa.Engine, field: str, expected: str | None
) -> None:
    cfg = make_settings(db_url, zendesk_signing_secret=SECRET, zendesk_tenant_field=field)
    with TestClient(create_app(cfg, db_engine)) as c:
        assert deliver(c, ticket_event()).status_code == 202
    [row] = queue_rows(db_engine)
    assert row.tenant == expected


def test_a_ticket_without_an_organization_has_no_tenant(db_url: str, db_engine: sa.Engine) -> None:
    cfg = make_settings(
        db_url, zendesk_signing_secret=SECRET, zendesk_tenant_field="organization_id"
    )
    with TestClient(create_app(cfg, db_engine)) as c:
        assert deliver(c, ticket_event(organization_id=None)).status_code == 202
    [row] = queue_rows(db_engine)
    assert row.tenant is None


def test_a_non_ticket_event_is_2xx_counted_and_enqueues_nothing(
    client: TestClient, db_engine: sa.Engine
) -> None:
    before = counted("ignored")
    response = deliver(client, user_event())
    assert response.status_code == 200, response.text
    assert response.json() == {"ignored": "zen:event-type:user.active_changed"}
    assert counted("ignored") == before + 1
    assert queue_rows(db_engine) == []


# -- dedupe


def test_a_redelivered_event_is_2xx_as_a_duplicate_and_enqueues_nothing(
    client: TestClient, db_engine: sa.Engine
) -> None:
    first = deliver(client, ticket_event(event_id="01HNXAAAA"))
    assert first.status_code == 202
    [(row_id, *_)] = queue_rows(db_engine)
    # Zendesk re-signs a retry with a new timestamp; the event id stays
    again = deliver(client, ticket_event(event_id="01HNXAAAA"))
    assert again.status_code == 202
    assert (again.json()["duplicates"], again.json()["results"][0]["id"]) == (1, row_id)
    assert len(queue_rows(db_engine)) == 1
    # another event of the same ticket is no duplicate
    assert deliver(client, ticket_event(event_id="01HNXBBBB")).json()["duplicates"] == 0


def test_a_redelivered_trigger_is_a_duplicate_by_its_invocation_id(
    client: TestClient, db_engine: sa.Engine
) -> None:
    assert deliver(client, trigger_body("5"), invocation_id="inv-1").json()["inserted"] == 1
    with db_engine.begin() as conn:  # the row moved on: a redelivery must not queue it again
        conn.execute(sa.text("DELETE FROM enrichq.queue"))
    again = deliver(client, trigger_body("5"), invocation_id="inv-1")
    assert (again.status_code, again.json()["duplicates"]) == (202, 1)
    assert queue_rows(db_engine) == []


# -- refusals


def test_refusals_are_401_and_enqueue_nothing(client: TestClient, db_engine: sa.Engine) -> None:
    raw = encode(ticket_event())
    good = zendesk_headers(raw, SECRET)
    tampered = client.post(ZENDESK_PATH, content=raw + b" ", headers=good)
    wrong = client.post(ZENDESK_PATH, content=raw, headers=zendesk_headers(raw, "not-the-secret"))
    ten_min_ago = (datetime.now(UTC) - timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    stale = client.post(
        ZENDESK_PATH, content=raw, headers=zendesk_headers(raw, SECRET, ts=ten_min_ago)
    )
    unix = str(int(time.time()))
    not_iso = client.post(ZENDESK_PATH, content=raw, headers=zendesk_headers(raw, SECRET, ts=unix))
    enrichq_style = client.post(
        ZENDESK_PATH, content=raw, headers={"Content-Type": "application/json"}
    )
    for response in (tampered, wrong, stale, not_iso, enrichq_style):
        assert response.status_code == 401, response.text
        assert SECRET not in response.text
    assert "tolerance" in stale.json()["detail"]
    assert queue_rows(db_engine) == []


def test_the_rotated_out_secret_still_verifies_during_the_rotation(
    client: TestClient, db_engine: sa.Engine
) -> None:
    assert deliver(client, ticket_event(), secret=OLD_SECRET).status_code == 202
    assert len(queue_rows(db_engine)) == 1


def test_without_a_zendesk_secret_every_delivery_is_refused(
    db_url: str, db_engine: sa.Engine
) -> None:
    with TestClient(create_app(make_settings(db_url, webhook_secret=SECRET), db_engine)) as c:
        response = deliver(c, ticket_event())
    assert response.status_code == 401
    assert "ENRICHQ_ZENDESK_SIGNING_SECRET" in response.json()["detail"]
    assert queue_rows(db_engine) == []


def test_a_bad_ticket_body_is_422(client: TestClient, db_engine: sa.Engine) -> None:
    for body in (
        {"type": "zen:event-type:ticket.created", "id": "x", "time": "2099-07-04T05:33:18Z"},
        trigger_body("\u202e35436"),
        trigger_body("35436", "deleted"),
        [ticket_event()],
    ):
        assert deliver(client, body).status_code == 422
    assert queue_rows(db_engine) == []


# -- Standard Webhooks on POST /v1/events


def standard_headers(body: bytes, *signatures: str, msg_id: str, ts: int) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": " ".join(signatures),
    }


def standard_signature(secret: str, msg_id: str, ts: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


EVENT = {"ticket_id": "T-9", "type": "created", "occurred_at": "2026-01-05T12:00:00Z"}


def test_a_standard_webhook_with_two_signatures_one_valid_is_accepted(
    client: TestClient, db_engine: sa.Engine
) -> None:
    raw = json.dumps(EVENT).encode()
    now = int(time.time())
    valid = standard_signature(WHSEC, "msg_1", now, raw)
    rotated_out = standard_signature(OTHER_WHSEC, "msg_1", now, raw)
    headers = standard_headers(raw, rotated_out, valid, msg_id="msg_1", ts=now)
    response = client.post("/v1/events", content=raw, headers=headers)
    assert response.status_code == 202, response.text
    [row] = queue_rows(db_engine)
    assert (row.key, row.reason) == ("T-9", "created")
    # webhook-id is the idempotency key of an event without an id of its own
    again = client.post("/v1/events", content=raw, headers=headers)
    assert (again.status_code, again.json()["duplicates"]) == (202, 1)


def test_standard_webhooks_refusals_are_401(client: TestClient, db_engine: sa.Engine) -> None:
    raw = json.dumps(EVENT).encode()
    now = int(time.time())
    other = standard_signature(OTHER_WHSEC, "msg_2", now, raw)
    old = now - 3600
    cases = [
        standard_headers(raw, other, msg_id="msg_2", ts=now),  # wrong secret
        standard_headers(raw, standard_signature(WHSEC, "msg_2", old, raw), msg_id="msg_2", ts=old),
        standard_headers(raw, standard_signature(WHSEC, "msg_3", now, raw), msg_id="msg_2", ts=now),
        # the enrichq secret used as if it were a Standard Webhooks key
        standard_headers(
            raw,
            "v1,"
            + base64.b64encode(
                hmac.new(b"enrichq-hex-secret-1", f"msg_2.{now}.".encode() + raw, "sha256").digest()
            ).decode(),
            msg_id="msg_2",
            ts=now,
        ),
    ]
    for headers in cases:
        response = client.post("/v1/events", content=raw, headers=headers)
        assert response.status_code == 401, response.text
    assert queue_rows(db_engine) == []


# -- answering in time


@pytest.fixture
def silent_database() -> Iterator[tuple[str, socket.socket]]:
    """A URL of a server that accepts TCP connections and never says a word, and its socket
    (closing it resets the connections waiting on it)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)  # the kernel completes the handshakes; nothing ever answers
        port = listener.getsockname()[1]
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", listener


@pytest.mark.parametrize("path", ["/v1/zendesk", "/v1/events"])
def test_a_silent_database_makes_ingest_answer_503_with_retry_after_in_time(
    silent_database: tuple[str, socket.socket], path: str
) -> None:
    url, listener = silent_database
    cfg = make_settings(
        url,
        zendesk_signing_secret=SECRET,
        webhook_secret="enrichq-hex-secret-1",
        ingest_database_timeout_seconds=1,
    )
    engine = create_engine(url, pool_size=1)
    try:
        with TestClient(create_app(cfg, engine)) as c:
            if path == "/v1/zendesk":
                raw = encode(ticket_event())
                headers = zendesk_headers(raw, SECRET)
            else:
                raw = json.dumps(EVENT).encode()
                headers = signed(raw, "enrichq-hex-secret-1")
            started = time.monotonic()
            response = c.post(path, content=raw, headers=headers)
            took = time.monotonic() - started
            listener.close()  # the abandoned attempt ends; the server can stop
    finally:
        engine.dispose()
    assert response.status_code == 503, response.text
    assert 0 < int(response.headers["Retry-After"]) < 60  # the only 5xx Zendesk retries
    # Zendesk gives up after 12 s; before the bound this took the 10 s connect timeout
    assert took < 5, took
