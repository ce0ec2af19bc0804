"""The settler against real PostgreSQL: whatever one job of a group holds, the others settle.

Validation (`enrichq_service.enrich.validate`) keeps what the database cannot store out of
the settler; these tests hand the settler such values directly (what a gap in validation
would let through) and hold it to its promise: the group is settled again one job at a
time, only the culprit fails, every lookup is recorded and charged once, and the settler
thread goes on.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from tests.support.db import q
from tests.support.enrichers import SURROGATE
from tests.support.settings import make_settings
from tests.support.world import seeded

from enrichq_service import queue
from enrichq_service.enrich import Enrichment, Lookup, Order, Result
from enrichq_service.errors import Deferral
from enrichq_service.worker.lifecycle import Held, Jobs
from enrichq_service.worker.runner import _settlement_for
from enrichq_service.worker.settler import Settlement, Settler

OWNER = "settler-test"
BILLED = 1000


class Broken(tzinfo):
    """A time zone whose offset no datetime accepts: the driver raises ValueError."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        return timedelta(hours=30)

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)

    def tzname(self, dt: datetime | None) -> str:
        return "broken"


def started(db_engine: sa.Engine, n: int) -> tuple[Jobs, list[Held]]:
    """`n` seeded tickets' jobs claimed by OWNER and started, in key order."""
    keys = seeded(db_engine, n)
    with db_engine.begin() as conn:
        claimed = queue.claim(conn, owner=OWNER, limit=len(keys), lease_seconds=60)
    assert len(claimed) == len(keys)
    jobs = Jobs()
    held = [Held(job, None, deadline=float("inf")) for job in sorted(claimed, key=lambda j: j.key)]
    jobs.add(held)
    jobs.start(held, now=time.monotonic(), run_seconds=float("inf"))
    return jobs, held


def _culprit(settlement: Settlement, kind: str) -> Settlement:
    """`settlement` spoilt in the way `kind` names."""
    assert settlement.result is not None
    assert settlement.lookup is not None
    if kind == "surrogate_order_id":  # UnicodeEncodeError while binding
        spoilt = Enrichment((Order(f"O-{SURROGATE}"),))
        return replace(settlement, result=replace(settlement.result, enrichment=spoilt))
    if kind == "surrogate_job_id":  # the same, in the lookup log
        return replace(settlement, lookup=replace(settlement.lookup, job_id=f"j-{SURROGATE}"))
    if kind == "broken_time_zone":  # ValueError while binding
        spoilt = Enrichment((Order("O-1", placed_at=datetime(2026, 1, 1, tzinfo=Broken())),))
        return replace(settlement, result=replace(settlement.result, enrichment=spoilt))
    if kind == "surrogate_error":  # a retry whose error text was never escaped
        return replace(settlement, action=queue.SettleAction.RETRY, result=None, error=SURROGATE)
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["surrogate_order_id", "surrogate_job_id", "broken_time_zone", "surrogate_error"]
)
def test_one_unstorable_job_fails_alone_and_the_settler_goes_on(
    db_url: str, db_engine: sa.Engine, kind: str
) -> None:
    jobs, held = started(db_engine, 12)
    keys = [h.job.key for h in held]
    counts: Counter[str] = Counter()
    settler = Settler(
        db_engine,
        make_settings(db_url),
        OWNER,
        jobs,
        counted=lambda outcome, n: counts.update({outcome: n}),
        freed=lambda: None,
    )
    group = []
    for h in held:
        assert jobs.hand_off(h, finished=True)
        lookup = Lookup(
            h.id, h.job.claim_token, h.job.key, h.job.attempts, "job", BILLED, 1, 5.0, "ok", None
        )
        result = Result(h.id, h.job.key, Enrichment((Order(f"O-{h.job.key}"),)), None)
        group.append(Settlement(h, queue.SettleAction.COMPLETE, result=result, lookup=lookup))
    culprit = held[5].job.key
    group[5] = _culprit(group[5], kind)
    for settlement in group:
        settler.put(settlement)

    stop, give_up, died = threading.Event(), threading.Event(), []

    def run() -> None:
        try:
            settler.run(stop, give_up)
        except BaseException as exc:
            died.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    stop.set()
    thread.join(30)
    assert not thread.is_alive()
    assert died == []
    assert len(jobs) == 0  # nothing left held, nothing left leased below
    states = q(db_engine, "SELECT key, state, last_error FROM enrichq.queue ORDER BY key")
    assert {key: state for key, state, _ in states if key != culprit} == dict.fromkeys(
        (k for k in keys if k != culprit), "done"
    )
    [(state, error)] = [(state, error) for key, state, error in states if key == culprit]
    assert state == "failed"
    assert "refused" in error
    assert SURROGATE not in error
    assert counts == {"done": len(keys) - 1, "failed": 1}
    # every lookup recorded and charged once, the culprit's too
    assert q(db_engine, "SELECT count(*), sum(bytes_billed) FROM enrichq.lookup_log") == [
        (len(keys), BILLED * len(keys))
    ]
    assert q(db_engine, "SELECT lookups, bytes_billed FROM enrichq.budget_ledger") == [
        (len(keys), BILLED * len(keys))
    ]
    assert q(
        db_engine, "SELECT count(*) FROM enrichq.ticket_orders WHERE ticket_id = :k", k=culprit
    ) == [(0,)]


