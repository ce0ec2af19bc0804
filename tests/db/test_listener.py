"""The worker's LISTEN thread: it wakes the claim loop on a notification, and ends soon
after it is told to stop, so a worker's stop (a `--drain` run's end, a SIGTERM) never waits
on it."""

from __future__ import annotations

import threading

import sqlalchemy as sa
from tests.support.settings import make_settings

from enrichq_schema.connections import listen_connect_params
from enrichq_schema.states import NOTIFY_CHANNEL
from enrichq_service.worker.listener import listen


def test_the_listener_wakes_on_a_notification_and_ends_soon_after_its_stop(
    db_url: str, db_engine: sa.Engine
) -> None:
    woken, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=listen,
        args=(listen_connect_params(make_settings(db_url), db_url), woken.set, stop),
        daemon=True,
    )
    thread.start()
    # notified until one lands (the first NOTIFY may come before the LISTEN)
    for _ in range(100):
        with db_engine.begin() as conn:
            conn.execute(sa.text(f"NOTIFY {NOTIFY_CHANNEL}"))
        if woken.wait(0.1):
            break
    assert woken.is_set(), "no wake-up for a notification"
    stop.set()
    # a fraction of a second: it looked at its stop once a second, and each worker's stop
    # waited up to that for it (a --drain of 10,000 no-op jobs took 2.0 s, 1.1 s now)
    thread.join(timeout=0.6)
    assert not thread.is_alive(), "the listener still runs after its stop"
