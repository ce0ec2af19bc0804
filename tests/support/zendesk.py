"""Zendesk webhook deliveries as Zendesk's developer documentation describes them.

The bodies follow Zendesk's documented examples: an event subscription's ticket event
("Webhook event types" and "Ticket events": `type`, `account_id`, `id`, `time`,
`zendesk_event_version`, `subject` zen:ticket:<id>, `detail` the ticket, `event`), and the
trigger body template docs/zendesk.md gives the user to paste, rendered. They are signed
here as "Verifying webhook authenticity" says, independently of enrichq's own code:
base64(HMAC-SHA256(secret, timestamp + body)), the timestamp ISO-8601.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from datetime import UTC, datetime
from typing import Any

ZENDESK_PATH = "/v1/zendesk"


def ticket_event(
    kind: str = "ticket.created",
    *,
    ticket: str = "35436",
    event_id: str = "01HNX7Q2K6C3Y0V8TQ4ZPM9D5A",
    brand_id: str = "360001234567",
    organization_id: str | None = "5090000012",
) -> dict[str, Any]:
    """An event subscription's ticket event (zen:event-type:<kind>), as Zendesk sends it."""
    return {
        "type": f"zen:event-type:{kind}",
        "account_id": 12514403,
        "id": event_id,
        "time": "2099-07-04T05:33:18Z",
        "zendesk_event_version": "2022-11-06",
        "subject": f"zen:ticket:{ticket}",
        "detail": {
            "actor_id": "8447388090494",
            "assignee_id": None,
            "brand_id": brand_id,
            "created_at": "2099-07-04T05:33:17Z",
            "custom_status": "17",
            "description": "The printer is on fire",
            "external_id": None,
            "form_id": "1",
            "group_id": "2",
            "id": ticket,
            "is_public": True,
            "organization_id": organization_id,
            "priority": "LOW",
            "requester_id": "8447388090494",
            "status": "OPEN",
            "subject": "Help",
            "submitter_id": "8447388090494",
            "tags": ["printer"],
            "type": "QUESTION",
            "updated_at": "2099-07-04T05:33:18Z",
            "via": {"channel": "web_service"},
        },
        "event": {"meta": {"sequence": {"id": "c3bX", "position": 1, "total": 1}}},
    }


def user_event() -> dict[str, Any]:
    """A user event (Zendesk's own example of the event schema): not a ticket event."""
    return {
        "type": "zen:event-type:user.active_changed",
        "account_id": 12514403,
        "id": "2b24ef10-19d4-4740-93cf-8f98ec4776c0",
        "time": "2099-07-04T05:33:18Z",
        "zendesk_event_version": "2022-06-20",
        "subject": "zen:user:6596848315901",
        "detail": {"id": "6596848315901", "organization_id": "0", "role": "end-user"},
        "event": {"current": False, "previous": True},
    }


def trigger_body(ticket: str = "35436", event: str = "updated", **fields: str) -> dict[str, Any]:
    """The trigger body template of docs/zendesk.md, as Zendesk renders its placeholders
    (every value a string)."""
    return {"ticket_id": ticket, "event": event, **fields}


def zendesk_sign(secret: str, timestamp: str, body: bytes) -> str:
    """base64(HMACSHA256(TIMESTAMP + BODY)), keyed with the webhook's signing secret."""
    digest = hmac.new(secret.encode(), timestamp.encode() + body, hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def now_stamp() -> str:
    """The current time as Zendesk writes its signature timestamp."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def zendesk_headers(
    body: bytes, secret: str, *, ts: str | None = None, invocation_id: str | None = None
) -> dict[str, str]:
    """The headers of a Zendesk webhook request of `body` signed with `secret` at `ts`."""
    stamp = now_stamp() if ts is None else ts
    headers = {
        "Content-Type": "application/json; charset=utf-8",
        "User-Agent": "Zendesk Webhook",
        "X-Zendesk-Account-Id": "12514403",
        "X-Zendesk-Webhook-Id": "01GK8E6BKWMJZD2T8Y5AXJQMG5",
        "X-Zendesk-Webhook-Signature": zendesk_sign(secret, stamp, body),
        "X-Zendesk-Webhook-Signature-Timestamp": stamp,
    }
    if invocation_id is not None:
        headers["X-Zendesk-Webhook-Invocation-Id"] = invocation_id
    return headers


def encode(body: object) -> bytes:
    return json.dumps(body).encode()
