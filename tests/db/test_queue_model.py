"""Model-based test of the queue: random steps against Postgres and a plain model of DESIGN §3.

A hypothesis state machine enqueues, claims, heartbeats, settles (complete, retry, fail,
defer) and moves the clock, on a few keys with a few owners, committing after every
step. A small Python model of §3 predicts every answer (inserted or merged, which rows
a claim may take, which fenced writes win) and every row; after each step the database
must equal the model and the invariants must hold whatever the model says.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar
from uuid import UUID

import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tests.support.pg import Databases
from tests.support.settings import make_settings

from enrichq_schema.db import create_engine
from enrichq_schema.settings import Settings
from enrichq_schema.states import Outcome
from enrichq_service import queue
from enrichq_service.queue import EnqueueRequest, Job

T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
LEASE = 60.0
BACKOFF_BASE = 2.0
BACKOFF_CAP = 6.0
KEYS = ("K1", "K2", "K3")
# enrich twice: most work is of one kind; refresh rows share keys and so the live-lease rule
KINDS = ("enrich", "enrich", "refresh")
OWNERS = ("w1", "w2")
TERMINAL = {"done", "failed", "dead_letter"}
# the clock moves by these steps: inside a lease, just under and over it, past every backoff
ADVANCES = (1, 10, 30, 59, 61, 200, 700)
MICROSECOND = timedelta(microseconds=1)

COLUMNS = (
    "id, kind, key, state, visible_at, attempts, max_attempts, lease_owner, lease_expires_at,"
    " heartbeat_at, last_error, dead_reason, superseded_by, finished_at, claim_token"
)


@dataclass
class Row:
    """The model's copy of one queue row (the columns DESIGN §3 gives meaning to)."""

    id: int
    kind: str
    key: str
    state: str
    visible_at: datetime
    attempts: int
    max_attempts: int
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    heartbeat_at: datetime | None = None
    last_error: str | None = None
    dead_reason: str | None = None
    superseded_by: int | None = None
    finished_at: datetime | None = None
    claim_token: UUID | None = None  # random, so the model learns it from the claim's answer

    def as_tuple(self) -> tuple[Any, ...]:
        return dataclasses.astuple(self)

    def release(self) -> None:
        self.lease_owner = self.lease_expires_at = self.heartbeat_at = None


class Model:
    """DESIGN §3 in plain Python: a clock and the rows."""

    def __init__(self) -> None:
        self.now = T0
        self.rows: dict[int, Row] = {}

    def queued(self, kind: str, key: str) -> Row | None:
        found = [r for r in self.rows.values() if (r.state, r.kind, r.key) == ("queued", kind, key)]
        assert len(found) <= 1
        return found[0] if found else None

    def leased_keys(self) -> set[str]:
        """Keys with a lease, live or expired: one lease per ticket until the sweeper."""
        return {r.key for r in self.rows.values() if r.state == "leased"}

    def claimable(self, kind: str) -> list[Row]:
        """Visible queued rows of `kind` whose key has no lease (of any kind)."""
        busy = self.leased_keys()
        return [
            r
            for r in self.rows.values()
            if r.state == "queued"
            and r.kind == kind
            and r.visible_at <= self.now
            and r.key not in busy
        ]

    def holds(self, job: Job, owner: str) -> bool:
        """The fence: id, owner, the claim's token, state leased and a live lease."""
        row = self.rows[job.id]
        return (
            row.state == "leased"
            and row.lease_owner == owner
            and row.claim_token == job.claim_token
            and row.lease_expires_at is not None
            and row.lease_expires_at > self.now
        )

    def winners(self, jobs: list[Job], owner: str) -> list[Row]:
        won = {j.id for j in jobs if self.holds(j, owner)}
        return [self.rows[i] for i in sorted(won)]

    def finish(self, row: Row, state: str) -> None:
        row.state = state
        row.finished_at = self.now
        row.release()


