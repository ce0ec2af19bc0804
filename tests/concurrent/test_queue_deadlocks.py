"""Writers of the queue wait for each other but never deadlock (DESIGN §3, lock order).

Three pairs that deadlocked before every multi-row writer took its row locks in one global
order ((key, kind, id), byte order), each raced 20 times on real connections released
together by a barrier. A deadlock is counted twice: as an error surfaced to the caller,
and in `pg_stat_database.deadlocks`, which also sees one that enrichq retried quietly.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import pytest
import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from tests.support.settings import make_settings

from enrichq_schema.db import create_engine
from enrichq_schema.settings import Settings
from enrichq_service import queue
from enrichq_service.queue import EnqueueRequest, Job, Settle, SettleAction
from enrichq_sweeper import recovery

pytestmark = pytest.mark.slow

TRIALS = 20
ROWS = 200
T0 = datetime(2026, 2, 2, 8, 0, tzinfo=UTC)
LEASE = 60.0
DEADLOCK = "40P01"


@pytest.fixture
def engines(db_url: str) -> Iterator[tuple[sa.Engine, sa.Engine]]:
    """A pool for the racing sessions and one for setting up and looking."""
    racing = create_engine(db_url, pool_size=2)
    look = create_engine(db_url, pool_size=1)
    yield racing, look
    racing.dispose()
    look.dispose()


def deadlocks_so_far(look: sa.Engine, racing: sa.Engine) -> int:
    """Deadlocks the server detected in this database. A backend reports its counts when it
    exits, so the racing sessions are closed first."""
    racing.dispose()
    with look.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        n = conn.execute(
            sa.text("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        ).scalar_one()
    return int(n)


def race(calls: list[Callable[[], Any]]) -> list[BaseException]:
    """Run the calls on threads released together; the exceptions they raised."""
    barrier = threading.Barrier(len(calls))
    errors: list[BaseException] = []

    def run(call: Callable[[], Any]) -> None:
        try:
            barrier.wait(30)
            call()
        except BaseException as exc:  # the test asserts on it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a racing writer never finished"
    return errors


def sqlstates(errors: list[BaseException]) -> list[str | None]:
    return [getattr(getattr(e, "orig", None), "sqlstate", None) for e in errors]


def keys_out_of_id_order(rng: random.Random, n: int, trial: int) -> list[str]:
    """Keys whose byte order is not the order their rows' ids will have."""
    keys = [f"K{trial:02d}-{i:04d}" for i in range(n)]
    rng.shuffle(keys)
    return keys


def enqueue_and_claim(look: sa.Engine, keys: list[str], now: datetime) -> list[Job]:
    cfg = make_settings(str(look.url), max_attempts=50)
    with look.begin() as conn:
        for key in keys:  # one statement each, so ids follow this (shuffled) order
            queue.enqueue(conn, [EnqueueRequest.build(key=key)], settings=cfg, now=now)
        jobs = queue.claim(
            conn, kinds=("enrich",), owner="w", limit=len(keys), lease_seconds=LEASE, now=now
        )
    assert len(jobs) == len(keys)
    return sorted(jobs, key=lambda j: j.id)


def mixed_group(jobs: list[Job]) -> list[Settle]:
    """A settle group of every action: the high ids complete, the low ones fail, retry or
    defer (the order that deadlocked when each action locked its rows separately)."""
    half = len(jobs) // 2
    group = [Settle(j, SettleAction.COMPLETE) for j in jobs[half:]]
    for n, job in enumerate(jobs[:half]):
        action = (SettleAction.RETRY, SettleAction.DEFER, SettleAction.FAIL)[n % 3]
        group.append(Settle(job, action, error="boom"))
    return group


def settle_group(racing: sa.Engine, group: list[Settle], now: datetime) -> None:
    with racing.begin() as conn:
        queue.settle(
            conn,
            owner="w",
            settles=group,
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
            now=now,
        )


def heartbeat(racing: sa.Engine, jobs: list[Job], now: datetime) -> None:
    with racing.begin() as conn:
        queue.heartbeat(conn, owner="w", jobs=jobs, lease_seconds=LEASE, now=now)


def sweep(racing: sa.Engine, now: datetime, out: list[recovery.RecoveryResult]) -> None:
    out.append(recovery.run_once(racing, now=now, gave_up_hook=None))


def enqueue(racing: sa.Engine, cfg: Settings, requests: list[EnqueueRequest]) -> None:
    with racing.begin() as conn:
        queue.enqueue(conn, requests, settings=cfg)


