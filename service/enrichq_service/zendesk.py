"""Zendesk webhooks as Zendesk sends them (POST /v1/zendesk): signature verification and
the mapping of its two body shapes to events. Pure functions; http.py is the HTTP layer."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic_core import from_json

from enrichq_schema.settings import ZendeskTenantField
from enrichq_schema.states import EVENT_ID_MAX_LENGTH, KEY_MAX_LENGTH, Kind
from enrichq_schema.text import id_problem, unsafe_character
from enrichq_service import events as ingest
from enrichq_service import queue
from enrichq_service.signatures import Rejection

SIGNATURE_HEADER = "X-Zendesk-Webhook-Signature"
TIMESTAMP_HEADER = "X-Zendesk-Webhook-Signature-Timestamp"
INVOCATION_HEADER = "X-Zendesk-Webhook-Invocation-Id"
EVENT_TYPE_PREFIX = "zen:event-type:"
TICKET_EVENT_PREFIX = "zen:event-type:ticket."
TICKET_CREATED = "zen:event-type:ticket.created"
TICKET_SUBJECT_PREFIX = "zen:ticket:"
# event ids are stored with the ids of POST /v1/events: a prefix keeps them apart
EVENT_ID_PREFIX = "zendesk:"
TRIGGER_EVENTS = ("created", "updated")
_TENANT_UNSET = ("", "0")  # Zendesk renders "no organization" as an empty or 0 id


@dataclass(frozen=True, slots=True)
class TicketEvent:
    """One Zendesk ticket event to enqueue."""

    event_id: str | None  # Zendesk's event id, or the invocation id; None: not deduplicated
    ticket_id: str
    reason: str  # created or updated
    tenant: str | None
    occurred_at: datetime
    zendesk_type: str  # the event type, or "trigger:<event>"


@dataclass(frozen=True, slots=True)
class NotATicketEvent:
    """A verified event that enqueues nothing (not a ticket event)."""

    zendesk_type: str


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The X-Zendesk-Webhook-Signature of `body` sent at `timestamp`."""
    message = timestamp.encode("utf-8") + body
    digest = hmac.new(secret.encode("utf-8"), message, hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def parse_timestamp(value: str) -> datetime | None:
    """An ISO-8601 timestamp with a zone (Zendesk's `2024-04-17T17:18:10Z`), or None."""
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def verify(
    secrets: Sequence[str],
    timestamp: str | None,
    signature: str | None,
    body: bytes,
    *,
    now: float,
    tolerance_seconds: float,
) -> Rejection | None:
    """None when `signature` signs `body` at a `timestamp` within tolerance of `now`, with
    any one of `secrets` (several during a rotation); otherwise why not (401)."""
    if not secrets:
        return Rejection(
            401,
            "unauthorized",
            "this service has no Zendesk signing secret (ENRICHQ_ZENDESK_SIGNING_SECRET): "
            "it accepts no Zendesk webhook",
        )
    if not timestamp or not signature:
        return Rejection(401, "unauthorized", f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER}")
    if not timestamp.isascii() or not signature.isascii():
        return Rejection(401, "unauthorized", "signature does not match")
    given = signature.strip().encode("ascii")
    # every secret is compared, so the time taken does not say which one matched
    matches = [
        hmac.compare_digest(sign(secret, timestamp, body).encode("ascii"), given)
        for secret in secrets
    ]
    if not any(matches):
        return Rejection(401, "unauthorized", "signature does not match")
    sent = parse_timestamp(timestamp)
    if sent is None:
        return Rejection(401, "unauthorized", f"{TIMESTAMP_HEADER} must be an ISO-8601 time")
    if abs(now - sent.timestamp()) > tolerance_seconds:
        return Rejection(
            401,
            "stale",
            f"timestamp outside the ±{tolerance_seconds:g} s tolerance (replayed or clock skew)",
        )
    return None


def parse(
    body: bytes,
    *,
    tenant_field: ZendeskTenantField,
    invocation_id: str | None,
    sent_at: datetime,
) -> TicketEvent | NotATicketEvent | Rejection:
    """What a verified body says: a ticket event, an ignored event, or why it is invalid
    (422). `sent_at` (the signature's time) stands in for a trigger body's missing time."""
    try:
        data = from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        return _invalid(f"body is not valid JSON: {exc}")
    if (key := ingest.duplicate_key(body)) is not None:
        return _invalid(f"body names the key {key!r} twice in one object")
    if not isinstance(data, dict):
        return _invalid("body must be a JSON object: a Zendesk event or the trigger template")
    fallback_id = _event_id(invocation_id)
    if isinstance(fallback_id, Rejection):
        fallback_id = None  # a header we cannot store is no reason to refuse the ticket
    kind = data.get("type")
    if isinstance(kind, str) and kind.startswith(EVENT_TYPE_PREFIX) and "ticket_id" not in data:
        return _subscription_event(data, tenant_field, fallback_id)
    return _trigger_event(data, tenant_field, fallback_id, sent_at)


def to_delivery(event: TicketEvent) -> ingest.Delivery | Rejection:
    """The queue delivery of a ticket event (the queue's own checks may still refuse it)."""
    payload = {
        "occurred_at": event.occurred_at.isoformat(),
        "payload": {"source": "zendesk", "type": event.zendesk_type},
    }
    try:
        request = queue.EnqueueRequest.build(
            key=event.ticket_id,
            kind=Kind.ENRICH.value,
            reason=event.reason,
            tenant=event.tenant,
            payload=payload,
        )
    except queue.QueueInputError as exc:
        return _invalid(str(exc))
    return ingest.Delivery(event.event_id, request)


def _subscription_event(
    data: Mapping[str, Any], tenant_field: ZendeskTenantField, fallback_id: str | None
) -> TicketEvent | NotATicketEvent | Rejection:
    kind: str = data["type"]
    if not kind.startswith(TICKET_EVENT_PREFIX):
        if (bad := unsafe_character(kind)) is not None or len(kind) > KEY_MAX_LENGTH:
            return _invalid(f"type: not an event type ({bad or 'too long'})")
        return NotATicketEvent(kind)
    detail = data.get("detail")
    if not isinstance(detail, dict):
        return _invalid("detail: expected the ticket (an object)")
    subject = data.get("subject")
    ticket: object = detail.get("id")
    if isinstance(subject, str) and subject.startswith(TICKET_SUBJECT_PREFIX):
        ticket = subject.removeprefix(TICKET_SUBJECT_PREFIX)
    ticket_id = _an_id("subject", ticket, required=True)
    if isinstance(ticket_id, Rejection) or ticket_id is None:
        return ticket_id or _invalid("subject: expected zen:ticket:<id>")
    tenant = _tenant(detail, tenant_field)
    if isinstance(tenant, Rejection):
        return tenant
    time = data.get("time")
    occurred_at = parse_timestamp(time) if isinstance(time, str) else None
    if occurred_at is None:
        return _invalid("time: expected an ISO-8601 time with a zone")
    own_id = _event_id(data.get("id"))
    if isinstance(own_id, Rejection):
        return own_id
    event_id = own_id if own_id is not None else fallback_id
    reason = "created" if kind == TICKET_CREATED else "updated"
    return TicketEvent(event_id, ticket_id, reason, tenant, occurred_at, kind)


def _trigger_event(
    data: Mapping[str, Any],
    tenant_field: ZendeskTenantField,
    fallback_id: str | None,
    sent_at: datetime,
) -> TicketEvent | Rejection:
    ticket_id = _an_id("ticket_id", data.get("ticket_id"), required=True)
    if isinstance(ticket_id, Rejection) or ticket_id is None:
        return ticket_id or _invalid("ticket_id: required")
    event = data.get("event", "updated")
    if event not in TRIGGER_EVENTS:
        return _invalid('event: expected "created" or "updated"')
    tenant = _tenant(data, tenant_field)
    if isinstance(tenant, Rejection):
        return tenant
    occurred_at = sent_at
    if (given := data.get("occurred_at")) not in (None, ""):
        parsed = parse_timestamp(given) if isinstance(given, str) else None
        if parsed is None:
            return _invalid("occurred_at: expected an ISO-8601 time with a zone")
        occurred_at = parsed
    return TicketEvent(fallback_id, ticket_id, event, tenant, occurred_at, f"trigger:{event}")


def _tenant(ticket: Mapping[str, Any], field: ZendeskTenantField) -> str | Rejection | None:
    if field is ZendeskTenantField.NONE:
        return None
    value = ticket.get(field.value)
    if isinstance(value, str) and value.strip() in _TENANT_UNSET:
        return None
    if value == 0:
        return None
    return _an_id(field.value, value, required=False)


def _an_id(name: str, value: object, *, required: bool) -> str | Rejection | None:
    """A Zendesk id (a string, or a number as Zendesk's APIs send) as text."""
    if value is None and not required:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return _invalid(f"{name}: expected an id (a string or a whole number)")
    if problem := id_problem(value, KEY_MAX_LENGTH):
        return _invalid(f"{name}: {problem}")
    return value


def _event_id(value: object) -> str | Rejection | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        return _invalid("id: expected a string")
    if problem := id_problem(value, EVENT_ID_MAX_LENGTH - len(EVENT_ID_PREFIX)):
        return _invalid(f"id: {problem}")
    return EVENT_ID_PREFIX + value


def _invalid(detail: str) -> Rejection:
    return Rejection(422, "invalid", " ".join(detail.split())[:500])
