"""Operator controls racing the workers, on two real connections each.

A cancel and a worker's heartbeat and settle of the same rows must never deadlock nor fail:
whichever commits first wins each row, the other sees the row's new version under its
lock and leaves it alone. A row a worker completed stays done with its result; a row the
cancel won is a cancelled dead letter and the worker's settle is refused, so its result is
never written. Redrive racing an enqueue of the same ticket leaves one queued row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from tests.support.db import lock_waiters
from tests.support.procs import wait_for
from tests.support.settings import make_settings
from tests.support.threads import run_together

from enrichq_schema.states import AuditCommand
from enrichq_service import queue
from enrichq_service.controls import actions as controls
from enrichq_service.controls.filters import Filter, Scope
from enrichq_service.queue import EnqueueRequest, EnqueueResult, Job

T = TypeVar("T")
OWNER = "w-race"
JOBS = 12
TRIALS = 20
RESULT = sa.text(
    "INSERT INTO enrichq.ticket_orders (ticket_id, order_id, looked_up_at, queue_id)"
    " SELECT q.key, 'O-' || q.key, now(), q.id FROM enrichq.queue AS q"
    " WHERE q.id = ANY(CAST(:ids AS bigint[]))"
)


def claim_all(engine: sa.Engine, prefix: str) -> list[Job]:
    """JOBS rows claimed by one worker, their keys in the opposite order of their ids: the
    settle and the cancel agree on the lock order only if both lock by key, not by id."""
    settings = make_settings(str(engine.url))
    keys = [f"{prefix}-{i:03d}" for i in range(JOBS)]
    with engine.begin() as conn:
        for key in reversed(keys):  # one statement each: ids follow this order
            queue.enqueue(conn, [EnqueueRequest.build(key=key)], settings=settings)
    with engine.begin() as conn:
        jobs = queue.claim(conn, kinds=("enrich",), owner=OWNER, limit=JOBS, lease_seconds=60)
    assert len(jobs) == JOBS
    return jobs


def settle(engine: sa.Engine, jobs: list[Job]) -> set[int]:
    """What a worker does: heartbeat, then complete and write the winners' results."""
    with engine.begin() as conn:
        lost = queue.heartbeat(conn, owner=OWNER, jobs=jobs, lease_seconds=60)
    held = [j for j in jobs if j.id not in lost]
    with engine.begin() as conn:
        won = queue.complete(conn, owner=OWNER, jobs=held)
        conn.execute(RESULT, {"ids": sorted(won)})
    return won


def outcome(engine: sa.Engine, prefix: str) -> dict[int, tuple[str, str | None, bool]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT q.id, q.state, q.dead_reason,"
                " EXISTS (SELECT 1 FROM enrichq.ticket_orders AS o WHERE o.queue_id = q.id)"
                " AS has_result"
                " FROM enrichq.queue AS q WHERE q.key LIKE :prefix"
            ),
            {"prefix": f"{prefix}-%"},
        )
        return {r.id: (r.state, r.dead_reason, r.has_result) for r in rows}


def cancel_prefix(engine: sa.Engine, prefix: str) -> dict[str, int]:
    flt = Filter.build(Scope.OPEN, keys=[f"{prefix}-{i:03d}" for i in range(JOBS)])
    with engine.connect() as conn:
        with conn.begin():
            selection = controls.select(conn, flt)
        with conn.begin():
            return controls.cancel_batch(conn, flt, selection.ids)


def test_a_cancel_racing_a_settle_never_deadlocks_nor_fails(db_engine: sa.Engine) -> None:
    for trial in range(TRIALS):
        prefix = f"R{trial:02d}"
        jobs = claim_all(db_engine, prefix)
        race: list[Callable[[], Any]] = [
            partial(settle, db_engine, jobs),
            partial(cancel_prefix, db_engine, prefix),
        ]
        won, cancelled = run_together(race)
        assert not isinstance(won, BaseException), won
        assert not isinstance(cancelled, BaseException), cancelled
        rows = outcome(db_engine, prefix)
        assert set(rows) == {j.id for j in jobs}
        for row_id, (state, dead_reason, has_result) in rows.items():
            if row_id in won:
                assert (state, has_result) == ("done", True)
            else:
                assert (state, dead_reason, has_result) == ("dead_letter", "cancelled", False)
        assert cancelled == {"queued": 0, "leased": JOBS - len(won), "kept": 0}


