"""The listener: LISTENs for enqueue notifications on a connection of its own (a LISTEN
that shares a connection with queries stalls them) and wakes the claim loop; the loop also
polls every ENRICHQ_POLL_SECONDS as a backstop, so a lost notification or connection only
delays work."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg

from enrichq_schema.db import normalize_url
from enrichq_schema.states import NOTIFY_CHANNEL
from enrichq_service.worker.db import Backoff

log = logging.getLogger(__name__)


def listen(url: str, wake: Callable[[], None], stop: threading.Event) -> None:
    """Wake on every notification until `stop` is set; reconnect after a backoff."""
    dsn = normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    backoff = Backoff()
    while not stop.is_set():
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                backoff.reset()
                while not stop.is_set():
                    for _ in conn.notifies(timeout=1.0, stop_after=1):
                        wake()
        except psycopg.Error as exc:
            log.info("LISTEN connection lost (%s); polling meanwhile", type(exc).__name__)
            stop.wait(backoff.next())
