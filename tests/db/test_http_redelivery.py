"""Webhooks that are safe to redeliver: event ids, key rotation, and 503 while the database
is away (never 500)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from sqlalchemy.engine import make_url
from tests.support.pg import Databases
from tests.support.settings import make_settings
from tests.support.web import signed

from enrichq_schema.db import create_engine
from enrichq_schema.settings import Settings
from enrichq_service import events as ingest
from enrichq_service.http import create_app
from enrichq_service.queue import EnqueueRequest
from enrichq_sweeper import retention

OLD_SECRET = "whsec-old-8e2c41"
NEW_SECRET = "whsec-new-f07a93"
URL = "/v1/events"


def event(ticket: str = "T-1", event_id: str | None = "evt-1", **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "ticket_id": ticket,
        "type": "updated",
        "occurred_at": "2024-05-01T12:00:00Z",
        **fields,
    }
    if event_id is not None:
        body["id"] = event_id
    return body


def post(client: TestClient, body: object, secret: str = NEW_SECRET) -> Any:
    raw = json.dumps(body).encode()
    return client.post(URL, content=raw, headers=signed(raw, secret))


def rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(sa.text("SELECT id, key, state FROM enrichq.queue ORDER BY id"))
        ]


def counted(result: str) -> float:
    return REGISTRY.get_sample_value("enrichq_events_total", {"result": result}) or 0.0


@pytest.fixture
def app_settings(db_url: str) -> Settings:
    # rotation in progress: the new secret first, the old one still accepted
    return make_settings(db_url, webhook_secret=f"{NEW_SECRET}, {OLD_SECRET}")


@pytest.fixture
def client(app_settings: Settings, db_engine: sa.Engine) -> Iterator[TestClient]:
    with TestClient(create_app(app_settings, db_engine)) as c:
        yield c


# -- event ids


def test_a_redelivered_event_is_acknowledged_as_a_duplicate_and_enqueues_nothing(
    client: TestClient, db_engine: sa.Engine
) -> None:
    first = post(client, event("T-1", "evt-1"))
    assert first.status_code == 202, first.text
    [(row_id, _, _)] = rows(db_engine)
    before = counted("duplicate")
    again = post(client, event("T-1", "evt-1"))
    assert again.status_code == 202
    assert again.json() == {
        "accepted": 1,
        "inserted": 0,
        "merged": 0,
        "duplicates": 1,
        "results": [{"ticket_id": "T-1", "inserted": False, "id": row_id, "duplicate": True}],
    }
    assert counted("duplicate") == before + 1
    # a new event of the same ticket is no duplicate: it merges as always
    merged = post(client, event("T-1", "evt-2")).json()
    assert (merged["merged"], merged["duplicates"]) == (1, 0)
    assert len(rows(db_engine)) == 1


@pytest.mark.parametrize("then", ["claimed", "done", "pruned"])
def test_a_redelivery_after_the_row_moved_on_still_enqueues_nothing(
    client: TestClient, db_engine: sa.Engine, then: str
) -> None:
    assert post(client, event("T-1", "evt-1")).status_code == 202
    with db_engine.begin() as conn:
        if then == "claimed":
            conn.execute(
                sa.text(
                    "UPDATE enrichq.queue SET state = 'leased', attempts = 1, lease_owner = 'w',"
                    " lease_expires_at = now() + interval '1 minute'"
                )
            )
        elif then == "done":
            conn.execute(
                sa.text(
                    "UPDATE enrichq.queue SET state = 'done', attempts = 1, finished_at = now()"
                )
            )
        else:
            conn.execute(sa.text("DELETE FROM enrichq.queue"))
    before = rows(db_engine)
    answer = post(client, event("T-1", "evt-1")).json()
    assert answer["duplicates"] == 1
    assert rows(db_engine) == before  # in particular: no new queued row


def test_a_batch_dedupes_within_itself_and_against_the_past(
    client: TestClient, db_engine: sa.Engine
) -> None:
    assert post(client, event("T-1", "evt-1")).status_code == 202
    answer = post(
        client,
        {
            "events": [
                event("T-1", "evt-1"),  # seen before
                event("T-2", "evt-2"),  # new
                event("T-2", "evt-2"),  # the same id twice in one request
                event("T-3", None),  # no id: never a duplicate
                event("T-3", None),
            ]
        },
    ).json()
    assert [(r["ticket_id"], r["inserted"], r["duplicate"]) for r in answer["results"]] == [
        ("T-1", False, True),
        ("T-2", True, False),
        ("T-2", False, True),
        ("T-3", True, False),
        ("T-3", False, False),
    ]
    assert (answer["accepted"], answer["inserted"], answer["merged"], answer["duplicates"]) == (
        5,
        2,
        1,
        2,
    )
    ids = {key: row_id for row_id, key, _ in rows(db_engine)}
    assert answer["results"][2]["id"] == ids["T-2"]


def test_an_id_seen_before_the_window_counts_as_new(
    client: TestClient, db_engine: sa.Engine, app_settings: Settings
) -> None:
    assert post(client, event("T-1", "evt-1")).status_code == 202
    with db_engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE enrichq.seen_events SET seen_at = now() - interval '25 hours'")
        )
        conn.execute(sa.text("DELETE FROM enrichq.queue"))
    answer = post(client, event("T-1", "evt-1")).json()
    assert (answer["inserted"], answer["duplicates"]) == (1, 0)
    assert app_settings.event_dedupe_hours == 24


def test_an_enqueue_that_fails_does_not_mark_its_event_seen(
    db_engine: sa.Engine, app_settings: Settings
) -> None:
    delivery = ingest.Delivery("evt-9", EnqueueRequest.build(key="T-9"))
    with db_engine.connect() as conn:
        tx = conn.begin()
        ingest.enqueue(conn, [delivery], settings=app_settings)
        tx.rollback()  # the transaction failed after the enqueue
    with db_engine.begin() as conn:
        [outcome] = ingest.enqueue(conn, [delivery], settings=app_settings)
    assert (outcome.inserted, outcome.duplicate) == (True, False)


def test_bad_event_ids_are_422(client: TestClient, db_engine: sa.Engine) -> None:
    for bad, expected in (
        ("", "id"),
        ("e" * 201, "at most 200"),
        ("evt\n1", "control or format characters (U+000A)"),
        (17, "id"),
    ):
        response = post(client, {**event(), "id": bad})
        assert response.status_code == 422, response.text
        assert expected in response.json()["detail"]
    assert rows(db_engine) == []


def test_retention_prunes_event_ids_past_the_window_in_batches(db_engine: sa.Engine) -> None:
    now = datetime(2026, 3, 1, tzinfo=UTC)
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.seen_events (event_id, seen_at)"
                " SELECT 'old-' || g, CAST(:now AS timestamptz) - interval '25 hours'"
                "   - make_interval(secs => g) FROM generate_series(1, 5) AS g"
                " UNION ALL SELECT 'young-' || g, CAST(:now AS timestamptz) - interval '23 hours'"
                " FROM generate_series(1, 3) AS g"
            ),
            {"now": now},
        )
    result = retention.run_once(
        db_engine,
        retention_days=30,
        dead_letter_retention_days=90,
        event_dedupe_hours=24,
        batch_size=2,
        now=now,
    )
    assert result.seen_events == 5
    with db_engine.connect() as conn:
        left = conn.execute(sa.text("SELECT event_id FROM enrichq.seen_events")).scalars().all()
    assert sorted(left) == ["young-1", "young-2", "young-3"]


# -- several secrets: rotation without downtime


def test_a_signature_by_any_configured_secret_verifies(
    client: TestClient, db_engine: sa.Engine
) -> None:
    assert post(client, event("T-1", "a"), secret=NEW_SECRET).status_code == 202
    assert post(client, event("T-2", "b"), secret=OLD_SECRET).status_code == 202
    refused = post(client, event("T-3", "c"), secret="whsec-someone-else")
    assert refused.status_code == 401
    assert [key for _, key, _ in rows(db_engine)] == ["T-1", "T-2"]


def test_the_secrets_stay_out_of_responses_metrics_logs_and_the_settings_dump(
    client: TestClient, app_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    texts = [
        post(client, event(), secret="wrong").text,
        post(client, {"nope": 1}).text,
        client.post(URL, content=b"{", headers={"Content-Type": "text/plain"}).text,
        client.get("/metrics").text,
        client.get("/openapi.json").text,
        repr(app_settings.safe_dump()),
        repr(app_settings),
        caplog.text,
    ]
    for text in texts:
        for secret in (OLD_SECRET, NEW_SECRET):
            assert secret not in text


# -- the database away: 503 with Retry-After, never 500


def assert_unavailable(client: TestClient) -> None:
    response = post(client, event("T-down", "evt-down"))
    assert response.status_code == 503, response.text
    assert response.json() == {"detail": "database unavailable; retry later"}
    assert int(response.headers["Retry-After"]) > 0
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["detail"].startswith("database unreachable")
    assert client.get("/healthz").status_code == 200


def test_a_server_that_is_down_is_503_with_retry_after(app_settings: Settings) -> None:
    engine = create_engine("postgresql://nobody@127.0.0.1:1/none?connect_timeout=2", pool_size=1)
    try:
        with TestClient(create_app(app_settings, engine)) as c:
            assert_unavailable(c)
    finally:
        engine.dispose()


def test_a_database_dropped_under_the_app_is_503_with_retry_after(
    databases: Databases, app_settings: Settings
) -> None:
    url = databases.clone("dropped")
    engine = create_engine(url, pool_size=1)
    try:
        with TestClient(create_app(app_settings, engine)) as c:
            assert post(c, event("T-1", "evt-1")).status_code == 202  # the pool holds a session
            databases.drop(url)  # WITH (FORCE): that session is terminated too
            assert_unavailable(c)
    finally:
        engine.dispose()


def test_terminated_backends_are_survived_and_never_a_500(
    client: TestClient, db_url: str, db_engine: sa.Engine, databases: Databases
) -> None:
    assert post(client, event("T-1", "evt-1")).status_code == 202
    name = make_url(db_url).database
    admin = create_engine(databases.admin_url, isolation_level="AUTOCOMMIT", pool_size=1)
    try:
        for round_ in range(3):
            with admin.connect() as conn:
                killed = conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE datname = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": name},
                ).scalar()
            assert killed
            response = post(client, event(f"T-{round_ + 2}", f"evt-{round_ + 2}"))
            # the pool notices the dead session and reconnects (202), or says 503; never 500
            assert response.status_code in (202, 503), response.text
            if response.status_code == 503:
                assert "Retry-After" in response.headers
                response = post(client, event(f"T-{round_ + 2}", f"evt-{round_ + 2}"))
            assert response.status_code == 202, response.text
            assert client.get("/readyz").status_code == 200
    finally:
        admin.dispose()
    assert len(rows(db_engine)) == 4


def test_the_openapi_document_declares_the_event_id_415_and_retry_after(
    client: TestClient,
) -> None:
    spec = client.get("/openapi.json").json()
    post_op = spec["paths"]["/v1/events"]["post"]
    assert "Retry-After" in post_op["responses"]["503"]["headers"]
    assert "415" in post_op["responses"]
    event_schema = spec["components"]["schemas"]["Event"]
    assert "id" in event_schema["properties"]
    assert "id" not in event_schema["required"]
    assert "duplicate" in spec["components"]["schemas"]["EventResult"]["properties"]
