"""HTTP ingest: signed events are queued; every bad request is refused and changes nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import httpx
import httpx2
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from sqlalchemy.engine import make_url
from tests.support import web
from tests.support.pg import Databases
from tests.support.settings import make_settings

from enrichq_schema.db import create_engine
from enrichq_schema.settings import Settings
from enrichq_service.http import create_app, sign, start_server_thread

SECRET = "whsec-test-5b1f0c9e7a3d"
URL = "/v1/events"


def event(ticket: object = "T-1", kind: str = "created", **fields: Any) -> dict[str, Any]:
    return {"ticket_id": ticket, "type": kind, "occurred_at": "2024-05-01T12:00:00Z", **fields}


def encode(body: object) -> bytes:
    return json.dumps(body).encode()


def signed(body: bytes, *, secret: str = SECRET, ts: int | str | None = None) -> dict[str, str]:
    return web.signed(body, secret, ts=ts)


def queue_rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT id, kind, key, tenant, reason, state, payload, created_at, visible_at"
                    " FROM enrichq.queue ORDER BY id"
                )
            )
        )


def events_counted(result: str) -> float:
    return REGISTRY.get_sample_value("enrichq_events_total", {"result": result}) or 0.0


def assert_refused(response: httpx2.Response, status: int, engine: sa.Engine) -> str:
    """The status, a one-line JSON detail without the secret, and an empty queue."""
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str)
    assert detail
    assert "\n" not in detail
    assert SECRET not in response.text
    assert queue_rows(engine) == []
    return detail


@pytest.fixture
def app_settings(db_url: str) -> Settings:
    return make_settings(
        db_url,
        webhook_secret=SECRET,
        delay_created_seconds=600,
        delay_updated_seconds=120,
        max_body_bytes=1_048_576,
    )


@pytest.fixture
def client(app_settings: Settings, db_engine: sa.Engine) -> Iterator[TestClient]:
    with TestClient(create_app(app_settings, db_engine)) as c:
        yield c


@pytest.fixture(scope="module")
def refusing(databases: Databases) -> Iterator[tuple[TestClient, sa.Engine]]:
    """One database for the tests whose requests must all be refused (its queue stays empty)."""
    url = databases.clone("http_refusals")
    engine = create_engine(url, pool_size=2)
    cfg = make_settings(url, webhook_secret=SECRET, max_body_bytes=1_048_576)
    try:
        with TestClient(create_app(cfg, engine)) as c:
            yield c, engine
    finally:
        engine.dispose()
        databases.drop(url)


def test_signed_event_is_queued_with_the_reason_delay_and_tenant(
    client: TestClient, db_engine: sa.Engine
) -> None:
    accepted_before = events_counted("accepted")
    body = encode(event("T-1", "created", tenant="acme", payload={"channel": "email"}))
    response = client.post(URL, content=body, headers=signed(body))
    assert response.status_code == 202, response.text
    answer = response.json()
    [row] = queue_rows(db_engine)
    assert answer == {
        "accepted": 1,
        "inserted": 1,
        "merged": 0,
        "duplicates": 0,
        "results": [{"ticket_id": "T-1", "inserted": True, "id": row.id, "duplicate": False}],
    }
    assert (row.kind, row.key, row.tenant, row.reason, row.state) == (
        "enrich",
        "T-1",
        "acme",
        "created",
        "queued",
    )
    # visible_at and created_at come from the same transaction's now(): the delay is exact.
    assert row.visible_at - row.created_at == timedelta(seconds=600)
    assert row.payload == {
        "occurred_at": "2024-05-01T12:00:00+00:00",
        "payload": {"channel": "email"},
    }

    # An updated ticket gets the shorter delay; a timestamp inside the tolerance is fine.
    body = encode(event("T-2", "updated"))
    response = client.post(URL, content=body, headers=signed(body, ts=int(time.time()) - 120))
    assert response.status_code == 202, response.text
    second = queue_rows(db_engine)[1]
    assert (second.reason, second.tenant) == ("updated", None)
    assert second.visible_at - second.created_at == timedelta(seconds=120)
    assert events_counted("accepted") == accepted_before + 2


def test_batch_with_a_duplicate_ticket_inserts_once_and_merges(
    client: TestClient, db_engine: sa.Engine
) -> None:
    batch = {
        "events": [
            event("T-1", "created", tenant="acme"),
            event("T-2", "updated"),
            event("T-1", "updated", tenant="acme"),
        ]
    }
    body = encode(batch)
    response = client.post(URL, content=body, headers=signed(body))
    assert response.status_code == 202, response.text
    answer = response.json()
    rows = queue_rows(db_engine)
    assert [(r.key, r.reason) for r in rows] == [("T-1", "created"), ("T-2", "updated")]
    ids = {r.key: r.id for r in rows}
    assert answer["accepted"] == 3
    assert answer["inserted"] == 2
    assert answer["merged"] == 1
    assert answer["results"] == [
        {"ticket_id": "T-1", "inserted": True, "id": ids["T-1"], "duplicate": False},
        {"ticket_id": "T-2", "inserted": True, "id": ids["T-2"], "duplicate": False},
        {"ticket_id": "T-1", "inserted": False, "id": ids["T-1"], "duplicate": False},
    ]

    # The same event again later merges into the queued row.
    body = encode(event("T-2", "created"))
    again = client.post(URL, content=body, headers=signed(body)).json()
    assert again["results"] == [
        {"ticket_id": "T-2", "inserted": False, "id": ids["T-2"], "duplicate": False}
    ]
    assert len(queue_rows(db_engine)) == 2


BODY = encode(event())
Headers = Callable[[int], dict[str, str]]


@pytest.mark.parametrize(
    ("headers", "result", "expected"),
    [
        pytest.param(lambda now: {}, "unauthorized", "missing", id="no-headers"),
        pytest.param(
            lambda now: {"X-Enrichq-Timestamp": str(now)}, "unauthorized", "missing", id="no-sig"
        ),
        pytest.param(
            lambda now: {"X-Enrichq-Signature": sign(SECRET, now, BODY)},
            "unauthorized",
            "missing",
            id="no-timestamp",
        ),
        pytest.param(
            lambda now: {"X-Enrichq-Timestamp": str(now), "X-Enrichq-Signature": "00" * 32},
            "unauthorized",
            "does not match",
            id="bad-signature",
        ),
        pytest.param(
            lambda now: {"X-Enrichq-Timestamp": str(now), "X-Enrichq-Signature": "not hex"},
            "unauthorized",
            "does not match",
            id="garbage-signature",
        ),
        pytest.param(
            lambda now: signed(BODY, secret="some-other-secret", ts=now),
            "unauthorized",
            "does not match",
            id="other-secret",
        ),
        pytest.param(
            lambda now: signed(encode(event("T-other")), ts=now),
            "unauthorized",
            "does not match",
            id="other-body",
        ),
        pytest.param(
            lambda now: {
                "X-Enrichq-Timestamp": str(now + 1),
                "X-Enrichq-Signature": sign(SECRET, now, BODY),
            },
            "unauthorized",
            "does not match",
            id="timestamp-not-signed",
        ),
        pytest.param(
            lambda now: signed(BODY, ts="soon"), "unauthorized", "unix seconds", id="ts-not-int"
        ),
        pytest.param(
            lambda now: signed(BODY, ts=now - 3600), "stale", "tolerance", id="stale-past"
        ),
        pytest.param(
            lambda now: signed(BODY, ts=now + 3600), "stale", "tolerance", id="stale-future"
        ),
    ],
)
def test_bad_or_stale_signatures_are_401_and_enqueue_nothing(
    refusing: tuple[TestClient, sa.Engine], headers: Headers, result: str, expected: str
) -> None:
    client, db_engine = refusing
    before = events_counted(result)
    response = client.post(URL, content=BODY, headers=headers(int(time.time())))
    assert expected in assert_refused(response, 401, db_engine)
    assert events_counted(result) == before + 1


def test_without_a_configured_secret_every_event_is_refused(
    db_url: str, db_engine: sa.Engine
) -> None:
    cfg = make_settings(db_url)
    assert cfg.webhook_secret is None
    with TestClient(create_app(cfg, db_engine)) as c:
        for headers in ({}, signed(BODY), signed(BODY, secret="")):
            detail = assert_refused(c.post(URL, content=BODY, headers=headers), 401, db_engine)
            assert "no webhook secret" in detail


def test_too_large_bodies_are_413_and_enqueue_nothing(db_url: str, db_engine: sa.Engine) -> None:
    limit = 4096
    cfg = make_settings(db_url, webhook_secret=SECRET, max_body_bytes=limit)
    small = encode(event())
    big = encode({"events": [event(f"T-{i}") for i in range(200)]})
    assert len(big) > limit
    before = events_counted("too_large")
    with TestClient(create_app(cfg, db_engine)) as c:
        # A real big body, correctly signed and declared.
        assert_refused(c.post(URL, content=big, headers=signed(big)), 413, db_engine)
        # Size is checked before the signature.
        assert_refused(c.post(URL, content=big, headers={}), 413, db_engine)
        # A Content-Length that claims too much is refused before reading.
        lying_big = {**signed(small), "Content-Length": str(limit * 1000)}
        assert_refused(c.post(URL, content=small, headers=lying_big), 413, db_engine)
        # A Content-Length that claims little for a big body: the bytes read are counted.
        lying_small = {**signed(big), "Content-Length": "100"}
        assert_refused(c.post(URL, content=big, headers=lying_small), 413, db_engine)
        # No Content-Length at all (chunked): the stream is capped.
        chunks = iter([big[i : i + 1000] for i in range(0, len(big), 1000)])
        assert_refused(c.post(URL, content=chunks, headers=signed(big)), 413, db_engine)
        assert events_counted("too_large") == before + 5

        # A body of exactly the limit is not too large.
        padded = small[:-1] + b" " * (limit - len(small)) + b"}"
        assert len(padded) == limit
        ok = c.post(URL, content=padded, headers=signed(padded))
        assert ok.status_code == 202, ok.text


EVENT_JSON = b'{"ticket_id": "T-1", "type": "created", "occurred_at": "2024-05-01T12:00:00Z"'


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(b"", "not valid JSON", id="empty"),
        pytest.param(b'{"ticket_id": ', "not valid JSON", id="malformed"),
        pytest.param(EVENT_JSON + b', "payload": {"x": NaN}}', "not valid JSON", id="nan"),
        pytest.param(b'"\\ud800"', "not valid JSON", id="lone-surrogate"),
        pytest.param(b"[1, 2]", "JSON object", id="array"),
        pytest.param(encode(event(ticket=5)), "ticket_id", id="ticket-id-int"),
        pytest.param(encode(event(kind="deleted")), "type", id="unknown-type"),
        pytest.param(encode({**event(), "color": "red"}), "color", id="extra-field"),
        pytest.param(encode({"events": [event()], "more": 1}), "more", id="extra-batch-field"),
        pytest.param(encode({"events": []}), "events", id="empty-batch"),
        pytest.param(
            encode({"events": [event(f"T-{i}") for i in range(1001)]}),
            "at most 1000",
            id="1001-events",
        ),
        pytest.param(encode(event("T" * 201)), "at most 200", id="ticket-id-too-long"),
        pytest.param(encode(event(tenant="")), "tenant", id="empty-tenant"),
        pytest.param(encode(event(tenant="x" * 201)), "tenant", id="tenant-too-long"),
        pytest.param(encode(event("   ")), "ticket_id: must not be blank", id="blank-ticket-id"),
        pytest.param(
            encode(event("T\u0000")),
            "ticket_id: must not contain control or format characters (U+0000)",
            id="nul-in-ticket-id",
        ),
        pytest.param(
            encode(event("w\u001b[2J\nFAKE LOG LINE")),
            "ticket_id: must not contain control or format characters (U+001B)",
            id="terminal-escape-in-ticket-id",
        ),
        pytest.param(
            encode(event("T-1\u0085")),
            "ticket_id: must not contain control or format characters (U+0085)",
            id="c1-control-in-ticket-id",
        ),
        pytest.param(
            encode(event(tenant="acme\u200b")),
            "tenant: must not contain control or format characters (U+200B)",
            id="zero-width-space-in-tenant",
        ),
        pytest.param(
            encode(event(tenant="\u202eemca")),
            "tenant: must not contain control or format characters (U+202E)",
            id="bidi-override-in-tenant",
        ),
        pytest.param(encode(event(tenant="\t")), "tenant: must not be blank", id="blank-tenant"),
        pytest.param(
            encode({**event(), "occurred_at": "2024-05-01T12:00:00"}),
            "occurred_at",
            id="naive-time",
        ),
        pytest.param(encode({**event(), "occurred_at": 1714564800}), "RFC 3339", id="unix-time"),
        pytest.param(
            encode({**event(), "occurred_at": "2024-13-01T12:00:00Z"}),
            "occurred_at",
            id="impossible-date",
        ),
        pytest.param(
            encode({k: v for k, v in event().items() if k != "type"}), "type", id="no-type"
        ),
        pytest.param(encode(event(payload=[1])), "payload", id="payload-not-object"),
        pytest.param(EVENT_JSON + b', "payload": {"x": 1e999}}', "finite", id="infinite"),
        pytest.param(encode(event(payload={"x": "a" * 70_000})), "64 KiB", id="payload-too-big"),
        pytest.param(encode(event(payload={"x": "\u0000"})), "NUL", id="nul-in-payload"),
        pytest.param(
            encode({"events": [event("T-1"), event("T-2", kind="deleted"), event("T-3")]}),
            "events[1].type",
            id="one-bad-event-in-batch",
        ),
        pytest.param(
            encode({"events": [event("T-1"), event("T-2", payload={"x": "\u0000"})]}),
            "events[1].payload: larger than 64 KiB or contains NUL",
            id="queue-refuses-one-event-in-batch",
        ),
    ],
)
def test_invalid_bodies_are_422_and_enqueue_nothing(
    refusing: tuple[TestClient, sa.Engine], body: bytes, expected: str
) -> None:
    client, db_engine = refusing
    before = events_counted("invalid")
    response = client.post(URL, content=body, headers=signed(body))
    detail = assert_refused(response, 422, db_engine)
    assert expected in detail
    assert events_counted("invalid") == before + 1


def test_health_and_readiness(
    client: TestClient, app_settings: Settings, databases: Databases
) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert (ready.status_code, ready.json()) == (200, {"status": "ok"})

    empty = create_engine(databases.create_empty("http_readyz"), pool_size=1)
    try:
        with TestClient(create_app(app_settings, empty)) as c:
            assert c.get("/healthz").status_code == 200
            response = c.get("/readyz")
            assert response.status_code == 503
            assert "run `enrichq migrate`" in response.json()["detail"]
    finally:
        empty.dispose()


def test_a_database_that_is_not_there_is_503_not_500(db_url: str, app_settings: Settings) -> None:
    missing = make_url(db_url).set(database="enrichq_no_such_database_here")
    engine = create_engine(missing, pool_size=1)
    try:
        with TestClient(create_app(app_settings, engine)) as c:
            assert c.get("/healthz").status_code == 200
            ready = c.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["detail"].startswith("database unreachable")
            before = events_counted("unavailable")
            response = c.post(URL, content=BODY, headers=signed(BODY))
            assert response.status_code == 503
            assert response.json() == {"detail": "database unavailable; retry later"}
            assert events_counted("unavailable") == before + 1
    finally:
        engine.dispose()


def test_the_secret_never_appears_in_errors_or_metrics(client: TestClient) -> None:
    for response in (
        client.post(URL, content=BODY, headers=signed(BODY, secret="wrong")),
        client.post(URL, content=b"{", headers=signed(b"{")),
        client.post(URL, content=BODY, headers=signed(BODY, ts=1)),
        client.get("/v1/nothing"),
        client.get(URL),
        client.get("/metrics"),
        client.get("/openapi.json"),
    ):
        assert SECRET not in response.text
        assert response.status_code < 500


def test_openapi_describes_the_real_shapes(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    post = spec["paths"]["/v1/events"]["post"]
    assert set(post["responses"]) == {"202", "400", "401", "413", "415", "422", "503"}
    body_ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schemas = spec["components"]["schemas"]
    body = schemas[body_ref.rsplit("/", 1)[1]]
    assert {s["$ref"].rsplit("/", 1)[1] for s in body["anyOf"]} == {"Event", "EventBatch"}
    assert schemas["Event"]["additionalProperties"] is False
    assert set(schemas["Event"]["required"]) == {"ticket_id", "type", "occurred_at"}
    assert schemas["EventBatch"]["properties"]["events"]["maxItems"] == 1000
    headers = {p["name"] for p in post["parameters"] if p["in"] == "header"}
    assert headers == {"X-Enrichq-Timestamp", "X-Enrichq-Signature"}
    assert "/readyz" in spec["paths"]
    assert "/metrics" in spec["paths"]


def test_a_real_uvicorn_server_accepts_a_signed_event_over_a_socket(
    app_settings: Settings, db_engine: sa.Engine
) -> None:
    server = start_server_thread(create_app(app_settings, db_engine))
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            body = encode(event("T-socket", "updated", tenant="acme"))
            response = http.post(URL, content=body, headers=signed(body))
            assert response.status_code == 202, response.text
            refused = http.post(URL, content=body, headers=signed(body, secret="nope"))
            assert refused.status_code == 401
            assert http.get("/readyz").status_code == 200
            assert "enrichq_events_total" in http.get("/metrics").text
    finally:
        server.stop()
    assert not server.thread.is_alive()
    [row] = queue_rows(db_engine)
    assert (row.key, row.reason, row.tenant, row.state) == ("T-socket", "updated", "acme", "queued")


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "json"],
)
def test_a_body_that_is_not_declared_json_is_415_and_enqueues_nothing(
    refusing: tuple[TestClient, sa.Engine], content_type: str | None
) -> None:
    client, engine = refusing
    headers = {k: v for k, v in signed(BODY).items() if k != "Content-Type"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    before = events_counted("unsupported")
    detail = assert_refused(client.post(URL, content=BODY, headers=headers), 415, engine)
    assert "application/json" in detail
    assert events_counted("unsupported") == before + 1


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/cloudevents+json",
    ],
)
def test_json_media_types_are_accepted(
    client: TestClient, db_engine: sa.Engine, content_type: str
) -> None:
    headers = {**signed(BODY), "Content-Type": content_type}
    response = client.post(URL, content=BODY, headers=headers)
    assert response.status_code == 202, response.text
