"""Fleet-wide admission of warehouse lookups against the daily budget, decided in the
database: what one admission sees of the lookups already in flight."""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY
from tests.support.settings import make_settings

from enrichq_schema.db import create_engine
from enrichq_schema.states import PoolMode
from enrichq_service.worker.admission import (
    ADMISSION_LOCK_SPACE,
    ADMISSION_LOCK_WAIT_SECONDS,
    Admission,
    AdmissionRefused,
    Admitted,
)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def in_flight(engine: sa.Engine, owner: str, reserved: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.lookups_in_flight"
                " (token, owner, reserved_bytes, started_at, expires_at)"
                " VALUES (:t, :o, :r, now(), now() + interval '1 minute')"
            ),
            {"t": uuid.uuid4(), "o": owner, "r": reserved},
        )


def spent_today(engine: sa.Engine, bytes_billed: int, lookups: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.budget_ledger (day, bytes_billed, lookups)"
                " VALUES (CAST(timezone('UTC', now()) AS date), :b, :n)"
            ),
            {"b": bytes_billed, "n": lookups},
        )


def test_lookups_of_unknown_cost_in_flight_count_at_the_known_average(
    db_url: str, db_engine: sa.Engine
) -> None:
    """Budget 100, one 60-byte lookup charged, two admitted before any cost was known
    (reserved 0) still running: 60 + 60 + 60 reach the budget, so the next is refused.
    Counting those two as 0 let it through, and a fleet of two overspent by 140 bytes."""
    spent_today(db_engine, 60, 1)
    in_flight(db_engine, "other:1:a", 0)
    in_flight(db_engine, "other:2:b", 0)
    admission = Admission(db_engine, make_settings(db_url, daily_bytes_budget=100), "me:3:c")
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit(threading.Event())
    assert refused.value.reason == "budget"


def test_a_lookup_is_admitted_while_the_budget_has_room(db_url: str, db_engine: sa.Engine) -> None:
    spent_today(db_engine, 60, 2)  # 30 a lookup
    in_flight(db_engine, "other:1:a", 0)  # counts as 30
    admission = Admission(db_engine, make_settings(db_url, daily_bytes_budget=100), "me:3:c")
    admitted = admission.admit(threading.Event())
    assert (admitted.reserved, admitted.unknown_cost) == (30, False)


