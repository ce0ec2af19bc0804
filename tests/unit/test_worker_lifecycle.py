"""The held job's state machine: every (phase, event) pair, and the registry under random
interleavings of the runtime's threads (a hypothesis state machine)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
from datetime import UTC, datetime

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from enrichq_service.queue import Job
from enrichq_service.worker.lifecycle import (
    IGNORED,
    MOVES,
    Held,
    IllegalTransition,
    JobEvent,
    Jobs,
    Phase,
    transition,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def held(n: int, deadline: float = float("inf")) -> Held:
    job = Job(n, "enrich", f"T-{n}", None, "manual", {}, 1, 5, uuid.uuid4(), T0, T0)
    return Held(job, None, deadline)


# -- the transition function, exhaustively


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, JobEvent)))
def test_every_pair_moves_is_ignored_or_is_illegal(phase: Phase, event: JobEvent) -> None:
    assert not ((phase, event) in MOVES and (phase, event) in IGNORED)
    if (phase, event) in MOVES:
        assert transition(phase, event) is MOVES[(phase, event)]
    elif (phase, event) in IGNORED:
        assert transition(phase, event) is phase
    else:
        with pytest.raises(IllegalTransition):
            transition(phase, event)


def test_the_terminal_phases_never_move_again() -> None:
    for phase, event in itertools.product((Phase.SETTLED, Phase.LOST), JobEvent):
        if (phase, event) in IGNORED:
            assert transition(phase, event) is phase
        else:
            with pytest.raises(IllegalTransition):
                transition(phase, event)


def test_only_a_claimed_job_starts() -> None:
    starts = {p for p in Phase if MOVES.get((p, JobEvent.START)) is Phase.STARTED}
    assert starts == {Phase.CLAIMED}
    for phase in (Phase.LOST, Phase.ABANDONED, Phase.SETTLING):
        assert transition(phase, JobEvent.START) is phase  # a job let go never starts


def test_a_job_handed_to_the_settler_is_never_lost() -> None:
    for phase in (Phase.SETTLING, Phase.SETTLED):
        assert transition(phase, JobEvent.LOSE) is phase


# -- the registry


def test_an_overdue_job_that_never_started_is_deferred_and_never_starts() -> None:
    jobs = Jobs()
    a = held(1, deadline=0)
    jobs.add([a])
    never, running = jobs.overdue(time.monotonic())
    assert (never, running) == ([a], [])
    assert a.phase is Phase.SETTLING
    assert jobs.start([a], now=0.0, run_seconds=60.0) == []


def test_a_job_whose_deadline_passed_before_it_started_never_starts() -> None:
    """Admitted (a slot, after a database outage) once its deadline had passed, but before
    the claim loop, busy retrying claims, saw it overdue: it never starts, and is then
    deferred with its attempt given back. (It started, ran, and was abandoned as past its
    deadline: 'attempt deadline exceeded', an attempt spent on time it spent waiting; the
    fault harness's seed 9005 dead-lettered a ticket so, in place of its own error.)"""
    jobs = Jobs()
    a = held(1, deadline=10.0)
    jobs.add([a])
    assert jobs.start([a], now=10.0, run_seconds=60.0) == []
    assert a.phase is Phase.CLAIMED
    never, running = jobs.overdue(10.0)
    assert (never, running) == ([a], [])
    b = held(2, deadline=10.0)
    jobs.add([b])
    assert jobs.start([b], now=9.5, run_seconds=60.0) == [b]  # still its time: it starts


def test_a_started_job_has_its_whole_deadline_to_run() -> None:
    """The attempt deadline bounds running: a job that waited (for a warehouse slot) and
    started just before its claim's deadline may run a whole deadline from its start."""
    jobs = Jobs()
    a = held(1, deadline=10.0)
    jobs.add([a])
    assert jobs.start([a], now=9.5, run_seconds=1.0) == [a]
    assert jobs.overdue(10.0) == ([], [])
    assert jobs.overdue(10.5) == ([], [a])


def test_a_late_result_of_an_abandoned_attempt_is_not_settled() -> None:
    jobs = Jobs()
    a = held(1, deadline=1.0)
    jobs.add([a])
    assert jobs.start([a], now=0.0, run_seconds=1.0) == [a]
    cancelled: list[int] = []
    with jobs.interruptible([a], lambda: cancelled.append(1)):
        never, running = jobs.overdue(time.monotonic())
    assert (never, running) == ([], [a])
    assert a.cancelled.is_set()
    assert cancelled == [1]
    assert jobs.hand_off(a, finished=True) is False  # only its lookup is logged
    jobs.settled([a])
    assert len(jobs) == 0


def test_a_settle_that_commits_before_the_heartbeat_answers_is_not_lost() -> None:
    lost: list[int] = []
    jobs = Jobs(on_lost=lambda h: lost.append(h.id))
    a, b = held(1), held(2)
    jobs.add([a, b])
    jobs.start([a, b], now=0.0, run_seconds=60.0)
    beating = jobs.heartbeat_jobs()
    assert set(beating) == {a, b}
    assert jobs.hand_off(a, finished=True)  # a's settle goes (and commits) meanwhile
    jobs.lose(beating)  # the heartbeat's answer: neither lease was extended
    assert lost == [2]
    assert a.phase is Phase.SETTLING
    assert b.phase is Phase.LOST


def test_a_batch_is_interrupted_only_when_every_job_of_it_is_cancelled() -> None:
    jobs = Jobs()
    a, b = held(1), held(2)
    jobs.add([a, b])
    jobs.start([a, b], now=0.0, run_seconds=60.0)
    fired = threading.Event()
    with jobs.interruptible([a, b], fired.set):
        jobs.lose([a])
        assert not fired.is_set()
        jobs.lose([b])
        assert fired.is_set()


def test_oldest_unsettled_counts_from_the_hand_off() -> None:
    jobs = Jobs()
    a = held(1)
    jobs.add([a])
    assert jobs.oldest_unsettled_seconds() == 0
    jobs.start([a], now=0.0, run_seconds=60.0)
    jobs.hand_off(a, finished=True)
    assert a.handed_at is not None
    assert jobs.oldest_unsettled_seconds(a.handed_at + 7) == pytest.approx(7)


def test_a_lease_no_statement_confirmed_for_a_lease_is_given_up() -> None:
    """The lease watch: a job claimed (or last extended) more than a lease ago is lost and
    told to stop; one a later heartbeat confirmed, and one already settling, are not."""
    jobs = Jobs()
    claimed_at = 100.0
    stale, renewed, settling = (
        Held(held(n).job, None, float("inf"), claimed_at=claimed_at) for n in (1, 2, 3)
    )
    jobs.add([stale, renewed, settling])
    jobs.start([stale, renewed, settling], now=0.0, run_seconds=60.0)
    jobs.hand_off(settling, finished=True)
    jobs.confirm([renewed], claimed_at + 50)
    jobs.confirm([renewed], claimed_at + 10)  # an older heartbeat answering late: no step back
    assert renewed.confirmed == claimed_at + 50
    lease = 60.0
    assert jobs.unconfirmed_since(claimed_at + lease - 1 - lease) == []
    assert jobs.unconfirmed_since(claimed_at + lease + 1 - lease) == [stale]
    assert jobs.lose([stale]) == [stale]
    assert stale.cancelled.is_set()
    assert not renewed.cancelled.is_set()
    assert jobs.unconfirmed_since(claimed_at + 200) == [renewed]  # settling ones never


def reclaimed(old: Held) -> Held:
    """The same row claimed again: a new claim token."""
    job = dataclasses.replace(old.job, claim_token=uuid.uuid4(), attempts=old.job.attempts)
    return Held(job, None, float("inf"))


def test_a_stale_report_of_a_lost_lease_spares_the_rows_newer_claim() -> None:
    """The heartbeat's snapshot held the old claim; the row was deferred to now and claimed
    again before its statement answered. The old claim is what it reports lost."""
    lost: list[Held] = []
    jobs = Jobs(on_lost=lost.append)
    old = held(1)
    jobs.add([old])
    beating = jobs.heartbeat_jobs()
    assert jobs.hand_off(old, finished=False)  # deferred before it started
    jobs.settled([old])
    new = reclaimed(old)
    jobs.add([new])
    assert jobs.lose(beating) == []
    assert lost == []
    assert new.phase is Phase.CLAIMED
    assert jobs.heartbeat_jobs() == [new]


def test_the_old_claims_settle_leaves_the_rows_newer_claim_held() -> None:
    jobs = Jobs()
    old = held(1)
    jobs.add([old])
    assert jobs.hand_off(old, finished=False)
    new = reclaimed(old)
    jobs.add([new])  # claimed again after the defer committed, before the report
    jobs.settled([old])
    assert jobs.unsettled() == [new]
    assert jobs.heartbeat_jobs() == [new]


def test_a_job_refused_before_it_started_is_handed_over_once() -> None:
    """Refused admission (or a precheck) after the claim loop deferred it as overdue, or
    the heartbeat lost it: the settler already has it, or nobody may settle it."""
    jobs = Jobs()
    overdue, lost = held(1, deadline=0), held(2)
    jobs.add([overdue, lost])
    assert jobs.overdue(time.monotonic()) == ([overdue], [])
    assert overdue.cancelled.is_set()  # its wait for an admission ends
    jobs.lose([lost])
    assert jobs.hand_off(overdue, finished=False) is False
    assert jobs.hand_off(lost, finished=False) is False
    jobs.settled([overdue])
    assert jobs.hand_off(overdue, finished=False) is False


def test_a_claimed_job_is_confirmed_from_before_its_claim() -> None:
    before_claim = 5.0
    h = Held(held(1).job, None, float("inf"), claimed_at=9.0, lease_confirmed_at=before_claim)
    assert h.confirmed == before_claim
    assert Held(held(2).job, None, float("inf"), claimed_at=9.0).confirmed == 9.0


class RegistryMachine(RuleBasedStateMachine):
    """Random interleavings of what the claim loop, runner, settler and heartbeat do, with
    rows claimed again (a new claim of the same id) while an old claim is still reported
    on: by a heartbeat's stale snapshot, by the settler."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: list[Held] = []
        self.jobs = Jobs(on_lost=self.lost.append)
        self.all: list[Held] = []  # every claim, in claim order
        self.offered: set[int] = set()  # claims (by index) the runner took up, once each
        self.started: set[int] = set()
        self.returned: set[int] = set()  # a handler returns once
        self.handed: list[int] = []  # claims handed to the settler, each time
        self.named: set[int] = set()  # claims some heartbeat answer said were missing
        self.snapshots: list[list[Held]] = []
        self.next_id = 1

    def _index(self, h: Held) -> int:
        return next(i for i, c in enumerate(self.all) if c is h)

    @rule(n=st.integers(1, 3))
    def claim(self, n: int) -> None:
        new = [held(self.next_id + i, deadline=self.next_id + i) for i in range(n)]
        self.next_id += n
        self.jobs.add(new)
        self.all.extend(new)

    @precondition(lambda self: any(h.phase in (Phase.SETTLED, Phase.LOST) for h in self._latest()))
    @rule(data=st.data(), deadline=st.integers(0, 20))
    def claim_again(self, data: st.DataObject, deadline: int) -> None:
        """A row whose claim was let go (deferred to now, or taken by someone else and
        given back) is claimed by this process again."""
        gone = [h for h in self._latest() if h.phase in (Phase.SETTLED, Phase.LOST)]
        old = data.draw(st.sampled_from(gone))
        new = dataclasses.replace(reclaimed(old), deadline=float(deadline))
        self.jobs.add([new])
        self.all.append(new)

    def _latest(self) -> list[Held]:
        """The newest claim of each row."""
        latest: dict[int, Held] = {}
        for h in self.all:
            latest[h.id] = h
        return list(latest.values())

    def _unoffered(self) -> list[int]:
        return [i for i in range(len(self.all)) if i not in self.offered]

    @precondition(lambda self: self._unoffered())
    @rule(data=st.data(), at=st.integers(0, 20), run=st.integers(1, 20))
    def start(self, data: st.DataObject, at: int, run: int) -> None:
        i = data.draw(st.sampled_from(self._unoffered()))
        self.offered.add(i)
        deadline = self.all[i].deadline
        if self.jobs.start([self.all[i]], now=float(at), run_seconds=float(run)):
            assert i not in self.started, "a job started twice"
            assert deadline > at, "a job started past its deadline"
            assert self.all[i].deadline == at + run
            self.started.add(i)

    @precondition(lambda self: self._unoffered())
    @rule(data=st.data())
    def refuse(self, data: st.DataObject) -> None:
        """The runner refuses a job before starting it (a precheck, no admission)."""
        i = data.draw(st.sampled_from(self._unoffered()))
        self.offered.add(i)
        if self.jobs.hand_off(self.all[i], finished=False):
            self.handed.append(i)

    @precondition(lambda self: self.started - self.returned)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.started - self.returned)))
        self.returned.add(i)
        if self.jobs.hand_off(self.all[i], finished=True):
            self.handed.append(i)

    @rule(at=st.integers(0, 20))
    def expire(self, at: int) -> None:
        never, running = self.jobs.overdue(float(at))
        assert all(self._index(h) not in self.started for h in never)
        assert all(self._index(h) in self.started for h in running)
        self.handed.extend(self._index(h) for h in never + running)

    @rule()
    def heartbeat_snapshot(self) -> None:
        self.snapshots.append(self.jobs.heartbeat_jobs())

    @precondition(lambda self: self.snapshots)
    @rule(data=st.data())
    def heartbeat_answer(self, data: st.DataObject) -> None:
        """An answer to an earlier snapshot: some of its claims were not extended."""
        snapshot = self.snapshots.pop(data.draw(st.integers(0, len(self.snapshots) - 1)))
        missing = data.draw(
            st.lists(st.sampled_from(snapshot), unique_by=id) if snapshot else st.just([])
        )
        self.named.update(self._index(h) for h in missing)
        self.jobs.lose(missing)

    @rule()
    def settle(self) -> None:
        handed = [h for h in self.all if h.phase in (Phase.SETTLING, Phase.ABANDONED)]
        self.jobs.settled(handed)

    @invariant()
    def phases_agree_with_what_happened(self) -> None:
        held_now = self.jobs.unsettled()
        for i, h in enumerate(self.all):
            assert any(x is h for x in held_now) == (h.phase not in (Phase.SETTLED, Phase.LOST))
            if h.phase in (Phase.STARTED, Phase.FINISHED, Phase.ABANDONED):
                assert i in self.started
            if h.phase is Phase.LOST:
                assert i in self.named, "a claim lost that no heartbeat answer named"
        assert len(held_now) == len({h.claim for h in held_now})
        assert len({id(h) for h in self.lost}) == len(self.lost), "a job counted lost twice"
        assert len(set(self.handed)) == len(self.handed), "a job handed to the settler twice"
        beating = self.jobs.heartbeat_jobs()
        assert all(h.phase in (Phase.CLAIMED, Phase.STARTED, Phase.FINISHED) for h in beating)


TestRegistry = RegistryMachine.TestCase
TestRegistry.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
