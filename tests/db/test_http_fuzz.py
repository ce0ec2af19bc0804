"""POST /v1/events fuzzed from its own OpenAPI schema: never a 5xx, never a partial enqueue.

Schemathesis generates requests that fit the schema and requests that break it. Each is
sent twice: as generated (its headers are random, so it must be refused) and signed with
the real secret (so the body itself is judged). A refused request must leave the queue
exactly as it was; an accepted one must add at most one row per event.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from tests.support.pg import Databases
from tests.support.settings import make_settings
from tests.support.web import EVENTS_PATH, signed

from enrichq_schema.db import create_engine
from enrichq_service.http import create_app

SECRET = "whsec-fuzz-1b7e"

_state: dict[str, Any] = {}


@pytest.fixture(scope="module")
def fuzz_db(databases: Databases) -> Iterator[sa.Engine]:
    url = databases.clone("fuzz")
    engine = create_engine(url)
    app = create_app(make_settings(url, webhook_secret=SECRET), engine)
    _state.update(engine=engine, app=app, client=TestClient(app))
    yield engine
    _state["client"].close()
    engine.dispose()
    databases.drop(url)


def _app() -> FastAPI:
    # The schema is read from a throwaway app: the same routes, no database needed.
    return create_app(make_settings(None, webhook_secret=SECRET), create_engine("postgresql://"))


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


def rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM enrichq.queue")).scalar_one())


@schema.include(path="/v1/events", method="POST").parametrize()
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_events_endpoint_never_errors_and_never_half_enqueues(
    case: Any, fuzz_db: sa.Engine
) -> None:
    client: TestClient = _state["client"]
    before = rows(fuzz_db)
    as_generated = case.call(session=client)
    assert as_generated.status_code < 500, as_generated.text
    if as_generated.status_code >= 400:
        assert rows(fuzz_db) == before
    assert SECRET not in as_generated.text

    # a generated body may be absent (NotSet) or not even JSON-shaped
    body = json.dumps(case.body).encode() if isinstance(case.body, (dict, list)) else b"{"
    before = rows(fuzz_db)
    resigned = client.post(EVENTS_PATH, content=body, headers=signed(body, SECRET))
    assert resigned.status_code < 500, resigned.text
    assert resigned.status_code in (202, 413, 422), resigned.text
    after = rows(fuzz_db)
    if resigned.status_code == 202:
        assert after - before == resigned.json()["inserted"]
    else:
        assert after == before
        assert len(resigned.json()["detail"].splitlines()) == 1


# Bodies the schema calls valid, only: a schema-driven client that builds a body by the
# schema must never see it refused as invalid (issue #29: the ids' rules are in the schema).
positive = schemathesis.openapi.from_asgi("/openapi.json", _app())
# NUL in the payload's strings is refused as the payload's description says, which JSON
# Schema has no keyword for
positive.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE], allow_x00=False)


@positive.include(path="/v1/events", method="POST").parametrize()
@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_every_body_the_schema_calls_valid_is_accepted(case: Any, fuzz_db: sa.Engine) -> None:
    client: TestClient = _state["client"]
    body = json.dumps(case.body).encode()
    answer = client.post(EVENTS_PATH, content=body, headers=signed(body, SECRET))
    # 413: the schema cannot say how large a body may be (ENRICHQ_MAX_BODY_BYTES)
    assert answer.status_code in (202, 413), (answer.text, case.body)
