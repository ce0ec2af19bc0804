"""The held job's state machine: every (phase, event) pair, and the registry under random
interleavings of the runtime's threads (a hypothesis state machine)."""

from __future__ import annotations

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
    Event,
    Held,
    IllegalTransition,
    Jobs,
    Phase,
    transition,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def held(n: int, deadline: float = float("inf")) -> Held:
    job = Job(n, "enrich", f"T-{n}", None, "manual", {}, 1, 5, uuid.uuid4(), T0, T0)
    return Held(job, None, deadline)


# -- the transition function, exhaustively


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)))
def test_every_pair_moves_is_ignored_or_is_illegal(phase: Phase, event: Event) -> None:
    assert not ((phase, event) in MOVES and (phase, event) in IGNORED)
    if (phase, event) in MOVES:
        assert transition(phase, event) is MOVES[(phase, event)]
    elif (phase, event) in IGNORED:
        assert transition(phase, event) is phase
    else:
        with pytest.raises(IllegalTransition):
            transition(phase, event)


def test_the_terminal_phases_never_move_again() -> None:
    for phase, event in itertools.product((Phase.SETTLED, Phase.LOST), Event):
        if (phase, event) in IGNORED:
            assert transition(phase, event) is phase
        else:
            with pytest.raises(IllegalTransition):
                transition(phase, event)


def test_only_a_claimed_job_starts() -> None:
    starts = {p for p in Phase if MOVES.get((p, Event.START)) is Phase.STARTED}
    assert starts == {Phase.CLAIMED}
    for phase in (Phase.LOST, Phase.ABANDONED, Phase.SETTLING):
        assert transition(phase, Event.START) is phase  # a job let go never starts


def test_a_job_handed_to_the_settler_is_never_lost() -> None:
    for phase in (Phase.SETTLING, Phase.SETTLED):
        assert transition(phase, Event.LOSE) is phase


# -- the registry


def test_an_overdue_job_that_never_started_is_deferred_and_never_starts() -> None:
    jobs = Jobs()
    a = held(1, deadline=0)
    jobs.add([a])
    never, running = jobs.overdue(time.monotonic())
    assert (never, running) == ([a], [])
    assert a.phase is Phase.SETTLING
    assert jobs.start([a]) == []


def test_a_late_result_of_an_abandoned_attempt_is_not_settled() -> None:
    jobs = Jobs()
    a = held(1, deadline=0)
    jobs.add([a])
    assert jobs.start([a]) == [a]
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
    jobs.start([a, b])
    beating = jobs.heartbeat_jobs()
    assert set(beating) == {a, b}
    assert jobs.hand_off(a, finished=True)  # a's settle goes (and commits) meanwhile
    jobs.lose([1, 2])  # the heartbeat's answer: neither lease was extended
    assert lost == [2]
    assert a.phase is Phase.SETTLING
    assert b.phase is Phase.LOST


def test_a_batch_is_interrupted_only_when_every_job_of_it_is_cancelled() -> None:
    jobs = Jobs()
    a, b = held(1), held(2)
    jobs.add([a, b])
    jobs.start([a, b])
    fired = threading.Event()
    with jobs.interruptible([a, b], fired.set):
        jobs.lose([1])
        assert not fired.is_set()
        jobs.lose([2])
        assert fired.is_set()


def test_oldest_unsettled_counts_from_the_hand_off() -> None:
    jobs = Jobs()
    a = held(1)
    jobs.add([a])
    assert jobs.oldest_unsettled_seconds() == 0
    jobs.start([a])
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
    jobs.start([stale, renewed, settling])
    jobs.hand_off(settling, finished=True)
    jobs.confirm([renewed], claimed_at + 50)
    jobs.confirm([renewed], claimed_at + 10)  # an older heartbeat answering late: no step back
    assert renewed.confirmed == claimed_at + 50
    lease = 60.0
    assert jobs.unconfirmed_since(claimed_at + lease - 1 - lease) == []
    assert jobs.unconfirmed_since(claimed_at + lease + 1 - lease) == [1]
    assert jobs.lose([1]) == [stale]
    assert stale.cancelled.is_set()
    assert not renewed.cancelled.is_set()
    assert jobs.unconfirmed_since(claimed_at + 200) == [2]  # settling ones never


def test_a_claimed_job_is_confirmed_from_before_its_claim() -> None:
    before_claim = 5.0
    h = Held(held(1).job, None, float("inf"), claimed_at=9.0, lease_confirmed_at=before_claim)
    assert h.confirmed == before_claim
    assert Held(held(2).job, None, float("inf"), claimed_at=9.0).confirmed == 9.0


class RegistryMachine(RuleBasedStateMachine):
    """Random interleavings of what the claim loop, runner, settler and heartbeat do."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: list[int] = []
        self.jobs = Jobs(on_lost=lambda h: self.lost.append(h.id))
        self.all: dict[int, Held] = {}
        self.offered: set[int] = set()  # the runner starts each job once
        self.started: set[int] = set()
        self.returned: set[int] = set()  # a handler returns once
        self.settled_results: set[int] = set()
        self.next_id = 1

    @rule(n=st.integers(1, 3))
    def claim(self, n: int) -> None:
        new = [held(self.next_id + i, deadline=self.next_id + i) for i in range(n)]
        self.next_id += n
        self.jobs.add(new)
        self.all.update((h.id, h) for h in new)

    @precondition(lambda self: set(self.all) - self.offered)
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        h = self.all[data.draw(st.sampled_from(sorted(set(self.all) - self.offered)))]
        self.offered.add(h.id)
        if self.jobs.start([h]):
            assert h.id not in self.started, "a job started twice"
            self.started.add(h.id)

    @precondition(lambda self: self.started - self.returned)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        h = self.all[data.draw(st.sampled_from(sorted(self.started - self.returned)))]
        self.returned.add(h.id)
        if self.jobs.hand_off(h, finished=True):
            assert h.id not in self.settled_results, "a result handed over twice"
            self.settled_results.add(h.id)

    @rule(at=st.integers(0, 20))
    def expire(self, at: int) -> None:
        never, running = self.jobs.overdue(float(at))
        assert all(h.id not in self.started for h in never)
        assert all(h.id in self.started for h in running)

    @precondition(lambda self: self.all)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.all)), max_size=3))
        self.jobs.lose(ids)

    @rule()
    def settle(self) -> None:
        handed = [h for h in self.all.values() if h.phase in (Phase.SETTLING, Phase.ABANDONED)]
        self.jobs.settled(handed)

    @invariant()
    def phases_agree_with_what_happened(self) -> None:
        held_ids = {h.id for h in self.jobs.unsettled()}
        for h in self.all.values():
            assert (h.id in held_ids) == (h.phase not in (Phase.SETTLED, Phase.LOST))
            if h.phase in (Phase.STARTED, Phase.FINISHED, Phase.ABANDONED):
                assert h.id in self.started
        assert len(self.lost) == len(set(self.lost)), "a job counted lost twice"
        assert not set(self.lost) & self.settled_results - {
            h.id for h in self.all.values() if h.phase is Phase.LOST
        }
        beating = {h.id for h in self.jobs.heartbeat_jobs()}
        assert all(
            self.all[i].phase in (Phase.CLAIMED, Phase.STARTED, Phase.FINISHED) for i in beating
        )


TestRegistry = RegistryMachine.TestCase
TestRegistry.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