def test_a_take_made_while_the_first_cost_was_unknown_does_not_admit_a_second_unknown(
    db_url: str, db_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One lookup of unknown cost per worker: a second admission whose take ran while the
    first lookup's cost was unknown, and which reaches the permit only once that lookup
    has learned its cost, must not run as a second lookup of unknown cost (two workers
    overspent a budget of 100 by four 60-byte lookups, one in 15 runs under load)."""
    admission = Admission(db_engine, make_settings(db_url, daily_bytes_budget=100), "w")
    first = admission.admit(threading.Event())
    assert (first.unknown_cost, first.reserved) == (True, 0)
    took, learned = threading.Event(), threading.Event()
    take = Admission._take

    def take_then_wait(self: Admission, token: uuid.UUID) -> sa.Row[tuple[object, ...]]:
        row = take(self, token)
        if not took.is_set():  # the second admission's first take: the cost still unknown
            took.set()
            learned.wait(30)
        return row

    monkeypatch.setattr(Admission, "_take", take_then_wait)
    second: list[object] = []
    thread = threading.Thread(target=lambda: second.append(admission.admit(threading.Event())))
    thread.start()
    assert took.wait(30)
    admission.learned(first, 60)  # the first lookup cost 60 bytes: its permit is free again
    learned.set()
    thread.join(30)

    [admitted] = second
    assert isinstance(admitted, Admitted)
    assert (admitted.unknown_cost, admitted.reserved) == (False, 60)


def test_no_admission_lock_is_held_while_the_worker_waits_for_a_reply(
    db_url: str, db_engine: sa.Engine
) -> None:
    """After every reply an admission gets, before the worker sends anything else (where a
    SIGSTOPped worker would stay), another session can take the fleet's admission lock:
    a frozen worker costs the others nothing (they waited on it until their statement
    timeout, and exited 1)."""
    engine = create_engine(db_url, pool_size=1)
    free_after_reply: list[bool] = []

    def try_the_lock(conn: sa.Connection, cursor: object, statement: str, *args: object) -> None:
        with db_engine.connect() as other:
            got = other.execute(
                sa.text("SELECT pg_try_advisory_lock(:space, 0)"), {"space": ADMISSION_LOCK_SPACE}
            ).scalar_one()
            if got:
                other.execute(
                    sa.text("SELECT pg_advisory_unlock(:space, 0)"),
                    {"space": ADMISSION_LOCK_SPACE},
                )
            free_after_reply.append(bool(got))

    sa.event.listen(engine, "after_cursor_execute", try_the_lock)
    try:
        for settings in (
            make_settings(db_url, warehouse_max_concurrency=1),
            make_settings(db_url, daily_bytes_budget=100),
        ):
            admission = Admission(engine, settings, "me:1:a")
            admitted = admission.admit(threading.Event())
            assert admitted.token is not None
            admission.release([admitted.token])
    finally:
        sa.event.remove(engine, "after_cursor_execute", try_the_lock)
        engine.dispose()
    assert free_after_reply
    assert all(free_after_reply), free_after_reply


def test_a_known_cost_of_zero_bytes_is_known(db_url: str, db_engine: sa.Engine) -> None:
    """The ledger's latest average is 0 bytes a lookup: two lookups are admitted at once,
    neither of unknown cost (an average of 0 counted as unknown: one at a time, forever)."""
    spent_today(db_engine, 0, 5)
    admission = Admission(db_engine, make_settings(db_url, daily_bytes_budget=100), "me:1:a")
    first = admission.admit(threading.Event())
    second = admission.admit(threading.Event())
    assert (first.unknown_cost, first.reserved) == (False, 0)
    assert (second.unknown_cost, second.reserved) == (False, 0)


def test_a_wait_for_a_cost_estimate_is_not_labelled_cap(db_url: str, db_engine: sa.Engine) -> None:
    """No cap, a budget, nothing known yet: this worker's second lookup waits for its first
    to learn its cost, and is refused as `estimate` (it said `cap`, with no cap set)."""
    admission = Admission(db_engine, make_settings(db_url, daily_bytes_budget=100), "me:1:a")
    first = admission.admit(threading.Event())
    assert first.unknown_cost
    before = {r: sample("enrichq_warehouse_deferrals_total", reason=r) for r in ("cap", "estimate")}
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit(threading.Event())
    assert refused.value.reason == "estimate"
    after = {r: sample("enrichq_warehouse_deferrals_total", reason=r) for r in ("cap", "estimate")}
    assert (after["cap"] - before["cap"], after["estimate"] - before["estimate"]) == (0, 1)


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_an_admission_waits_for_the_lock_no_longer_than_the_statement_timeout(
    db_url: str, db_engine: sa.Engine, mode: PoolMode
) -> None:
    """A session holds the fleet's admission lock (a frozen process, an operator's psql).
    An admission waits for it ADMISSION_LOCK_WAIT_SECONDS at most, in either pool mode, and
    leaves nothing behind: behind a transaction pooler the statement ran in autocommit,
    without the statement timeout a transaction gets, waited until the holder let go (6 s
    here), and then took a slot its worker would long have given up on."""
    assert ADMISSION_LOCK_WAIT_SECONDS < 6
    settings = make_settings(db_url, warehouse_max_concurrency=1, pool_mode=mode)
    engine = create_engine(db_url, pool_size=1, pool_mode=mode, statement_timeout_seconds=30)
    token = uuid.uuid4()
    with db_engine.connect() as holder:
        holder.execute(sa.text("SELECT pg_advisory_lock(:s, 0)"), {"s": ADMISSION_LOCK_SPACE})
        unlock = sa.text("SELECT pg_advisory_unlock_all()")
        let_go = threading.Timer(6, lambda: holder.execute(unlock))
        try:
            let_go.start()
            with pytest.raises(sa.exc.OperationalError, match="lock timeout"):
                Admission(engine, settings, "me:1:a")._take(token)
        finally:
            let_go.cancel()
            let_go.join()
            holder.execute(unlock)
            engine.dispose()
    with db_engine.connect() as conn:
        taken = conn.execute(
            sa.text("SELECT count(*) FROM enrichq.lookups_in_flight WHERE token = :t"),
            {"t": token},
        ).scalar_one()
    assert taken == 0


def test_the_admission_function_carries_its_lock_wait(db_engine: sa.Engine) -> None:
    """The bound lives in enrichq.admission_take's definition (migration 0019), which a later
    revision that replaces the function would drop unless it sets it again."""
    with db_engine.connect() as conn:
        config = conn.execute(
            sa.text("SELECT proconfig FROM pg_proc WHERE oid = 'enrichq.admission_take'::regproc")
        ).scalar_one()
    assert f"lock_timeout={ADMISSION_LOCK_WAIT_SECONDS:g}s" in (config or [])
