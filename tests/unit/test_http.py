"""Ingest's pure core, without a server or a database: a signature verified against the
secrets and the clock, and a body parsed into events or a 422 saying why not (the requests
through the app, and what they leave in the queue: tests/db/test_http.py)."""

from __future__ import annotations

import json

import pytest

from enrichq_service.http import parse_events, sign, verify
from enrichq_service.signatures import Rejection

SECRET = "whsec-unit-5b1d"
BODY = b'{"ticket_id": "T-1", "type": "created", "occurred_at": "2024-05-01T12:00:00Z"}'
NOW = 1_714_564_800


def check(
    secrets: list[str] | str | None, timestamp: str | None, signature: str | None
) -> Rejection | None:
    return verify(secrets, timestamp, signature, BODY, now=NOW, tolerance_seconds=300)


def test_a_signature_within_tolerance_verifies_with_any_current_secret() -> None:
    assert check(SECRET, str(NOW), sign(SECRET, NOW, BODY)) is None
    assert check(SECRET, str(NOW - 300), sign(SECRET, NOW - 300, BODY)) is None
    # during a rotation either secret signs; case and padding of the hex do not matter
    assert check(["old-secret", SECRET], str(NOW), sign(SECRET, NOW, BODY)) is None
    assert check(SECRET, f" {NOW} ", f" {sign(SECRET, NOW, BODY).upper()} ") is None


@pytest.mark.parametrize(
    ("secrets", "timestamp", "signature", "result", "says"),
    [
        (None, str(NOW), sign(SECRET, NOW, BODY), "unauthorized", "no webhook secret"),
        ([], str(NOW), sign(SECRET, NOW, BODY), "unauthorized", "no webhook secret"),
        (SECRET, None, sign(SECRET, NOW, BODY), "unauthorized", "missing"),
        (SECRET, str(NOW), None, "unauthorized", "missing"),
        (SECRET, str(NOW), sign("other", NOW, BODY), "unauthorized", "does not match"),
        (SECRET, str(NOW + 1), sign(SECRET, NOW, BODY), "unauthorized", "does not match"),
        (SECRET, "soon", sign(SECRET, "soon", BODY), "unauthorized", "unix seconds"),
        (SECRET, str(NOW - 301), sign(SECRET, NOW - 301, BODY), "stale", "tolerance"),
        (SECRET, str(NOW + 301), sign(SECRET, NOW + 301, BODY), "stale", "tolerance"),
        (SECRET, "\uff11\uff17", sign(SECRET, NOW, BODY), "unauthorized", "does not match"),
    ],
    ids=[
        "no secret", "empty list", "no timestamp", "no signature", "other secret",
        "timestamp not signed", "timestamp not unix seconds", "stale past", "stale future",
        "non-ascii timestamp",
    ],
)  # fmt: skip
def test_a_bad_or_stale_signature_is_a_401(
    secrets: list[str] | str | None, timestamp: str, signature: str | None, result: str, says: str
) -> None:
    rejection = check(secrets, timestamp, signature)
    assert rejection is not None
    assert (rejection.status, rejection.result) == (401, result)
    assert says in rejection.detail


def event(ticket: str = "T-1", **fields: object) -> dict[str, object]:
    return {"ticket_id": ticket, "type": "updated", "occurred_at": "2024-05-01T12:00:00Z"} | fields


def test_a_body_is_one_event_or_a_batch() -> None:
    single = parse_events(json.dumps(event(tenant="acme")).encode())
    assert not isinstance(single, Rejection)
    [one] = single
    assert (one.ticket_id, one.type, one.tenant) == ("T-1", "updated", "acme")
    batch = parse_events(json.dumps({"events": [event("T-1"), event("T-2")]}).encode())
    assert not isinstance(batch, Rejection)
    assert [e.ticket_id for e in batch] == ["T-1", "T-2"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"", "not valid JSON"),
        (b'{"ticket_id": ', "not valid JSON"),
        (b'{"x": NaN}', "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps(event(type="deleted")).encode(), "type"),
        (json.dumps(event(color="red")).encode(), "color"),
        (json.dumps({"events": []}).encode(), "events"),
        (json.dumps({"events": [event(), event(type="deleted")]}).encode(), "events[1].type"),
        (json.dumps(event("   ")).encode(), "ticket_id: must not be blank"),
    ],
    ids=[
        "empty", "malformed", "nan", "array", "unknown type", "extra field", "empty batch",
        "one bad event of a batch", "blank ticket id",
    ],
)  # fmt: skip
def test_an_invalid_body_is_a_422_saying_why(body: bytes, says: str) -> None:
    rejection = parse_events(body)
    assert isinstance(rejection, Rejection)
    assert (rejection.status, rejection.result) == (422, "invalid")
    assert says in rejection.detail
    assert "\n" not in rejection.detail
