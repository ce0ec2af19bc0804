"""The listener: LISTENs for enqueue notifications on a connection of its own and wakes the
claim loop, which also polls as a backstop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from enrichq_schema.states import NOTIFY_CHANNEL
from enrichq_service.worker.db import Backoff

log = logging.getLogger(__name__)

# how often the wait for a notification looks at its stop: the worker's stop (the end of a
# --drain run, a SIGTERM) joins this thread, and waited up to a second for it
STOP_CHECK_SECONDS = 0.1


def listen(
    connect_params: Mapping[str, Any], wake: Callable[[], None], stop: threading.Event
) -> None:
    """Wake on every notification until `stop` is set; reconnect after a backoff.

    `connect_params`: psycopg.connect() keyword arguments
    (`enrichq_schema.connections.listen_connect_params`)."""
    backoff = Backoff()
    while not stop.is_set():
        try:
            with psycopg.connect(**connect_params, autocommit=True) as conn:
                conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                backoff.reset()
                while not stop.is_set():
                    for _ in conn.notifies(timeout=STOP_CHECK_SECONDS, stop_after=1):
                        wake()
        except psycopg.Error as exc:
            log.info("LISTEN connection lost (%s); polling meanwhile", type(exc).__name__)
            stop.wait(backoff.next())