@pytest.mark.parametrize("first", ["settle", "cancel"])
def test_whoever_commits_first_wins_and_the_other_waits_then_steps_aside(
    db_engine: sa.Engine, first: str
) -> None:
    jobs = claim_all(db_engine, "W")
    flt = Filter.build(Scope.OPEN, all_rows=True)
    with db_engine.connect() as conn:
        selection = controls.select(conn, flt)
    holder = db_engine.connect()
    tx = holder.begin()
    if first == "settle":
        # the worker's settle holds its rows' locks, its results not yet written
        won = queue.complete(holder, owner=OWNER, jobs=jobs)
        second: Callable[[], Any] = lambda: cancel_batch_committed(db_engine, flt, selection.ids)  # noqa: E731
    else:
        controls.cancel_batch(holder, flt, selection.ids)
        second = lambda: settle(db_engine, jobs)  # noqa: E731
    [result] = run_in_background(second, until=lambda: lock_waiters(db_engine) == 1)
    if first == "settle":
        holder.execute(RESULT, {"ids": sorted(won)})
    tx.commit()
    holder.close()
    answer = result()
    rows = outcome(db_engine, "W")
    if first == "settle":
        assert answer == {"queued": 0, "leased": 0, "kept": 0}  # nothing left: all done
        assert set(rows.values()) == {("done", None, True)}
    else:
        assert answer == set()  # every write refused: no result written
        assert set(rows.values()) == {("dead_letter", "cancelled", False)}


def cancel_batch_committed(engine: sa.Engine, flt: Filter, ids: Sequence[int]) -> Any:
    with engine.begin() as conn:
        return controls.cancel_batch(conn, flt, ids)