class QueueMachine(RuleBasedStateMachine):
    """Drives the queue API and the model side by side; one committed transaction a step."""

    engine: ClassVar[sa.Engine]  # set by the test on a subclass: hypothesis builds instances

    def __init__(self) -> None:
        super().__init__()
        self.conn = self.engine.connect()
        with self.tx() as conn:
            # durability is not under test here; a step's commit need not wait for the disk
            conn.execute(sa.text("SET synchronous_commit = off"))
            conn.execute(sa.text("TRUNCATE enrichq.queue, enrichq.tenant_served RESTART IDENTITY"))
        self.model = Model()
        self.cfg: dict[int, Settings] = {n: make_settings(max_attempts=n) for n in (2, 3)}
        # every job a claim handed out, with its owner: settles draw from these, stale or not
        self.handles: list[tuple[str, Job]] = []
        self.terminal: dict[int, tuple[Any, ...]] = {}

    @contextmanager
    def tx(self) -> Iterator[sa.Connection]:
        with self.conn.begin():
            yield self.conn

    def teardown(self) -> None:
        self.conn.close()

    # -- steps

    @initialize(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=len(KEYS), unique=True))
    def start_with_work(self, keys: list[str]) -> None:
        """Every run starts with some visible work, so claims have something to race for."""
        self.enqueue([("enrich", key, 0) for key in keys], 3)

    @rule(
        requests=st.lists(
            st.tuples(
                st.sampled_from(KINDS), st.sampled_from(KEYS), st.sampled_from((0, 0, 0, 20))
            ),
            min_size=1,
            max_size=3,
        ),
        max_attempts=st.sampled_from((2, 3)),
    )
    def enqueue(self, requests: list[tuple[str, str, int]], max_attempts: int) -> None:
        batch = [
            EnqueueRequest.build(kind=kind, key=key, delay_seconds=delay)
            for kind, key, delay in requests
        ]
        with self.tx() as conn:
            results = queue.enqueue(
                conn, batch, settings=self.cfg[max_attempts], now=self.model.now
            )
        assert [(r.kind, r.key) for r in results] == [(k, key) for k, key, _ in requests]
        touched: set[tuple[str, str]] = set()
        for (kind, key, delay), result in zip(requests, results, strict=True):
            existing = self.model.queued(kind, key)
            if existing is not None:
                assert (result.inserted, result.id) == (False, existing.id), "must merge"
                # a manual enqueue (these are) is visible when it says: merged into a later
                # row, it brings the row forward; a later input of the same ticket in one
                # statement merges into what the first did (queue_enqueue's `firsts`)
                if (kind, key) not in touched:
                    existing.visible_at = min(
                        existing.visible_at, self.model.now + timedelta(seconds=delay)
                    )
                touched.add((kind, key))
                continue
            touched.add((kind, key))
            assert result.inserted, f"{kind}/{key} has no queued row: must insert"
            assert result.id is not None
            assert result.id not in self.model.rows
            self.model.rows[result.id] = Row(
                id=result.id,
                kind=kind,
                key=key,
                state="queued",
                visible_at=self.model.now + timedelta(seconds=delay),
                attempts=0,
                max_attempts=max_attempts,
            )

    @rule(owner=st.sampled_from(OWNERS), kind=st.sampled_from(KINDS), limit=st.integers(1, 3))
    def claim(self, owner: str, kind: str, limit: int) -> None:
        eligible = self.model.claimable(kind)
        with self.tx() as conn:
            jobs = queue.claim(
                conn,
                kinds=(kind,),
                owner=owner,
                limit=limit,
                lease_seconds=LEASE,
                now=self.model.now,
            )
        taken = {j.id for j in jobs}
        assert len(jobs) == len(taken) == min(limit, len(eligible))
        assert taken <= {r.id for r in eligible}, "claimed a row that is not claimable"
        left = [r.visible_at for r in eligible if r.id not in taken]
        if jobs and left:
            # oldest visible first (ties may go either way)
            assert max(self.model.rows[i].visible_at for i in taken) <= min(left)
        for job in jobs:
            row = self.model.rows[job.id]
            row.state = "leased"
            row.attempts += 1
            row.lease_owner = owner
            row.lease_expires_at = self.model.now + timedelta(seconds=LEASE)
            row.heartbeat_at = self.model.now
            assert job.claim_token not in {r.claim_token for r in self.model.rows.values()}
            row.claim_token = job.claim_token
            assert (job.kind, job.key, job.attempts, job.max_attempts) == (
                row.kind,
                row.key,
                row.attempts,
                row.max_attempts,
            )
            assert job.lease_expires_at == row.lease_expires_at
            self.handles.append((owner, job))

    def _pick(self, data: st.DataObject) -> tuple[str, list[Job]]:
        """An owner and some jobs: mostly ones it still holds, else its latest, else anybody's."""
        held = [(o, j) for o, j in self.handles if self.model.holds(j, o)]
        mode = data.draw(st.sampled_from(("held", "held", "recent", "stale", "any")), label="mode")
        if mode in ("held", "stale") and held:
            owner = data.draw(st.sampled_from(sorted({o for o, _ in held})), label="owner")
            pool = [j for o, j in held if o == owner]
            if mode == "stale":
                # the owner's job as an older claim of the same row would carry it: same id,
                # same owner, maybe the same attempt number; only the claim token differs
                pool = [dataclasses.replace(j, claim_token=uuid.uuid4()) for j in pool]
        elif mode != "any":
            owner = data.draw(st.sampled_from(sorted({o for o, _ in self.handles})), label="owner")
            pool = [j for o, j in self.handles if o == owner][-4:]
        else:
            owner = data.draw(st.sampled_from(OWNERS), label="owner")
            pool = [j for _, j in self.handles]
        picked = data.draw(
            st.lists(
                st.sampled_from(pool),
                min_size=1,
                max_size=3,
                unique_by=lambda j: (j.id, j.claim_token),
            ),
            label="jobs",
        )
        return owner, picked

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        owner, jobs = self._pick(data)
        extended = self.model.winners(jobs, owner)
        with self.tx() as conn:
            lost = queue.heartbeat(
                conn, owner=owner, jobs=jobs, lease_seconds=LEASE, now=self.model.now
            )
        assert lost == {j.id for j in jobs} - {r.id for r in extended}
        for row in extended:
            row.lease_expires_at = self.model.now + timedelta(seconds=LEASE)
            row.heartbeat_at = self.model.now

    @precondition(lambda self: self.handles)
    @rule(
        data=st.data(),
        outcome=st.sampled_from(("complete", "retry", "fail", "retry", "defer")),
        until=st.sampled_from((None, 30, -10)),
    )
    def settle(self, data: st.DataObject, outcome: str, until: int | None) -> None:
        """A handler finished: done, permanent error, transient error, or not yet (until)."""
        owner, jobs = self._pick(data)
        if outcome == "complete":
            self._complete(owner, jobs)
        elif outcome == "fail":
            self._fail(owner, jobs)
        elif outcome == "retry":
            self._retry(owner, jobs)
        else:
            self._defer(owner, jobs, until)

    def _complete(self, owner: str, jobs: list[Job]) -> None:
        expected = self.model.winners(jobs, owner)
        with self.tx() as conn:
            won = queue.complete(conn, owner=owner, jobs=jobs, now=self.model.now)
        assert won == {r.id for r in expected}
        for row in expected:
            self.model.finish(row, "done")

    def _fail(self, owner: str, jobs: list[Job]) -> None:
        expected = self.model.winners(jobs, owner)
        with self.tx() as conn:
            won = queue.fail(
                conn, owner=owner, failures=[(j, f"bad {j.id}") for j in jobs], now=self.model.now
            )
        assert won == {r.id for r in expected}
        for row in expected:
            self.model.finish(row, "failed")
            row.last_error = f"bad {row.id}"

    def _retry(self, owner: str, jobs: list[Job]) -> None:
        expected = self.model.winners(jobs, owner)
        now = self.model.now
        with self.tx() as conn:
            won = queue.retry(
                conn,
                owner=owner,
                failures=[(j, f"flaky {j.id}") for j in jobs],
                backoff_base_seconds=BACKOFF_BASE,
                backoff_cap_seconds=BACKOFF_CAP,
                now=now,
            )
            visible = {
                r.id: r.visible_at
                for r in conn.execute(
                    sa.text("SELECT id, visible_at FROM enrichq.queue WHERE id = ANY(:ids)"),
                    {"ids": [r.id for r in expected]},
                )
            }
        outcomes: dict[int, Outcome] = {}
        for row in expected:
            queued = self.model.queued(row.kind, row.key)
            row.last_error = f"flaky {row.id}"
            if row.attempts >= row.max_attempts:
                outcomes[row.id] = Outcome.DEAD_LETTER
                self.model.finish(row, "dead_letter")
                row.dead_reason = "attempts_exhausted"
            elif queued is not None:
                outcomes[row.id] = Outcome.DEAD_LETTER
                self.model.finish(row, "dead_letter")
                row.dead_reason, row.superseded_by = "superseded", queued.id
            else:
                outcomes[row.id] = Outcome.RETRY
                row.state = "queued"
                row.release()
                # backoff with half-to-full jitter: the worker draws it, the model bounds it
                full = timedelta(seconds=min(BACKOFF_CAP, BACKOFF_BASE * 2**row.attempts))
                assert now + full / 2 - MICROSECOND <= visible[row.id] <= now + full + MICROSECOND
                row.visible_at = visible[row.id]
        assert won == outcomes

    def _defer(self, owner: str, jobs: list[Job], until: int | None) -> None:
        expected = self.model.winners(jobs, owner)
        now = self.model.now
        until_at = None if until is None else now + timedelta(seconds=until)
        with self.tx() as conn:
            won = queue.defer(conn, owner=owner, deferrals=[(j, until_at) for j in jobs], now=now)
        assert won == {r.id for r in expected}
        for row in expected:
            queued = self.model.queued(row.kind, row.key)
            row.attempts = max(row.attempts - 1, 0)  # the claim's attempt is given back
            if queued is not None:
                self.model.finish(row, "dead_letter")
                row.dead_reason, row.superseded_by = "superseded", queued.id
            else:
                row.state = "queued"
                row.visible_at = max(until_at or now, now)
                row.release()

    @rule(seconds=st.sampled_from(ADVANCES))
    def advance(self, seconds: int) -> None:
        self.model.now += timedelta(seconds=seconds)

    # -- after every step

    @invariant()
    def database_equals_model_and_invariants_hold(self) -> None:
        with self.tx() as conn:
            rows = conn.execute(sa.text(f"SELECT {COLUMNS} FROM enrichq.queue ORDER BY id")).all()
        assert [tuple(r) for r in rows] == [
            self.model.rows[i].as_tuple() for i in sorted(self.model.rows)
        ]
        queued = [(r.kind, r.key) for r in rows if r.state == "queued"]
        assert len(queued) == len(set(queued)), "two queued rows for one (kind, key)"
        leased = [r.key for r in rows if r.state == "leased"]
        assert len(leased) == len(set(leased)), "two leases on one key"
        assert all(0 <= r.attempts <= r.max_attempts for r in rows)
        by_id = {r.id: tuple(r) for r in rows}
        for row_id, frozen in self.terminal.items():
            assert by_id.get(row_id) == frozen, f"terminal row {row_id} changed"
        self.terminal.update({r.id: tuple(r) for r in rows if r.state in TERMINAL})


def test_queue_agrees_with_the_model(databases: Databases) -> None:
    url = databases.clone("model")
    engine = create_engine(url, pool_size=1)

    class OnThisDatabase(QueueMachine):
        pass

    OnThisDatabase.engine = engine
    try:
        run_state_machine_as_test(
            OnThisDatabase,
            settings=settings(
                max_examples=100,
                stateful_step_count=30,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        engine.dispose()
        databases.drop(url)
