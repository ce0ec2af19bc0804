"""Fleet-wide admission of warehouse lookups against the daily budget, decided in the
database: what one admission sees of the lookups already in flight."""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa
from tests.support.settings import make_settings

from enrichq_service.worker.admission import Admission, Refused


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
    with pytest.raises(Refused) as refused:
        admission.admit(threading.Event())
    assert refused.value.reason == "budget"


def test_a_lookup_is_admitted_while_the_budget_has_room(db_url: str, db_engine: sa.Engine) -> None:
    spent_today(db_engine, 60, 2)  # 30 a lookup
    in_flight(db_engine, "other:1:a", 0)  # counts as 30
    admission = Admission(db_engine, make_settings(db_url, daily_bytes_budget=100), "me:3:c")
    admitted = admission.admit(threading.Event())
    assert (admitted.reserved, admitted.unknown_cost) == (30, False)