def test_the_settlements_of_one_lookup_are_never_split_between_groups(
    db_url: str, db_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup's settlements are put together and settled in one transaction, whatever the
    group size: its bytes are charged where its admission is released, so the budget never
    counts its reservation gone while part of its cost is not on the ledger yet. Groups of
    at most 2 here; two lookups of 3 jobs each make two groups of 3, not 2 + 2 + 2."""
    from enrichq_service.worker import settler as settler_module

    monkeypatch.setattr(settler_module, "GROUP_SIZE", 2)
    jobs, held = started(db_engine, 6)
    settler = Settler(
        db_engine, make_settings(db_url), OWNER, jobs, counted=lambda o, n: None, freed=lambda: None
    )
    groups: list[int] = []
    flush = settler.flush

    def counted_flush(group: list[Settlement]) -> None:
        groups.append(len(group))
        flush(group)

    monkeypatch.setattr(settler, "flush", counted_flush)
    settlements = []
    for h in held:
        assert jobs.hand_off(h, finished=True)
        result = Result(h.id, h.job.key, Enrichment((Order(f"O-{h.job.key}"),)), None)
        settlements.append(Settlement(h, queue.SettleAction.COMPLETE, result=result))
    settler.put(*settlements[:3])
    settler.put(*settlements[3:])
    stop, give_up = threading.Event(), threading.Event()
    stop.set()
    settler.run(stop, give_up)
    assert groups == [3, 3]
    assert q(db_engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'done'") == [(6,)]


class NoOffset(tzinfo):
    """A time zone that gives no UTC offset: Python takes such a time for a naive one."""

    def utcoffset(self, dt: datetime | None) -> None:
        return None

    def dst(self, dt: datetime | None) -> None:
        return None

    def tzname(self, dt: datetime | None) -> str:
        return "none"


NOON = datetime(2030, 1, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize(
    "untils",
    [
        [NOON.replace(tzinfo=NoOffset())],
        [NOON.replace(tzinfo=None)],
        # beside a time with an offset, in one group (binary arrays refuse the mix)
        [NOON.astimezone(ZoneInfo("Asia/Kolkata")), NOON.replace(tzinfo=None)],
        [NOON.replace(tzinfo=NoOffset()), NOON, NOON.replace(tzinfo=None)],
    ],
    ids=["no-offset", "naive", "aware-and-naive", "all-three"],
)
def test_a_deferral_until_a_time_without_offset_defers_until_that_time_in_utc(
    db_url: str, db_engine: sa.Engine, untils: list[datetime]
) -> None:
    jobs, held = started(db_engine, len(untils))
    settler = Settler(
        db_engine, make_settings(db_url), OWNER, jobs, counted=lambda o, n: None, freed=lambda: None
    )
    group = []
    for h, until in zip(held, untils, strict=True):
        assert jobs.hand_off(h, finished=True)
        group.append(_settlement_for(h, Deferral(until, "quota"), None))  # the runner's way
    settler.put(*group)
    stop, give_up = threading.Event(), threading.Event()
    stop.set()
    settler.run(stop, give_up)
    rows = q(db_engine, "SELECT state, visible_at, attempts FROM enrichq.queue ORDER BY key")
    # queued again until noon UTC, the attempt given back
    assert rows == [("queued", NOON, 0)] * len(untils)


def test_a_deferral_until_something_not_a_time_is_retried_saying_so() -> None:
    job = queue.Job(1, "enrich", "T-1", None, "manual", {}, 1, 5, uuid.uuid4(), NOON, NOON)
    settlement = _settlement_for(Held(job, None, float("inf")), Deferral("tomorrow", "x"), None)  # type: ignore[arg-type]
    assert settlement.action is queue.SettleAction.RETRY
    assert settlement.error == "InvalidResult: Deferral.until: expected a datetime, got str"
