"""The claim-order heads never lose a pair's queued row to a race (issue 26).

A claim starts from `enrichq.queue_heads`, so a queued row whose pair has no head, or a head
moved past it, would never be claimed. Two real connections drive the interleavings where
that could happen: an enqueue not committed yet while a claim evaluates the pair's head, and
an enqueue that arrives while a claim holds the head it is moving.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from tests.support.procs import wait_for
from tests.support.settings import make_settings

from enrichq_schema.db import create_engine
from enrichq_service import queue
from enrichq_service.queue import EnqueueRequest

LEASE = 60.0


@pytest.fixture
def engines(db_url: str) -> Iterator[tuple[sa.Engine, sa.Engine, sa.Engine]]:
    """Two engines for the racing sessions (named, so the test sees who waits), one to look."""
    a = create_engine(db_url, pool_size=1, application_name="heads-a")
    b = create_engine(db_url, pool_size=1, application_name="heads-b")
    look = create_engine(db_url, pool_size=1)
    yield a, b, look
    for engine in (a, b, look):
        engine.dispose()


def put(conn: sa.Connection, key: str) -> None:
    cfg = make_settings(str(conn.engine.url))
    queue.enqueue(
        conn, [EnqueueRequest.build(key=key, tenant="acme", delay_seconds=0)], settings=cfg
    )


def claim(conn: sa.Connection, owner: str) -> list[str]:
    return [j.key for j in queue.claim(conn, owner=owner, limit=10, lease_seconds=LEASE)]


def waiting(engine: sa.Engine, application_name: str) -> bool:
    with engine.connect() as conn:
        n = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = :name AND wait_event_type = 'Lock'"
            ),
            {"name": application_name},
        ).scalar_one()
    return bool(n)


def test_a_row_enqueued_while_a_claim_empties_its_pair_is_claimed_next(
    engines: tuple[sa.Engine, sa.Engine, sa.Engine],
) -> None:
    """acme has one queued row; an enqueue of a second one has not committed when a claim
    takes the first and evaluates acme's head, seeing the pair empty. The head must not
    say so: the next claim takes the second row."""
    a, b, look = engines
    with look.begin() as conn:
        put(conn, "T-1")
    with a.connect() as enqueuer:
        tx = enqueuer.begin()
        put(enqueuer, "T-2")  # not committed yet
        with b.begin() as conn:
            assert claim(conn, "w1") == ["T-1"]
        tx.commit()
    with look.begin() as conn:
        assert claim(conn, "w2") == ["T-2"]


def test_a_row_enqueued_while_a_claim_holds_the_head_is_claimed_next(
    engines: tuple[sa.Engine, sa.Engine, sa.Engine],
) -> None:
    """A claim takes acme's only row and moves its head (acme is empty) but has not
    committed; an enqueue of acme waits for the head, then puts it back before its row.
    The next claim takes the new row."""
    a, b, look = engines
    with look.begin() as conn:
        put(conn, "T-1")
    done = threading.Event()
    errors: list[BaseException] = []

    def enqueue_later() -> None:
        try:
            with a.begin() as conn:
                put(conn, "T-2")
        except BaseException as exc:  # reported to the test below
            errors.append(exc)
        finally:
            done.set()

    with b.connect() as claimer:
        tx = claimer.begin()
        assert claim(claimer, "w1") == ["T-1"]
        thread = threading.Thread(target=enqueue_later)
        thread.start()
        wait_for(lambda: waiting(look, "heads-a"), timeout=10, what="the enqueue to wait")
        assert not done.is_set()
        tx.commit()
    thread.join(10)
    assert done.is_set()
    assert errors == []
    with look.begin() as conn:
        assert claim(conn, "w2") == ["T-2"]


def _enqueue(conn: sa.Connection, key: str, kind: str, tenant: str) -> None:
    cfg = make_settings(str(conn.engine.url))
    queue.enqueue(
        conn,
        [EnqueueRequest.build(key=key, kind=kind, tenant=tenant, delay_seconds=0)],
        settings=cfg,
    )


def test_a_fresh_backfill_head_never_ranks_above_visible_work(
    engines: tuple[sa.Engine, sa.Engine, sa.Engine],
) -> None:
    """A new head sits at the top of the claim order until a claim evaluates it; a backfill
    head must not, or a claim that skips it (another claim holds it) takes backfill work
    while enrich work is visible. Before, B took t-bf."""
    a, b, look = engines
    with look.begin() as conn:
        _enqueue(conn, "t-bf", "backfill", "t2")  # older than the enrich rows
    with look.begin() as conn:
        _enqueue(conn, "t-e1", "enrich", "t1")
        _enqueue(conn, "t-e2", "enrich", "t3")
    with a.connect() as ca, ca.begin():
        took_a = [j.key for j in queue.claim(ca, owner="A", limit=1, lease_seconds=LEASE)]
        with b.begin() as cb:
            took_b = [j.key for j in queue.claim(cb, owner="B", limit=1, lease_seconds=LEASE)]
    assert took_a == ["t-e1"]
    assert took_b == ["t-e2"]


def test_backfill_over_more_tenants_than_a_claim_evaluates_stays_last(
    engines: tuple[sa.Engine, sa.Engine, sa.Engine],
) -> None:
    """A backfill of 600 tenants (more heads than a claim evaluates at once): one claim
    still takes the visible enrich rows first. Before, it took three backfill rows."""
    _, _, look = engines
    with look.begin() as conn:
        _enqueue(conn, "e-1", "enrich", "t-enrich")
        _enqueue(conn, "e-2", "enrich", "t-enrich")
    with look.begin() as conn:
        queue.claim(conn, owner="warm", limit=0, lease_seconds=LEASE)
    with look.begin() as conn:
        cfg = make_settings(str(conn.engine.url))
        queue.enqueue(
            conn,
            [
                EnqueueRequest.build(
                    key=f"b-{i}", kind="backfill", tenant=f"bt{i:04d}", delay_seconds=0
                )
                for i in range(600)
            ],
            settings=cfg,
        )
    with look.begin() as conn:
        jobs = queue.claim(conn, owner="A", limit=3, lease_seconds=LEASE)
    assert [j.kind for j in jobs][:2] == ["enrich", "enrich"]