def run_in_background(call: Callable[[], T], *, until: Callable[[], bool]) -> list[Callable[[], T]]:
    """Start `call` on a thread and return once `until` holds; a getter of its result."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(_capture(call)))
    thread.start()
    wait_for(lambda: until() or bool(box), what="the second writer to wait for the lock")

    def result() -> T:
        thread.join(60)
        assert box, "the second writer never finished"
        value = box[0]
        if isinstance(value, BaseException):
            raise value
        return value  # type: ignore[no-any-return]  # the box holds the call's own result

    return [result]


def _capture(call: Callable[[], T]) -> T | BaseException:
    try:
        return call()
    except BaseException as exc:  # handed to the test
        return exc


def redrive_key(engine: sa.Engine, key: str) -> dict[str, int]:
    flt = Filter.build(Scope.DEAD, keys=[key])
    with engine.connect() as conn:
        with conn.begin():
            selection = controls.select(conn, flt)
        with conn.begin():
            return controls.redrive_batch(conn, flt, selection.ids, selection.winners)


def enqueue_key(engine: sa.Engine, key: str) -> object:
    settings = make_settings(str(engine.url))
    with engine.begin() as conn:
        return queue.enqueue(conn, [EnqueueRequest.build(key=key)], settings=settings)


def test_a_redrive_racing_an_enqueue_of_the_same_ticket_leaves_one_queued_row(
    db_engine: sa.Engine,
) -> None:
    for trial in range(TRIALS):
        key = f"D-{trial:02d}"
        with db_engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts,"
                    " finished_at, dead_reason) VALUES"
                    " ('enrich', :key, 'created', 'dead_letter', 3, 3, now(), 'attempts_exhausted')"
                ),
                {"key": key},
            )
        race: list[Callable[[], Any]] = [
            partial(redrive_key, db_engine, key),
            partial(enqueue_key, db_engine, key),
        ]
        results = run_together(race)
        assert not [r for r in results if isinstance(r, BaseException)], results
        with db_engine.connect() as conn:
            states = sorted(
                conn.execute(
                    sa.text("SELECT state FROM enrichq.queue WHERE key = :key"), {"key": key}
                ).scalars()
            )
        # the redrive won (the enqueue merged into it) or merged into the enqueued row
        assert states in (["queued"], ["dead_letter", "queued"])


# -- work that arrives while a cancel runs survives it


def enqueue_one(engine: sa.Engine, key: str) -> EnqueueResult:
    settings = make_settings(str(engine.url))
    with engine.begin() as conn:
        [result] = queue.enqueue(conn, [EnqueueRequest.build(key=key)], settings=settings)
        return result


def open_rows(engine: sa.Engine, key: str) -> list[tuple[int, str, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, state, dead_reason FROM enrichq.queue WHERE key = :key ORDER BY id"
            ),
            {"key": key},
        )
        return [(r.id, r.state, r.dead_reason) for r in rows]


def test_an_event_merged_after_a_cancel_selected_its_row_is_not_cancelled(
    db_engine: sa.Engine,
) -> None:
    """The cancel selects the queued row; an event for its ticket merges into it and
    commits; then the cancel's batch runs. The event came after the operator acted: its
    work stays queued."""
    first = enqueue_one(db_engine, "M-1")
    arrived: list[EnqueueResult] = []

    def event_arrives(would: controls.ActionResult) -> bool:
        # between the selection and the first batch, on a connection of its own
        assert would.matched == 1
        arrived.append(enqueue_one(db_engine, "M-1"))
        return True

    result = controls.run(
        db_engine,
        AuditCommand.CANCEL,
        Filter.build(Scope.OPEN, keys=["M-1"]),
        actor="ops",
        confirm=event_arrives,
    )
    [merged] = arrived
    assert (merged.id, merged.inserted) == (first.id, False)
    assert result.counts == {"queued": 0, "leased": 0, "kept": 1}
    assert open_rows(db_engine, "M-1") == [(first.id, "queued", None)]


def test_an_event_whose_transaction_began_before_the_cancel_but_merged_after_survives(
    db_engine: sa.Engine,
) -> None:
    """The ingest transaction begins (deduping the event, say) before the operator's cancel,
    and merges into the queued row only after the cancel selected it. The merge is new work:
    kept. Before, merged_at was the ingest transaction's start, earlier than the cancel's,
    and the row was cancelled."""
    settings = make_settings(str(db_engine.url))
    first = enqueue_one(db_engine, "M-4")
    event = db_engine.connect()
    event_tx = event.begin()
    event.execute(sa.text("SELECT 1"))  # the ingest transaction's clock starts here
    wait_for(
        lambda: event.execute(sa.text("SELECT clock_timestamp() > now()")).scalar(),
        what="the ingest transaction to be older than the cancel",
    )

    def event_merges(would: controls.ActionResult) -> bool:
        [merged] = queue.enqueue(event, [EnqueueRequest.build(key="M-4")], settings=settings)
        assert (merged.id, merged.inserted) == (first.id, False)
        event_tx.commit()
        return True

    try:
        result = controls.run(
            db_engine,
            AuditCommand.CANCEL,
            Filter.build(Scope.OPEN, keys=["M-4"]),
            actor="ops",
            confirm=event_merges,
        )
    finally:
        event.close()
    assert result.counts == {"queued": 0, "leased": 0, "kept": 1}
    assert open_rows(db_engine, "M-4") == [(first.id, "queued", None)]


def test_an_event_merging_while_a_cancel_batch_runs_survives_whoever_locks_first(
    db_engine: sa.Engine,
) -> None:
    """Merge first: the event's transaction merged into the row and has not committed when
    the cancel's batch reaches the row. The batch waits for it, then keeps the row.
    Cancel first: the batch has cancelled the row and not committed when the event comes;
    the event waits, then queues a new row. Either way the event's work stays queued."""
    settings = make_settings(str(db_engine.url))
    flt = Filter.build(Scope.OPEN, keys=["M-2", "M-3"])
    m2 = enqueue_one(db_engine, "M-2")
    m3 = enqueue_one(db_engine, "M-3")
    with db_engine.connect() as conn, conn.begin():
        selection = controls.select(conn, flt)
    # merge first (M-2): the batch waits for the event's transaction
    event = db_engine.connect()
    event_tx = event.begin()
    [merged] = queue.enqueue(event, [EnqueueRequest.build(key="M-2")], settings=settings)
    assert (merged.id, merged.inserted) == (m2.id, False)

    def cancel() -> dict[str, int]:
        with db_engine.begin() as conn:
            return controls.cancel_batch(conn, flt, selection.ids, started=selection.started)

    [batch] = run_in_background(cancel, until=lambda: lock_waiters(db_engine) == 1)
    event_tx.commit()
    event.close()
    assert batch() == {"queued": 1, "leased": 0, "kept": 1}
    assert open_rows(db_engine, "M-2") == [(m2.id, "queued", None)]
    assert open_rows(db_engine, "M-3") == [(m3.id, "dead_letter", "cancelled")]
    # cancel first (M-3 again, queued anew): the event waits for the batch's transaction
    m3b = enqueue_one(db_engine, "M-3")
    only_m3 = Filter.build(Scope.OPEN, keys=["M-3"])
    with db_engine.connect() as conn, conn.begin():
        again = controls.select(conn, only_m3)
    holder = db_engine.connect()
    holder_tx = holder.begin()
    assert controls.cancel_batch(holder, only_m3, again.ids, started=again.started)["queued"] == 1
    [late] = run_in_background(
        partial(enqueue_one, db_engine, "M-3"), until=lambda: lock_waiters(db_engine) == 1
    )
    holder_tx.commit()
    holder.close()
    row = late()
    assert row.inserted
    assert open_rows(db_engine, "M-3")[-2:] == [
        (m3b.id, "dead_letter", "cancelled"),
        (row.id, "queued", None),
    ]
