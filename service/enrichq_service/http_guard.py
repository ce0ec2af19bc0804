"""What protects `serve` from senders it has not authenticated yet: bounded time to send
a request, connections open at once, body bytes held before signatures are checked, and
no request with both Content-Length and Transfer-Encoding."""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from enrichq_schema import metrics
from enrichq_schema.settings import (
    HTTP_BODY_TIMEOUT_SECONDS_DEFAULT,
    HTTP_HEADER_TIMEOUT_SECONDS_DEFAULT,
    HTTP_MAX_CONNECTIONS_DEFAULT,
    Settings,
)

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5
# file descriptors kept for everything but client connections: database pools, LISTEN,
# logs, the metrics server
RESERVED_FILES = 64
_BUSY_BODY = b'{"detail": "too many connections; retry later"}'
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (RETRY_AFTER_SECONDS, len(_BUSY_BODY), _BUSY_BODY)
)
CLOSE_REASONS = ("header_timeout", "body_timeout", "too_many", "ambiguous_length")


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds one server applies (from the settings)."""

    header_timeout_seconds: float
    body_timeout_seconds: float
    max_connections: int

    @classmethod
    def default(cls) -> Limits:
        """The default limits (an app that `create_app` did not make)."""
        return cls(
            HTTP_HEADER_TIMEOUT_SECONDS_DEFAULT,
            HTTP_BODY_TIMEOUT_SECONDS_DEFAULT,
            connections_allowed(HTTP_MAX_CONNECTIONS_DEFAULT),
        )

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        """The settings' limits, the connections lowered to what the open-files limit
        leaves room for (a warning says so)."""
        return cls(
            settings.http_header_timeout_seconds,
            settings.http_body_timeout_seconds,
            connections_allowed(settings.http_max_connections),
        )


def connections_allowed(wanted: int) -> int:
    """`wanted`, or fewer when this process may not open that many files besides the ones
    it needs for itself (a warning says so)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or wanted + RESERVED_FILES <= soft:
        return wanted
    allowed = max(1, soft - RESERVED_FILES)
    log.warning(
        "ENRICHQ_HTTP_MAX_CONNECTIONS (%d) lowered to %d: this process may open %d files "
        "(ulimit -n), %d of which are kept for its own",
        wanted,
        allowed,
        soft,
        RESERVED_FILES,
    )
    return allowed


class AmbiguousLength(h11.RemoteProtocolError):
    """A request with both Content-Length and Transfer-Encoding."""


class _Connection(h11.Connection):
    """h11's server side, telling its protocol when a request's head and its end arrive,
    and refusing a request whose length two parsers could read differently."""

    def __init__(self, guard: _Guarded, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self._guard = guard

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                metrics.http_connections_closed_total.labels("ambiguous_length").inc()
                raise AmbiguousLength(
                    "both Content-Length and Transfer-Encoding", error_status_hint=400
                )
            self._guard.head_received()
        elif isinstance(event, h11.EndOfMessage):
            self._guard.body_received()
        return event


class _Guarded(H11Protocol):
    """uvicorn's h11 protocol with the bounds of `Limits` (set by `guarded_protocol`)."""

    limits: Limits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(self, self.conn._max_incomplete_event_size)
        self._timer: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float, reason: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._too_slow, reason)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self, reason: str) -> None:
        self._timer = None
        if not self.transport.is_closing():
            metrics.http_connections_closed_total.labels(reason).inc()
            log.debug("closed a connection from %s: %s", self.client, reason)
            self.transport.close()

    def head_received(self) -> None:
        """A request's head is in: its body has the body timeout from now."""
        self._arm(self.limits.body_timeout_seconds, "body_timeout")

    def body_received(self) -> None:
        """A request is in whole: the answer is ours to give, no client timeout runs."""
        self._disarm()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            metrics.http_connections_closed_total.labels("too_many").inc()
            self.transport.write(_BUSY)
            self.transport.close()
            return
        self._arm(self.limits.header_timeout_seconds, "header_timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if (
            not self.transport.is_closing()
            and self._timer is None
            and self.conn.their_state is h11.IDLE
        ):
            # kept alive and waiting for the next request (not answering a pipelined one
            # already in): its head has the header timeout (uvicorn's own keep-alive
            # timeout ends only while nothing at all arrives)
            self._arm(self.limits.header_timeout_seconds, "header_timeout")


def guarded_protocol(limits: Limits) -> type[H11Protocol]:
    """uvicorn's `http=` protocol class bounded by `limits`."""
    return type("GuardedH11Protocol", (_Guarded,), {"limits": limits})


class BodyBudget:
    """Request body bytes held at once by every request of one server before their
    signatures are checked. Used from the event loop's thread only: no lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        """Hold `size` more bytes, or False (nothing held) when that would pass the limit."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give_back(self, size: int) -> None:
        """Release `size` bytes a request held."""
        self.held -= size
