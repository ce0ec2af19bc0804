"""Every queue transition of DESIGN §3, and every refusal of a fenced write."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.settings import make_settings

from enrichq_schema.settings import Settings
from enrichq_schema.states import Outcome, Plan
from enrichq_schema.tables import LEASED_KEY_INDEX
from enrichq_service import queue
from enrichq_service.controls import actions as controls
from enrichq_service.controls.filters import Filter, Scope
from enrichq_service.queue import EnqueueRequest, Job

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
LEASE = 60.0


@pytest.fixture
def cfg() -> Settings:
    return make_settings(delay_created_seconds=600, delay_updated_seconds=120, max_attempts=3)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def row(conn: sa.Connection, job_id: int | None) -> sa.Row[tuple[object, ...]]:
    return conn.execute(queue.SQL("queue_get"), {"id": job_id}).one()


def put(conn: sa.Connection, cfg: Settings, key: str, *, reason: str = "manual", **kw: Any) -> int:
    [res] = queue.enqueue(
        conn, [EnqueueRequest.build(key=key, reason=reason, **kw)], settings=cfg, now=T0
    )
    assert res.inserted
    assert res.id is not None
    return res.id


def claim_one(conn: sa.Connection, owner: str = "w1", now: float = 0) -> Job:
    [job] = queue.claim(conn, owner=owner, limit=1, lease_seconds=LEASE, now=at(now))
    return job


# -- enqueue


@pytest.mark.parametrize(
    ("reason", "delay", "seconds_after", "visible_after"),
    [
        ("updated", 0, 7, 30),  # rounded up to the next boundary of 30 s
        ("updated", 0, 30, 30),  # on a boundary: visible then
        ("updated", 120, 7, 150),  # the delay first, then the boundary
        ("created", 600, 31, 660),
        ("manual", 0, 7, 7),  # a person is waiting: not held
    ],
)
def test_the_lookup_window_rounds_event_visibility_up_to_its_boundary(
    conn: sa.Connection, reason: str, delay: float, seconds_after: float, visible_after: float
) -> None:
    """ENRICHQ_LOOKUP_WINDOW_SECONDS: boundaries at the multiples of the window since the
    epoch (T0 is one), after the reason's delay; manual work exempt."""
    cfg = make_settings(
        delay_created_seconds=600, delay_updated_seconds=120, lookup_window_seconds=30
    )
    [res] = queue.enqueue(
        conn,
        [EnqueueRequest.build(key="W-1", reason=reason, delay_seconds=delay)],
        settings=cfg,
        now=at(seconds_after),
    )
    assert row(conn, res.id).visible_at == at(visible_after)


def test_enqueue_sets_visibility_delay_by_reason(conn: sa.Connection, cfg: Settings) -> None:
    created = put(conn, cfg, "T-1", reason="created")
    updated = put(conn, cfg, "T-2", reason="updated")
    manual = put(conn, cfg, "T-3")
    assert row(conn, created).visible_at == at(600)
    assert row(conn, updated).visible_at == at(120)
    assert row(conn, manual).visible_at == T0
    r = row(conn, created)
    assert (r.state, r.attempts, r.max_attempts, r.reason) == ("queued", 0, 3, "created")


def test_second_enqueue_of_a_queued_ticket_merges(conn: sa.Connection, cfg: Settings) -> None:
    first = put(conn, cfg, "T-1", reason="created")
    results = queue.enqueue(
        conn,
        [EnqueueRequest.build(key="T-1", reason="updated"), EnqueueRequest.build(key="T-2")],
        settings=cfg,
        now=T0,
    )
    assert [(r.key, r.inserted) for r in results] == [("T-1", False), ("T-2", True)]
    assert results[0].id == first
    assert conn.execute(sa.text("SELECT count(*) FROM enrichq.queue")).scalar() == 2


def test_same_key_twice_in_one_batch_inserts_once(conn: sa.Connection, cfg: Settings) -> None:
    results = queue.enqueue(
        conn, [EnqueueRequest.build(key="T-1"), EnqueueRequest.build(key="T-1")], settings=cfg
    )
    assert [r.inserted for r in results] == [True, False]
    assert results[0].id == results[1].id


