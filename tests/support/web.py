"""Ports, readiness and signed webhook requests, for the tests that talk to a server."""

from __future__ import annotations

import json
import socket
import time

import httpx

from enrichq_service.http import sign

EVENTS_PATH = "/v1/events"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (as of now)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def accepting(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def answers(url: str) -> bool:
    """Whether GET url answers 200 within a second (a readiness probe)."""
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def signed(body: bytes, secret: str, *, ts: int | str | None = None) -> dict[str, str]:
    """The headers of a webhook delivery of `body` signed with `secret` at `ts` (now)."""
    stamp = str(int(time.time())) if ts is None else str(ts)
    return {
        "Content-Type": "application/json",
        "X-Enrichq-Timestamp": stamp,
        "X-Enrichq-Signature": sign(secret, stamp, body),
    }


def event(ticket: str, kind: str = "created", **fields: object) -> dict[str, object]:
    """A webhook event body for `ticket`; `fields` add to or override the defaults."""
    return {"ticket_id": ticket, "type": kind, "occurred_at": "2026-01-05T12:00:00Z", **fields}


def post_event(base: str, secret: str, event: dict[str, object]) -> httpx.Response:
    """POST one signed event to a running `enrichq serve` at `base`."""
    body = json.dumps(event).encode()
    return httpx.post(f"{base}{EVENTS_PATH}", content=body, headers=signed(body, secret))
