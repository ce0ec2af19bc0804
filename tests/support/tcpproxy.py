"""A TCP proxy on loopback that can stop forwarding without closing anything: the tests'
network partition.

`blackhole()` stops forwarding bytes in both directions, EOFs included: no FIN, no RST,
every socket stays open, and what was read is held, not dropped. `heal()` lets it all
flow again, so connections that outlived the partition carry on where they stopped. New
connections made meanwhile are accepted (the kernel completes the handshake) and then get
no answer until the partition heals, as a client behind a silent network sees it.

What it cannot do is hold back TCP acknowledgements: both kernels on loopback still ack
what the proxy has not read yet, so keepalives and tcp_user_timeout never fire through
it. Only a client's own timeouts notice this partition, as with a pooler or load balancer
in the path whose far side went silent.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Protocol

from sqlalchemy.engine import make_url

CHUNK_BYTES = 65536


def target_of(url: str) -> tuple[str, int] | str:
    """Where a PostgreSQL URL's server listens: (host, port), or its Unix socket's path."""
    parsed = make_url(url)
    host = parsed.host or str(parsed.query.get("host", "")) or "127.0.0.1"
    port = parsed.port or int(str(parsed.query.get("port", "5432")))
    if host.startswith("/"):
        return f"{host}/.s.PGSQL.{port}"
    return (host, port)


class Listening(Protocol):
    port: int  # on 127.0.0.1


def via(proxy: Listening, url: str) -> str:
    """`url` with its server replaced by the proxy (the rest of the URL kept)."""
    parsed = make_url(url)
    query = {k: v for k, v in parsed.query.items() if k not in ("host", "port")}
    return parsed.set(host="127.0.0.1", port=proxy.port, query=query).render_as_string(
        hide_password=False
    )


def dial(target: tuple[str, int] | str) -> socket.socket:
    """A connection to `target`: (host, port), or a Unix socket's path (`target_of`)."""
    if isinstance(target, str):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.connect(target)
        except OSError:
            server.close()
            raise
        return server
    server = socket.create_connection(target, timeout=10)
    server.settimeout(None)
    return server


class TcpProxy:
    """Forwards 127.0.0.1:`port` to `target` ((host, port), or a Unix socket's path), one
    thread per direction."""

    def __init__(self, target: tuple[str, int] | str) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.accepted = 0
        self._acceptor = threading.Thread(target=self._accept, name="tcpproxy-accept", daemon=True)

    def start(self) -> TcpProxy:
        self._acceptor.start()
        return self

    @property
    def blackholed(self) -> bool:
        return not self._flowing.is_set()

    def blackhole(self) -> None:
        """Stop forwarding, in both directions, without closing either socket."""
        self._flowing.clear()

    def heal(self) -> None:
        """Forward again, starting with what was held."""
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(
                target=self._connect, args=(client,), name="tcpproxy-conn", daemon=True
            ).start()

    def _connect(self, client: socket.socket) -> None:
        self._flowing.wait()  # a partition: the far side is not even dialled
        if self._closed.is_set():
            client.close()
            return
        try:
            server = dial(self.target)
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets += [client, server]
        for src, dst in ((client, server), (server, client)):
            threading.Thread(
                target=self._pump, args=(src, dst), name="tcpproxy-pump", daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(CHUNK_BYTES)
            except OSError:
                data = b""
            # held, not dropped, while the partition lasts (an EOF too)
            self._flowing.wait()
            if self._closed.is_set() or not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