def test_a_settle_group_and_the_heartbeat_of_the_same_worker(
    engines: tuple[sa.Engine, sa.Engine],
) -> None:
    racing, look = engines
    rng = random.Random(1)
    before = deadlocks_so_far(look, racing)
    surfaced: list[str | None] = []
    for trial in range(TRIALS):
        now = T0 + timedelta(hours=trial)
        jobs = enqueue_and_claim(look, keys_out_of_id_order(rng, ROWS, trial), now)
        at = now + timedelta(seconds=1)

        surfaced += sqlstates(
            race(
                [
                    partial(settle_group, racing, mixed_group(jobs), at),
                    partial(heartbeat, racing, jobs, at),
                ]
            )
        )
    assert surfaced == []
    assert deadlocks_so_far(look, racing) - before == 0


def test_a_settle_just_before_expiry_and_the_sweepers_recovery_batch(
    engines: tuple[sa.Engine, sa.Engine],
) -> None:
    """The settle sees its leases live, the sweeper (a moment later) sees them expired:
    both go for the same rows at once."""
    racing, look = engines
    rng = random.Random(2)
    before = deadlocks_so_far(look, racing)
    surfaced: list[str | None] = []
    passes_failed = 0
    for trial in range(TRIALS):
        now = T0 + timedelta(hours=trial)
        jobs = enqueue_and_claim(look, keys_out_of_id_order(rng, ROWS, trial), now)
        just_before = now + timedelta(seconds=LEASE - 0.01)
        just_after = now + timedelta(seconds=LEASE + 0.01)
        outcome: list[recovery.RecoveryResult] = []
        surfaced += sqlstates(
            race(
                [
                    partial(settle_group, racing, mixed_group(jobs), just_before),
                    partial(sweep, racing, just_after, outcome),
                ]
            )
        )
        passes_failed += len(outcome) != 1
        with look.connect() as conn:
            leased = conn.execute(
                sa.text("SELECT count(*) FROM enrichq.queue WHERE state = 'leased'")
            ).scalar_one()
        assert leased == 0, f"trial {trial}: {leased} rows neither settled nor recovered"
    assert surfaced == []
    assert passes_failed == 0
    assert deadlocks_so_far(look, racing) - before == 0


def test_two_enqueue_batches_of_the_same_keys_in_opposite_orders(
    engines: tuple[sa.Engine, sa.Engine],
) -> None:
    racing, look = engines
    cfg = make_settings(str(look.url))
    before = deadlocks_so_far(look, racing)
    surfaced: list[str | None] = []
    for trial in range(TRIALS):
        keys = [f"E{trial:02d}-{i:04d}" for i in range(1000)]
        forward = [EnqueueRequest.build(key=k, reason="updated") for k in keys]
        backward = list(reversed(forward))

        surfaced += sqlstates(
            race(
                [
                    partial(enqueue, racing, cfg, forward),
                    partial(enqueue, racing, cfg, backward),
                ]
            )
        )
        with look.connect() as conn:
            queued = conn.execute(
                sa.text(
                    "SELECT count(*) FROM enrichq.queue WHERE key LIKE :p AND state = 'queued'"
                ),
                {"p": f"E{trial:02d}-%"},
            ).scalar_one()
        assert queued == 1000
    assert surfaced == []
    assert deadlocks_so_far(look, racing) - before == 0


def test_the_deadlock_counter_sees_a_deadlock(engines: tuple[sa.Engine, sa.Engine]) -> None:
    """Guard for the tests above: two sessions locking two rows in opposite orders are
    counted, so a zero above is not a counter that never moves."""
    racing, look = engines
    with look.begin() as conn:
        conn.execute(sa.text("CREATE TABLE public.pair (id int PRIMARY KEY)"))
        conn.execute(sa.text("INSERT INTO public.pair VALUES (1), (2)"))
    before = deadlocks_so_far(look, racing)
    ready = threading.Barrier(2)

    def lock(first: int, second: int) -> None:
        with racing.begin() as conn:
            conn.execute(
                sa.text("SELECT 1 FROM public.pair WHERE id = :i FOR UPDATE"), {"i": first}
            )
            ready.wait(10)
            conn.execute(
                sa.text("SELECT 1 FROM public.pair WHERE id = :i FOR UPDATE"), {"i": second}
            )

    errors = race([lambda: lock(1, 2), lambda: lock(2, 1)])
    assert sqlstates(errors) == [DEADLOCK]
    assert isinstance(errors[0], sa_exc.DBAPIError)
    assert deadlocks_so_far(look, racing) - before == 1
