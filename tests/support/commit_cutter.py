"""A TCP proxy in front of PostgreSQL that can lose the reply to a COMMIT.

Everything is forwarded both ways, byte for byte. Once a client connection has sent a
message containing `trigger` (some text of the statement whose transaction should be cut),
the proxy watches that connection's server replies for the CommandComplete of `COMMIT`
and, instead of forwarding it, closes both sockets: the server has committed, the client
sees its connection die in the middle of COMMIT. That is the ambiguous commit a network
drop causes, made deterministic. It cuts `times` such commits, then forwards everything.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator

from tests.support.tcpproxy import dial, target_of, via

# CommandComplete ('C'), length 11 (4 + "COMMIT\0"), tag "COMMIT"
COMMIT_COMPLETE = b"C\x00\x00\x00\x0bCOMMIT\x00"
BUFFER = 65536


class CommitCutter:
    """Listens on 127.0.0.1:`port` (0 = pick one) and forwards to `target`."""

    def __init__(self, target: tuple[str, int] | str, trigger: bytes, *, times: int = 1) -> None:
        self.target = target
        self.trigger = trigger
        self.left = times
        self.cut = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="commit-cutter", daemon=True)

    def __enter__(self) -> CommitCutter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = dial(self.target)
            except OSError:  # the server is down (restarting): this client is refused
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def arm(self, times: int) -> None:
        """Cut `times` more such commits from now on."""
        with self._lock:
            self.left += times

    def _take_cut(self) -> bool:
        with self._lock:
            if self.left <= 0:
                return False
            self.left -= 1
            self.cut += 1
            return True

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        # a side that goes away (the server restarted, the client killed) ends the pair
        with contextlib.suppress(OSError):
            self._pump_pair(client, server)

    def _pump_pair(self, client: socket.socket, server: socket.socket) -> None:
        armed = False
        with contextlib.closing(client), contextlib.closing(server):
            while not self._closed.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.5)
                for sock in ready:
                    data = sock.recv(BUFFER)
                    if not data:
                        return
                    if sock is client:
                        if self.trigger in data:
                            armed = True
                        server.sendall(data)
                    elif armed and COMMIT_COMPLETE in data and self._take_cut():
                        return  # the server committed; the client never hears it
                    else:
                        client.sendall(data)


@contextlib.contextmanager
def cutting(url: str, trigger: bytes, *, times: int = 1) -> Iterator[tuple[str, CommitCutter]]:
    """A URL like `url` that goes through a CommitCutter, and the cutter; `url`'s server may
    listen on TCP or on a Unix socket (the embedded PostgreSQL of a laptop run)."""
    with CommitCutter(target_of(url), trigger, times=times) as cutter:
        yield via(cutter, url), cutter
