"""serve against senders it has not authenticated yet (issue #29 item 5), on a real server
on loopback: slow heads and bodies are cut off, connections and the bytes held before a
signature is checked are bounded, ambiguous framing is refused and the connection closed,
compressed bodies and duplicate keys are refused, and a serve without any secret says so.

Every socket here has a timeout, so a test that fails stops by itself.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from tests.support.settings import make_settings
from tests.support.web import EVENTS_PATH, event, signed
from tests.support.zendesk import ZENDESK_PATH, encode, ticket_event, zendesk_headers

from enrichq_schema.errors import SettingsError
from enrichq_schema.settings import Settings
from enrichq_service.http import ServerThread, create_app, start_server_thread

SECRET = "robust-secret"
ZENDESK_SECRET = "zendesk-robust-secret"
# generous next to the limits below: a loaded machine still sees the cut-off in time
WAIT = 15.0


def closed(reason: str) -> float:
    """enrichq_http_connections_closed_total{reason} of this process."""
    sample = REGISTRY.get_sample_value("enrichq_http_connections_closed_total", {"reason": reason})
    return sample or 0.0


def rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM enrichq.queue")).scalar_one())


@pytest.fixture
def serve(db_url: str, db_engine: sa.Engine) -> Iterator[Callable[..., ServerThread]]:
    servers: list[ServerThread] = []

    def start(**overrides: Any) -> ServerThread:
        values: dict[str, Any] = {
            "webhook_secret": SECRET,
            "zendesk_signing_secret": ZENDESK_SECRET,
            "http_header_timeout_seconds": 0.5,
            "http_body_timeout_seconds": 0.5,
        }
        values.update(overrides)
        app = create_app(make_settings(db_url, **values), db_engine)
        server = start_server_thread(app, host="127.0.0.1", port=0)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=WAIT)
    sock.settimeout(WAIT)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def signed_post(server: ServerThread, body: dict[str, object]) -> httpx.Response:
    raw = json.dumps(body).encode()
    return httpx.post(f"{server.url}{EVENTS_PATH}", content=raw, headers=signed(raw, SECRET))


# -- slow senders


def test_a_head_that_never_ends_is_cut_off(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    before = closed("header_timeout")
    with connect(server) as sock:
        sock.sendall(b"POST /v1/events HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        assert read_all(sock) == b""  # closed, with nothing said
    assert time.monotonic() - started < WAIT
    assert closed("header_timeout") == before + 1


def test_a_head_trickled_a_byte_at_a_time_is_cut_off_too(
    serve: Callable[..., ServerThread],
) -> None:
    """Each byte resets uvicorn's own keep-alive timer; the head's deadline runs on."""
    server = serve()
    head = b"POST /v1/events HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200
    with connect(server) as sock:
        started = time.monotonic()
        try:
            for byte in head:  # about 12 s of it: far past the head's deadline
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
            reply = read_all(sock)
        except (BrokenPipeError, ConnectionResetError):  # the send that finds it closed
            reply = b""
        assert reply == b""
        assert time.monotonic() - started < 0.5 + WAIT


def test_a_body_that_stalls_is_cut_off_and_nothing_is_enqueued(
    serve: Callable[..., ServerThread], db_engine: sa.Engine
) -> None:
    server = serve()
    body = json.dumps(event("T-1")).encode()
    headers = signed(body, SECRET)
    head = (
        f"POST {EVENTS_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-Enrichq-Timestamp: {headers['X-Enrichq-Timestamp']}\r\n"
        f"X-Enrichq-Signature: {headers['X-Enrichq-Signature']}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with connect(server) as sock:
        sock.sendall(head + body[:10])
        reply = read_all(sock)
    # cut off: no answer at all, or the answer to a body that never came
    assert reply == b"" or reply.startswith(b"HTTP/1.1 400")
    assert rows(db_engine) == 0
    # the same request sent whole is accepted
    assert signed_post(server, event("T-1")).status_code == 202


def test_a_kept_alive_connection_gets_the_head_deadline_again(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve()
    with connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next head never ends
        assert read_all(sock) == b""


# -- connections and bytes held


def test_one_connection_too_many_is_answered_503_and_idle_ones_are_closed_in_time(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve(http_max_connections=3)
    idle = [connect(server) for _ in range(3)]
    try:
        time.sleep(0.1)  # the server has taken all three
        with connect(server) as extra:
            reply = read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503")
        assert b"retry-after: 5" in reply.lower()
        # the idle ones are cut off at the head deadline, and a signed POST gets through
        for sock in idle:
            assert read_all(sock) == b""
        assert signed_post(server, event("T-9")).status_code == 202
    finally:
        for sock in idle:
            sock.close()


def test_bodies_held_before_their_signature_are_bounded(
    serve: Callable[..., ServerThread], db_engine: sa.Engine
) -> None:
    server = serve(
        max_body_bytes=2048, http_max_buffered_bytes=4096, http_body_timeout_seconds=WAIT
    )
    stalled: list[socket.socket] = []
    try:
        for _ in range(2):  # two unsigned bodies, nearly whole, never finished
            sock = connect(server)
            sock.sendall(
                b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 2048\r\n\r\n" + b" " * 2000
            )
            stalled.append(sock)
        time.sleep(0.3)  # read by the server
        refused = signed_post(server, {**event("T-1"), "payload": {"pad": "x" * 1800}})
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "5"
        assert rows(db_engine) == 0
    finally:
        for sock in stalled:
            sock.close()
    # their bytes are given back when they go
    time.sleep(0.3)
    assert signed_post(server, {**event("T-1"), "payload": {"pad": "x" * 1800}}).status_code == 202


def test_a_buffer_smaller_than_one_body_is_refused_at_start_up() -> None:
    with pytest.raises(SettingsError, match="ENRICHQ_HTTP_MAX_BUFFERED_BYTES"):
        Settings.load(max_body_bytes=1_048_576, http_max_buffered_bytes=65_536)


# -- framing


def test_content_length_with_transfer_encoding_is_400_and_nothing_after_it_is_served(
    serve: Callable[..., ServerThread], db_engine: sa.Engine
) -> None:
    server = serve()
    before = closed("ambiguous_length")
    smuggled = (
        b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    with connect(server) as sock:
        sock.sendall(smuggled)
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 400")
    assert reply.count(b"HTTP/1.1 ") == 1  # the trailing request was never answered
    assert closed("ambiguous_length") == before + 1
    assert rows(db_engine) == 0


# -- bodies


@pytest.fixture
def client(db_url: str, db_engine: sa.Engine) -> Iterator[TestClient]:
    settings = make_settings(db_url, webhook_secret=SECRET, zendesk_signing_secret=ZENDESK_SECRET)
    with TestClient(create_app(settings, db_engine)) as c:
        yield c


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "gzip, identity"])
def test_a_content_encoding_is_415_and_changes_nothing(
    client: TestClient, db_engine: sa.Engine, encoding: str
) -> None:
    raw = json.dumps(event("T-1")).encode()
    answer = client.post(
        EVENTS_PATH, content=raw, headers={**signed(raw, SECRET), "Content-Encoding": encoding}
    )
    assert answer.status_code == 415, answer.text
    assert "Content-Encoding" in answer.json()["detail"]
    zendesk_raw = encode(ticket_event("ticket.created", ticket="1"))
    answer = client.post(
        ZENDESK_PATH,
        content=zendesk_raw,
        headers={**zendesk_headers(zendesk_raw, ZENDESK_SECRET), "Content-Encoding": encoding},
    )
    assert answer.status_code == 415, answer.text
    assert rows(db_engine) == 0


def test_identity_is_no_encoding(client: TestClient) -> None:
    raw = json.dumps(event("T-1")).encode()
    headers = {**signed(raw, SECRET), "Content-Encoding": "Identity"}
    assert client.post(EVENTS_PATH, content=raw, headers=headers).status_code == 202


@pytest.mark.parametrize(
    "raw",
    [
        b'{"ticket_id": "T-1", "ticket_id": "T-2", "type": "created",'
        b' "occurred_at": "2026-01-05T12:00:00Z"}',
        b'{"ticket_id": "T-1", "type": "created", "occurred_at": "2026-01-05T12:00:00Z",'
        b' "payload": {"a": 1, "a": 2}}',
        b'{"events": [{"ticket_id": "T-1", "type": "created",'
        b' "occurred_at": "2026-01-05T12:00:00Z", "type": "updated"}]}',
    ],
    ids=["top", "nested", "in-a-batch"],
)
def test_a_key_twice_in_one_object_is_422_and_changes_nothing(
    client: TestClient, db_engine: sa.Engine, raw: bytes
) -> None:
    answer = client.post(EVENTS_PATH, content=raw, headers=signed(raw, SECRET))
    assert answer.status_code == 422, answer.text
    assert "twice" in answer.json()["detail"]
    assert rows(db_engine) == 0


def test_a_zendesk_body_with_a_key_twice_is_422(client: TestClient, db_engine: sa.Engine) -> None:
    body = encode(ticket_event("ticket.created", ticket="1"))
    raw = body[:-1] + b', "type": "zen:event-type:ticket.deleted"}'
    answer = client.post(ZENDESK_PATH, content=raw, headers=zendesk_headers(raw, ZENDESK_SECRET))
    assert answer.status_code == 422, answer.text
    assert rows(db_engine) == 0


# -- no secret at all


def test_serve_without_any_secret_warns_and_readyz_says_so(
    db_url: str, db_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="enrichq_service.http"):
        app = create_app(make_settings(db_url), db_engine)
    assert any("every event is refused" in r.getMessage() for r in caplog.records)
    with TestClient(app) as client:
        ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "refusing every event"
    assert "ENRICHQ_WEBHOOK_SECRET" in ready.json()["detail"]


def test_one_secret_is_enough_to_be_quiet(
    db_url: str, db_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="enrichq_service.http"):
        app = create_app(make_settings(db_url, zendesk_signing_secret="z"), db_engine)
    assert not caplog.records
    with TestClient(app) as client:
        assert client.get("/readyz").json() == {"status": "ok"}