def test_enqueue_after_claim_adds_a_new_queued_row(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1")
    claim_one(conn)
    again = queue.enqueue(conn, [EnqueueRequest.build(key="T-1")], settings=cfg, now=at(1))
    assert again[0].inserted


def test_enqueue_a_batch_of_10000_is_one_statement(conn: sa.Connection, cfg: Settings) -> None:
    statements: list[str] = []
    sa.event.listen(conn, "before_cursor_execute", lambda *a: statements.append(a[2]))
    reqs = [EnqueueRequest.build(key=f"T-{i}", tenant=f"brand-{i % 7}") for i in range(10_000)]
    results = queue.enqueue(conn, reqs, settings=cfg)
    assert sum(r.inserted for r in results) == 10_000
    assert len(statements) == 1


def test_sql_metacharacters_in_keys_and_tenants_are_data(
    conn: sa.Connection, cfg: Settings
) -> None:
    key = "T'); DROP TABLE enrichq.queue; --"
    job_id = put(conn, cfg, key, tenant="b'\"\\%_")
    assert row(conn, job_id).key == key
    assert row(conn, job_id).tenant == "b'\"\\%_"


# -- claim


def test_claim_leases_visible_rows_and_counts_the_attempt(
    conn: sa.Connection, cfg: Settings
) -> None:
    job_id = put(conn, cfg, "T-1")
    put(conn, cfg, "T-2", reason="created")  # not visible for 10 minutes
    jobs = queue.claim(conn, owner="w1", limit=10, lease_seconds=LEASE, now=at(5))
    assert [j.id for j in jobs] == [job_id]
    r = row(conn, job_id)
    assert (r.state, r.attempts, r.lease_owner) == ("leased", 1, "w1")
    assert r.lease_expires_at == at(65)
    assert jobs[0].attempts == 1


def test_claim_respects_the_limit_and_oldest_first(conn: sa.Connection, cfg: Settings) -> None:
    ids = [put(conn, cfg, f"T-{i}", delay_seconds=10 - i) for i in range(5)]
    jobs = queue.claim(conn, owner="w1", limit=3, lease_seconds=LEASE, now=at(20))
    assert [j.id for j in jobs] == sorted(ids[2:])  # visible 8, 7, 6 s after T0: oldest first


def test_claim_only_takes_the_kinds_it_is_given(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1", kind="refresh")
    enrich_only = ("enrich",)
    assert (
        queue.claim(conn, kinds=enrich_only, owner="w", limit=5, lease_seconds=LEASE, now=T0) == []
    )
    assert len(queue.claim(conn, owner="w", limit=5, lease_seconds=LEASE, now=T0))


def test_claim_never_takes_a_key_that_has_a_lease(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1")
    first = claim_one(conn, "w1", now=0)
    put(conn, cfg, "T-1")
    refresh = put(conn, cfg, "T-1", kind="refresh")
    assert queue.claim(conn, owner="w2", limit=5, lease_seconds=LEASE, now=at(10)) == []
    # an expired lease still holds the key, until the sweeper recovers it: the ticket is
    # never worked by two leases at once, whatever their kinds
    assert queue.claim(conn, owner="w2", limit=5, lease_seconds=LEASE, now=at(61)) == []
    assert queue.complete(conn, owner="w1", jobs=[first], now=at(30)) == {first.id}
    # then one of the key's rows, and only one: the refresh row, served least of its kind
    [job] = queue.claim(conn, owner="w2", limit=5, lease_seconds=LEASE, now=at(62))
    assert job.id == refresh


def test_the_database_refuses_a_second_lease_of_a_key(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1")
    job = claim_one(conn, "w1")
    other = put(conn, cfg, "T-1", kind="refresh")
    with pytest.raises(sa.exc.IntegrityError, match=LEASED_KEY_INDEX):
        conn.execute(
            sa.text(
                "UPDATE enrichq.queue SET state = 'leased', lease_owner = 'w2',"
                " lease_expires_at = now() WHERE id = :id"
            ),
            {"id": other},
        )
    assert job.key == "T-1"


def test_a_ticket_queued_in_both_kinds_is_claimed_once(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1", delay_seconds=0)
    put(conn, cfg, "T-1", kind="refresh", delay_seconds=1)
    jobs = queue.claim(conn, owner="w1", limit=5, lease_seconds=LEASE, now=at(5))
    assert [(j.key, j.kind) for j in jobs] == [("T-1", "enrich")]


# -- heartbeat


def test_heartbeat_extends_held_leases_and_reports_lost_ones(
    conn: sa.Connection, cfg: Settings
) -> None:
    put(conn, cfg, "T-1")
    put(conn, cfg, "T-2")
    a, b = queue.claim(conn, kinds=("enrich",), owner="w1", limit=2, lease_seconds=LEASE, now=T0)
    lost = queue.heartbeat(conn, owner="w1", jobs=[a, b], lease_seconds=LEASE, now=at(30))
    assert lost == set()
    assert row(conn, a.id).lease_expires_at == at(90)
    # b's lease is taken over (expired and re-leased elsewhere): heartbeat reports it lost
    conn.execute(
        sa.text("UPDATE enrichq.queue SET lease_owner = 'w2' WHERE id = :id"), {"id": b.id}
    )
    assert queue.heartbeat(conn, owner="w1", jobs=[a, b], lease_seconds=LEASE, now=at(40)) == {b.id}
    # an expired lease is lost too
    assert queue.heartbeat(conn, owner="w1", jobs=[a], lease_seconds=LEASE, now=at(200)) == {a.id}


def test_leases_not_held_are_the_owners_live_leases_it_does_not_know(
    conn: sa.Connection, cfg: Settings
) -> None:
    for key in ("T-1", "T-2", "T-3", "T-4", "T-5"):
        put(conn, cfg, key)
    known, unheard, expiring, let_go = queue.claim(
        conn, kinds=("enrich",), owner="w1", limit=4, lease_seconds=LEASE, now=T0
    )
    other = claim_one(conn, owner="w2")
    conn.execute(
        sa.text("UPDATE enrichq.queue SET lease_expires_at = :t WHERE id = :id"),
        {"t": at(10), "id": expiring.id},
    )
    queue.heartbeat(conn, owner="w1", jobs=[let_go], lease_seconds=LEASE, now=at(5))
    # w1 holds `known`; `unheard` it never heard of; `expiring`'s lease has run out by then;
    # `let_go` it heartbeated, so heard of (and then let go); `other` is w2's
    found = queue.leases_not_held(conn, owner="w1", held_ids=[known.id], now=at(20))
    assert [(j.id, j.claim_token, j.attempts) for j in found] == [
        (unheard.id, unheard.claim_token, 1)
    ]
    assert other.id not in {j.id for j in found}
    # given back as a deferral: queued again with the claim's attempt returned
    assert queue.defer(conn, owner="w1", deferrals=[(found[0], None)], now=at(20)) == {unheard.id}
    again = row(conn, unheard.id)
    assert (again.state, again.attempts, again.lease_owner) == ("queued", 0, None)


# -- complete / fenced refusals


def test_complete_marks_done(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1")
    job = claim_one(conn)
    assert queue.complete(conn, owner="w1", jobs=[job], now=at(1)) == {job.id}
    r = row(conn, job.id)
    assert (r.state, r.lease_owner, r.finished_at) == ("done", None, at(1))


@pytest.mark.parametrize("refusal", ["wrong_owner", "stale_token", "expired", "wrong_state"])
def test_every_fenced_write_refuses_a_job_it_does_not_hold(
    conn: sa.Connection, cfg: Settings, refusal: str
) -> None:
    put(conn, cfg, "T-1")
    job = claim_one(conn, "w1")
    owner, now = "w1", at(1)
    if refusal == "wrong_owner":
        owner = "w2"
    elif refusal == "stale_token":
        job = dataclasses.replace(job, claim_token=uuid.uuid4())
    elif refusal == "expired":
        now = at(61)
    else:
        queue.complete(conn, owner="w1", jobs=[job], now=at(1))
    before = row(conn, job.id)
    assert queue.complete(conn, owner=owner, jobs=[job], now=now) == set()
    assert queue.fail(conn, owner=owner, failures=[(job, "x")], now=now) == set()
    assert (
        queue.retry(
            conn,
            owner=owner,
            failures=[(job, "x")],
            backoff_base_seconds=5,
            backoff_cap_seconds=300,
            now=now,
        )
        == {}
    )
    assert queue.defer(conn, owner=owner, deferrals=[(job, None)], now=now) == set()
    assert queue.heartbeat(conn, owner=owner, jobs=[job], lease_seconds=LEASE, now=now) == {job.id}
    assert row(conn, job.id) == before


# -- the claim token: new at every claim, so an older attempt of the same owner is refused


def _claim_again_after(conn: sa.Connection, cfg: Settings, path: str) -> tuple[Job, Job]:
    """The same owner holds a row twice: (the older attempt, the newer one)."""
    put(conn, cfg, "T-1")
    if path == "undone":
        # a claim that a server crash undid (the claim engine commits asynchronously)
        savepoint = conn.begin_nested()
        old = claim_one(conn, "w1", now=0)
        savepoint.rollback()
        return old, claim_one(conn, "w1", now=1)
    old = claim_one(conn, "w1", now=0)
    if path == "defer":
        assert queue.defer(conn, owner="w1", deferrals=[(old, None)], now=at(1)) == {old.id}
    else:  # redrive: the attempts are reset
        conn.execute(
            sa.text("UPDATE enrichq.queue SET max_attempts = 1 WHERE id = :i"), {"i": old.id}
        )
        old = dataclasses.replace(old, max_attempts=1)
        won = queue.retry(
            conn,
            owner="w1",
            failures=[(old, "boom")],
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
            now=at(1),
        )
        assert won == {old.id: Outcome.DEAD_LETTER}
        redrive = Filter.build(Scope.DEAD, ids=[old.id])
        picked = controls.select(conn, redrive, now=at(1))
        done = controls.redrive_batch(conn, redrive, picked.ids, picked.winners, now=at(1))
        assert done["redriven"] == 1
    new = claim_one(conn, "w1", now=2)
    assert (new.id, new.attempts) == (old.id, old.attempts)  # what the old fence matched on
    return old, new


@pytest.mark.parametrize("path", ["defer", "redrive", "undone"])
def test_an_older_attempt_of_the_same_owner_is_refused(
    conn: sa.Connection, cfg: Settings, path: str
) -> None:
    old, new = _claim_again_after(conn, cfg, path)
    assert new.claim_token != old.claim_token
    assert queue.heartbeat(conn, owner="w1", jobs=[old], lease_seconds=LEASE, now=at(3)) == {old.id}
    assert queue.complete(conn, owner="w1", jobs=[old], now=at(3)) == set()
    assert queue.fail(conn, owner="w1", failures=[(old, "x")], now=at(3)) == set()
    assert row(conn, new.id).state == "leased"
    assert queue.complete(conn, owner="w1", jobs=[new], now=at(4)) == {new.id}
    assert row(conn, new.id).state == "done"


# -- retry


def test_retry_requeues_with_capped_jittered_backoff(conn: sa.Connection) -> None:
    cfg = make_settings(max_attempts=10)
    put(conn, cfg, "T-1")
    for attempt in range(1, 8):
        claim_at = 10_000 * attempt
        job = claim_one(conn, now=claim_at)
        assert job.attempts == attempt
        won = queue.retry(
            conn,
            owner="w1",
            failures=[(job, f"boom {attempt}")],
            backoff_base_seconds=5,
            backoff_cap_seconds=300,
            now=at(claim_at),
        )
        assert won == {job.id: Outcome.RETRY}
        r = row(conn, job.id)
        assert (r.state, r.last_error, r.lease_owner) == ("queued", f"boom {attempt}", None)
        full = min(300, 5 * 2**attempt)
        delay = (r.visible_at - at(claim_at)).total_seconds()
        assert full / 2 <= delay <= full


@pytest.mark.parametrize(("drawn", "share"), [(0.0, 0.5), (0.5, 0.75)])
def test_the_settle_statement_waits_the_backoff_python_computed(
    conn: sa.Connection, drawn: float, share: float
) -> None:
    cfg = make_settings(max_attempts=10)
    put(conn, cfg, "T-1")
    for attempt in range(1, 4):
        claim_at = 10_000 * attempt
        job = claim_one(conn, now=claim_at)
        won = queue.settle(
            conn,
            owner="w1",
            settles=[queue.Settle(job, queue.SettleAction.RETRY, error="boom")],
            backoff_base_seconds=5,
            backoff_cap_seconds=300,
            now=at(claim_at),
            draw=lambda: drawn,
        )
        assert won == {job.id: Outcome.RETRY}
        delay = (row(conn, job.id).visible_at - at(claim_at)).total_seconds()
        assert delay == 5 * 2**attempt * share


def test_retry_on_the_last_attempt_dead_letters(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1")
    for attempt in range(1, 4):
        job = claim_one(conn, now=1000 * attempt)
        won = queue.retry(
            conn,
            owner="w1",
            failures=[(job, "boom")],
            backoff_base_seconds=0,
            backoff_cap_seconds=0,
            now=at(1000 * attempt),
        )
    assert won == {job.id: Outcome.DEAD_LETTER}
    r = row(conn, job.id)
    assert (r.state, r.dead_reason, r.attempts, r.last_error) == (
        "dead_letter",
        "attempts_exhausted",
        3,
        "boom",
    )


def test_retry_supersedes_when_the_key_is_queued_again(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1")
    job = claim_one(conn)
    newer = put(conn, cfg, "T-1")
    won = queue.retry(
        conn,
        owner="w1",
        failures=[(job, "boom")],
        backoff_base_seconds=5,
        backoff_cap_seconds=300,
        now=at(1),
    )
    assert won == {job.id: Outcome.DEAD_LETTER}
    r = row(conn, job.id)
    assert (r.state, r.dead_reason, r.superseded_by) == ("dead_letter", "superseded", newer)


# -- fail, defer


def test_fail_is_terminal_and_keeps_the_error(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1")
    job = claim_one(conn)
    assert queue.fail(conn, owner="w1", failures=[(job, "unknown kind")], now=at(1)) == {job.id}
    r = row(conn, job.id)
    assert (r.state, r.last_error, r.finished_at) == ("failed", "unknown kind", at(1))


def test_defer_gives_the_attempt_back(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1")
    job = claim_one(conn)
    until = at(3600)
    assert queue.defer(conn, owner="w1", deferrals=[(job, until)], now=at(1)) == {job.id}
    r = row(conn, job.id)
    assert (r.state, r.attempts, r.visible_at, r.lease_owner) == ("queued", 0, until, None)


def test_defer_supersedes_when_the_key_is_queued_again(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "T-1")
    job = claim_one(conn)
    newer = put(conn, cfg, "T-1")
    assert queue.defer(conn, owner="w1", deferrals=[(job, None)], now=at(1)) == {job.id}
    r = row(conn, job.id)
    assert (r.state, r.superseded_by) == ("dead_letter", newer)


# -- fairness


def test_claim_order_priority_then_least_served_tenant_then_oldest(
    conn: sa.Connection, cfg: Settings
) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.tenants (tenant, plan, priority) VALUES "
            "('big', 'standard', 1), ('small', 'standard', 1), ('vip', 'priority', 2), "
            "('cheap', 'free', 0)"
        )
    )
    for i in range(5):
        put(conn, cfg, f"big-{i}", tenant="big", delay_seconds=0)
    put(conn, cfg, "small-0", tenant="small", delay_seconds=1)
    put(conn, cfg, "cheap-0", tenant="cheap", delay_seconds=0)
    put(conn, cfg, "none-0", delay_seconds=2)  # ownerless: the middle plan
    put(conn, cfg, "vip-0", tenant="vip", delay_seconds=3)

    order = [claim_one(conn, "w", now=10 + n).key for n in range(9)]
    assert order == [
        "vip-0",  # the top plan first, though its row is the youngest
        "big-0",  # standard plan, nobody served yet: the oldest visible row
        "small-0",  # big has been served once, small not yet
        "none-0",  # ownerless work counts as the middle plan, not the bottom one
        "big-1",
        "big-2",
        "big-3",
        "big-4",
        "cheap-0",  # the free plan waits until the standard plan's work is claimed
    ]


def test_fair_claims_alternate_between_tenants_of_one_plan(
    conn: sa.Connection, cfg: Settings
) -> None:
    for i in range(6):
        put(conn, cfg, f"big-{i}", tenant="big", delay_seconds=0)
    for i in range(2):
        put(conn, cfg, f"small-{i}", tenant="small", delay_seconds=5)
    order = [claim_one(conn, "w", now=10 + n).key for n in range(6)]
    # big was first (oldest, both unserved), then small is least served, and so on: the
    # small tenant is not starved behind big's older backlog
    assert order[:4] == ["big-0", "small-0", "big-1", "small-1"]
    assert order[4:] == ["big-2", "big-3"]


def test_in_flight_work_counts_as_served(conn: sa.Connection, cfg: Settings) -> None:
    put(conn, cfg, "a-0", tenant="a", delay_seconds=0)
    put(conn, cfg, "a-1", tenant="a", delay_seconds=0)
    put(conn, cfg, "b-0", tenant="b", delay_seconds=1)
    first = claim_one(conn, "w", now=5)  # a-0, still leased
    second = claim_one(conn, "w", now=6)
    assert (first.key, second.key) == ("a-0", "b-0")


def test_refresh_is_not_served_only_after_every_enrich_row(
    conn: sa.Connection, cfg: Settings
) -> None:
    """Ownerless maintenance work counts as the middle plan across kinds: a free-plan enrich
    backlog waits behind it, and a standard-plan backlog takes turns with it."""
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.tenants (tenant, plan, priority)"
            " VALUES ('cheap', 'free', 0), ('plain', 'standard', 1)"
        )
    )
    for i in range(20):
        put(conn, cfg, f"cheap-{i}", tenant="cheap", delay_seconds=0)
    put(conn, cfg, "maint-0", kind="refresh", delay_seconds=5)
    put(conn, cfg, "maint-1", kind="refresh", delay_seconds=5)
    first = claim_one(conn, "w", now=10)
    assert (first.kind, first.key) == ("refresh", "maint-0")  # before the older free backlog
    for i in range(3):
        put(conn, cfg, f"plain-{i}", tenant="plain", delay_seconds=0)
    order = [(j.kind, j.key) for j in (claim_one(conn, "w", now=20 + n) for n in range(4))]
    # plain (served least) first; then both served once, the older row; then refresh's turn
    assert order == [
        ("enrich", "plain-0"),
        ("enrich", "plain-1"),
        ("refresh", "maint-1"),
        ("enrich", "plain-2"),
    ]


@pytest.mark.parametrize(
    ("aging_seconds", "starves"), [(60.0, False), (1e9, True)], ids=["aging", "no-aging"]
)
def test_a_sustained_higher_plan_backlog_never_starves_a_free_ticket(
    conn: sa.Connection, cfg: Settings, aging_seconds: float, starves: bool
) -> None:
    """A priority-plan ticket becomes visible every 10 s and the claims take one every 10 s,
    so the priority plan always has fresh visible work. The free ticket rises one plan level
    per `aging_seconds` it waits, so it is claimed within (levels times aging); with
    aging out of reach (the control) it waits as long as the backlog lasts."""
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.tenants (tenant, plan, priority)"
            " VALUES ('vip', 'priority', 2), ('cheap', 'free', 0)"
        )
    )
    put(conn, cfg, "cheap-0", tenant="cheap", delay_seconds=0)
    bound = len(Plan) * 60.0
    served_after = None
    for step in range(int(2 * bound / 10)):
        now = step * 10.0
        put(conn, cfg, f"vip-{step}", tenant="vip", delay_seconds=now)
        [job] = queue.claim(
            conn,
            owner="w",
            limit=1,
            lease_seconds=LEASE,
            aging_seconds=aging_seconds,
            now=at(now + 0.5),
        )
        if job.key == "cheap-0":
            served_after = now + 0.5
            break
    if starves:
        assert served_after is None
    else:
        assert served_after is not None
        assert served_after <= bound, f"the free ticket waited {served_after:.0f} s"


# -- a row belongs to its ticket's tenant, whatever its kind


def test_refresh_work_is_its_tickets_tenants_so_pause_and_cancel_see_it(
    conn: sa.Connection, cfg: Settings
) -> None:
    """The refresh schedule enqueues a stale ticket of acme with acme as its tenant (and
    acme's plan): with acme paused the claim leaves it alone, and `cancel --tenant acme
    --dry-run` selects it; an ownerless ticket's refresh stays ownerless."""
    from enrichq_service.controls import pauses
    from enrichq_service.seed import SQL as SEED_SQL
    from enrichq_sweeper import refresh

    conn.execute(SEED_SQL("seed_create_helpdesk"))
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.tenants (tenant, plan, priority) VALUES ('acme', 'priority', 2)"
        )
    )
    for key, tenant in (("A-1", "acme"), ("N-1", None)):
        conn.execute(
            sa.text(
                "INSERT INTO helpdesk.tickets (id, requester_email, tenant, created_at, updated_at)"
                " VALUES (:id, 'a@example.com', :tenant, :at, :at)"
            ),
            {"id": key, "tenant": tenant, "at": at(-3600)},
        )
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_enrichments (ticket_id, enriched_at, order_count,"
                " queue_id) VALUES (:id, :at, 0, 1)"
            ),
            {"id": key, "at": at(-2 * 86_400)},
        )
    page = refresh.enqueue_page(conn, cfg, now=at(0))
    assert page.inserted == 2
    rows = {
        r.key: (r.tenant, r.priority)
        for r in conn.execute(sa.text("SELECT key, tenant, priority FROM enrichq.queue"))
    }
    assert rows == {"A-1": ("acme", 2), "N-1": (None, 1)}

    pauses.pause(conn, pauses.PauseScope.build(kind=None, tenant="acme"), actor="ops", now=at(0))
    with conn.begin_nested() as sp:
        claimed = queue.claim(conn, owner="w", limit=10, lease_seconds=LEASE, now=at(1))
        sp.rollback()
    assert [j.key for j in claimed] == ["N-1"]

    selected = controls.select(conn, Filter.build(Scope.OPEN, tenant="acme"), now=at(1))
    assert [row(conn, i).key for i in selected.ids] == ["A-1"]


def test_a_growing_higher_plan_backlog_never_starves_a_free_ticket(
    conn: sa.Connection, cfg: Settings
) -> None:
    """Overload: the priority plan's backlog has been growing for ten minutes and keeps
    growing (3 rows a second arrive, the claims take 2), so its oldest row ages as fast as
    the free ticket. The free ticket still waits at most about (plan levels x aging): it
    meets the backlog at the top level, and there the least-served tenant goes first."""
    aging = 60.0
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.tenants (tenant, plan, priority)"
            " VALUES ('vip', 'priority', 2), ('cheap', 'free', 0)"
        )
    )
    old = [EnqueueRequest.build(key=f"vip-old-{i}", tenant="vip") for i in range(1000)]
    queue.enqueue(conn, old, settings=cfg, now=at(-600))  # the backlog so far, unserved
    put(conn, cfg, "cheap-0", tenant="cheap", delay_seconds=0)
    bound = len(Plan) * aging
    served_after = None
    for second in range(int(2 * bound)):
        for n in range(3):
            put(conn, cfg, f"vip-{second}-{n}", tenant="vip", delay_seconds=second)
        jobs = queue.claim(
            conn, owner="w", limit=2, lease_seconds=LEASE, aging_seconds=aging, now=at(second)
        )
        if "cheap-0" in {j.key for j in jobs}:
            served_after = float(second)
            break
    backlog = conn.execute(
        sa.text("SELECT count(*) FROM enrichq.queue WHERE state = 'queued' AND tenant = 'vip'")
    ).scalar_one()
    assert backlog > 1000  # it grew while the free ticket waited
    assert served_after is not None, f"the free ticket waited over {2 * bound:.0f} s"
    assert served_after <= bound, f"the free ticket waited {served_after:.0f} s"
