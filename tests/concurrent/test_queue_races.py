"""One live lease per ticket across kinds, and result writes serialized per ticket.

Each test drives two real connections into the interleaving that broke the promise: a
claim that has not committed yet, a claim whose snapshot predates another's commit, two
result writes for one ticket in flight at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from tests.support.procs import wait_for
from tests.support.settings import make_settings

from enrichq_schema.db import create_engine
from enrichq_schema.errors import constraint_name
from enrichq_schema.tables import LEASED_KEY_INDEX
from enrichq_service import queue
from enrichq_service.enrich import Enrichment, Order, Result, write_results
from enrichq_service.queue import EnqueueRequest

LEASE = 60.0
BOTH = ("enrich", "refresh")


@pytest.fixture
def engines(db_url: str) -> Iterator[tuple[sa.Engine, sa.Engine, sa.Engine]]:
    """Two engines for the racing sessions (named, so the test can see who waits) and one
    for looking."""
    a = create_engine(db_url, pool_size=1, application_name="race-a")
    b = create_engine(db_url, pool_size=1, application_name="race-b")
    look = create_engine(db_url, pool_size=1)
    yield a, b, look
    for engine in (a, b, look):
        engine.dispose()


def enqueue_both_kinds(engine: sa.Engine, key: str) -> None:
    cfg = make_settings(str(engine.url))
    with engine.begin() as conn:
        queue.enqueue(
            conn,
            [EnqueueRequest.build(key=key, kind=kind) for kind in BOTH],
            settings=cfg,
        )


def leases(engine: sa.Engine, key: str) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [
            (r.kind, r.lease_owner)
            for r in conn.execute(
                sa.text(
                    "SELECT kind, lease_owner FROM enrichq.queue"
                    " WHERE key = :key AND state = 'leased' ORDER BY kind"
                ),
                {"key": key},
            )
        ]


def waiting_on_a_lock(engine: sa.Engine, application_name: str) -> bool:
    with engine.connect() as conn:
        n = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = :name AND wait_event_type = 'Lock'"
            ),
            {"name": application_name},
        ).scalar_one()
    return bool(n)


def test_a_claim_not_yet_committed_keeps_the_other_kind_of_its_ticket(
    engines: tuple[sa.Engine, sa.Engine, sa.Engine],
) -> None:
    """B's claim skips the enrich row A holds locked, and must not lease the ticket's
    refresh row while A's claim is still open."""
    a, b, look = engines
    enqueue_both_kinds(look, "T-1")
    with a.connect() as conn_a:
        tx = conn_a.begin()
        claimed_a = queue.claim(conn_a, kinds=BOTH, owner="A", limit=1, lease_seconds=LEASE)
        assert [(j.key, j.kind) for j in claimed_a] == [("T-1", "enrich")]
        with b.begin() as conn_b:
            claimed_b = queue.claim(conn_b, kinds=BOTH, owner="B", limit=5, lease_seconds=LEASE)
        assert claimed_b == []
        tx.commit()
    with b.begin() as conn_b:
        assert queue.claim(conn_b, kinds=BOTH, owner="B", limit=5, lease_seconds=LEASE) == []
    assert leases(look, "T-1") == [("enrich", "A")]


def test_a_claim_whose_snapshot_missed_a_committed_lease_does_not_lease_the_ticket(
    engines: tuple[sa.Engine, sa.Engine, sa.Engine],
) -> None:
    """B's snapshot is taken before A's claim commits, its statement runs after: the live-
    lease probe cannot see A's lease, so the database itself must refuse a second one."""
    a, b, look = engines
    enqueue_both_kinds(look, "T-1")
    with b.connect().execution_options(isolation_level="REPEATABLE READ") as conn_b:
        tx_b = conn_b.begin()
        conn_b.execute(sa.text("SELECT 1"))  # B's snapshot, from now to the end of tx_b
        with a.begin() as conn_a:
            queue.claim(conn_a, kinds=("enrich",), owner="A", limit=1, lease_seconds=LEASE)
        with pytest.raises(sa_exc.IntegrityError) as refused:
            queue.claim(conn_b, kinds=("refresh",), owner="B", limit=5, lease_seconds=LEASE)
        assert constraint_name(refused.value) == LEASED_KEY_INDEX
        tx_b.rollback()
    assert leases(look, "T-1") == [("enrich", "A")]


def test_two_result_writes_of_one_ticket_in_flight_leave_the_later_one_whole(
    engines: tuple[sa.Engine, sa.Engine, sa.Engine],
) -> None:
    """A's write is not committed when B's starts: B waits for A, then replaces A's orders
    with its own. Never the union of both."""
    a, b, look = engines
    first = Enrichment((Order("O-1"), Order("O-2")))
    second = Enrichment((Order("O-3"),))
    errors: list[BaseException] = []
    with a.connect() as conn_a:
        tx = conn_a.begin()
        write_results(conn_a, [Result(101, "T-1", first, None)])

        def write_second() -> None:
            try:
                with b.begin() as conn_b:
                    write_results(conn_b, [Result(102, "T-1", second, None)])
            except BaseException as exc:  # the test asserts on it
                errors.append(exc)

        thread = threading.Thread(target=write_second)
        thread.start()
        wait_for(lambda: waiting_on_a_lock(look, "race-b"), what="B to wait for A's write")
        tx.commit()
        thread.join(30)
    assert errors == []
    with look.connect() as conn:
        orders = conn.execute(
            sa.text("SELECT order_id, queue_id FROM enrichq.ticket_orders ORDER BY order_id")
        ).all()
        enrichment = conn.execute(
            sa.text("SELECT order_count, queue_id FROM enrichq.ticket_enrichments")
        ).one()
    assert [tuple(r) for r in orders] == [("O-3", 102)]
    assert tuple(enrichment) == (1, 102)
