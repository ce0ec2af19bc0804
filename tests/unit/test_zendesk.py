"""Zendesk webhooks: verification as Zendesk documents it and the mapping of its bodies."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from tests.support.zendesk import encode, ticket_event, trigger_body, user_event, zendesk_sign

from enrichq_schema.settings import ZendeskTenantField
from enrichq_service import zendesk
from enrichq_service.signatures import Rejection

SECRET = "dGhlIHNpZ25pbmcgc2VjcmV0"
STAMP = "2099-07-04T05:33:20Z"
NOW = datetime(2099, 7, 4, 5, 33, 20, tzinfo=UTC).timestamp()
SENT = datetime(2099, 7, 4, 5, 33, 20, tzinfo=UTC)


def verify(body: bytes, signature: str, *, stamp: str = STAMP, now: float = NOW) -> object:
    return zendesk.verify([SECRET], stamp, signature, body, now=now, tolerance_seconds=300)


def parse(body: object, field: str = "brand_id", invocation: str | None = None) -> object:
    return zendesk.parse(
        encode(body),
        tenant_field=ZendeskTenantField(field),
        invocation_id=invocation,
        sent_at=SENT,
    )


def test_zendesk_signature_is_base64_hmac_of_timestamp_and_body() -> None:
    body = encode(ticket_event())
    assert zendesk.sign(SECRET, STAMP, body) == zendesk_sign(SECRET, STAMP, body)
    assert verify(body, zendesk_sign(SECRET, STAMP, body)) is None


@pytest.mark.parametrize(
    ("change", "result"),
    [("body", "unauthorized"), ("secret", "unauthorized"), ("stale", "stale")],
)
def test_refusals(change: str, result: str) -> None:
    body = encode(ticket_event())
    signature = zendesk_sign("other" if change == "secret" else SECRET, STAMP, body)
    rejection = verify(
        body + (b" " if change == "body" else b""),
        signature,
        now=NOW + (301 if change == "stale" else 0),
    )
    assert isinstance(rejection, Rejection)
    assert (rejection.status, rejection.result) == (401, result)


def test_a_signature_that_is_not_ascii_is_refused_not_an_error() -> None:
    assert isinstance(verify(b"{}", "\udcff\u00e9"), Rejection)


def test_ticket_created_maps_to_created_with_the_brand_as_tenant() -> None:
    event = parse(ticket_event("ticket.created", ticket="35436", event_id="E1"))
    assert event == zendesk.TicketEvent(
        "zendesk:E1",
        "35436",
        "created",
        "360001234567",
        datetime(2099, 7, 4, 5, 33, 18, tzinfo=UTC),
        "zen:event-type:ticket.created",
    )


def test_other_ticket_events_map_to_updated() -> None:
    event = parse(ticket_event("ticket.tags_changed"))
    assert isinstance(event, zendesk.TicketEvent)
    assert event.reason == "updated"


def test_the_tenant_field() -> None:
    assert getattr(parse(ticket_event(), "organization_id"), "tenant", "") == "5090000012"
    assert getattr(parse(ticket_event(), "none"), "tenant", "") is None
    no_org = ticket_event(organization_id=None)
    assert getattr(parse(no_org, "organization_id"), "tenant", "") is None


def test_a_non_ticket_event_is_ignored() -> None:
    assert parse(user_event()) == zendesk.NotATicketEvent("zen:event-type:user.active_changed")


def test_a_trigger_body_uses_the_invocation_id_and_the_signature_time() -> None:
    event = parse(trigger_body("12", "created", brand_id="7"), invocation="inv-9")
    assert event == zendesk.TicketEvent(
        "zendesk:inv-9", "12", "created", "7", SENT, "trigger:created"
    )


@pytest.mark.parametrize(
    "body",
    [
        trigger_body(""),
        trigger_body("12", "deleted"),
        trigger_body("12", occurred_at="yesterday"),
        {**ticket_event(), "subject": "zen:ticket:", "detail": {"id": ""}},
        {**ticket_event(), "time": "2099-07-04T05:33:18"},  # no zone
        {**ticket_event(), "id": 5},
        {"type": "updated", "ticket": "12"},  # a mistyped template is no ignored event
        [ticket_event()],
    ],
)
def test_invalid_bodies_are_422(body: object) -> None:
    rejection = parse(body)
    assert isinstance(rejection, Rejection)
    assert rejection.status == 422
