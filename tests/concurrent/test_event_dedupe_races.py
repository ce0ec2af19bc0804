"""Concurrent redeliveries of one event id, on real connections: exactly one enqueues."""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.db import lock_waiters
from tests.support.procs import wait_for
from tests.support.settings import make_settings

from enrichq_schema.settings import Settings
from enrichq_service import events as ingest
from enrichq_service.queue import EnqueueRequest

TRIALS = 20
SENDERS = 4


def deliver(
    engine: sa.Engine, settings: Settings, event_id: str, key: str
) -> ingest.DeliveryResult:
    with engine.begin() as conn:
        [outcome] = ingest.enqueue(
            conn, [ingest.Delivery(event_id, EnqueueRequest.build(key=key))], settings=settings
        )
    return outcome


def together(calls: list[Any]) -> list[Any]:
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            barrier.wait(30)
            out[i] = calls[i]()
        except BaseException as exc:  # the test asserts on it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_racing_redeliveries_of_one_id_enqueue_once(db_url: str, db_engine: sa.Engine) -> None:
    settings = make_settings(db_url)
    for trial in range(TRIALS):
        event_id = f"evt-{trial}"
        # every sender carries the same event, released at once
        outcomes = together(
            [partial(deliver, db_engine, settings, event_id, f"T-{trial}")] * SENDERS
        )
        assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
        assert sorted(o.duplicate for o in outcomes) == [False] + [True] * (SENDERS - 1)
        [first] = [o for o in outcomes if not o.duplicate]
        assert first.inserted
        assert {o.id for o in outcomes} == {first.id}  # duplicates name the first's row
        with db_engine.connect() as conn:
            n = conn.execute(
                sa.text("SELECT count(*) FROM enrichq.queue WHERE key = :k"), {"k": f"T-{trial}"}
            ).scalar()
        assert n == 1


@pytest.mark.parametrize("fate", ["commit", "rollback"])
def test_a_redelivery_waits_for_the_first_delivery_and_follows_its_fate(
    db_url: str, db_engine: sa.Engine, fate: str
) -> None:
    settings = make_settings(db_url)
    first = db_engine.connect()
    tx = first.begin()
    ingest.enqueue(
        first, [ingest.Delivery("evt-1", EnqueueRequest.build(key="A"))], settings=settings
    )
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(deliver(db_engine, settings, "evt-1", "B")))
    thread.start()
    wait_for(
        lambda: lock_waiters(db_engine) == 1, what="the redelivery to wait for the first delivery"
    )
    if fate == "commit":
        tx.commit()
    else:
        tx.rollback()
    first.close()
    thread.join(30)
    [outcome] = box
    # committed: the redelivery is a duplicate; rolled back: it is the delivery that counts
    assert outcome.duplicate is (fate == "commit")
    assert outcome.inserted is (fate == "rollback")
