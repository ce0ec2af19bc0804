"""A held job's life as one small pure state machine (claimed, started, finished, settling,
settled, abandoned, lost), and the registry of the jobs held, the only state the worker's
threads share."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from uuid import UUID

from enrichq_service.enrich import Ticket
from enrichq_service.errors import ServiceError
from enrichq_service.queue import Job


class Phase(StrEnum):
    """Where one held job is."""

    CLAIMED = "claimed"  # leased to this process, its handler not started
    STARTED = "started"  # its handler runs
    FINISHED = "finished"  # its handler returned; its settlement is being built
    SETTLING = "settling"  # handed to the settler
    SETTLED = "settled"  # its settle committed (or was refused): no longer held
    ABANDONED = "abandoned"  # past its deadline while running: retried, handler told to stop
    LOST = "lost"  # the heartbeat found the lease gone: someone else's now


class JobEvent(StrEnum):
    """What can happen to a held job."""

    START = "start"
    FINISH = "finish"
    HAND_OFF = "hand_off"
    SETTLED = "settled"
    ABANDON = "abandon"  # its attempt's deadline passed
    LOSE = "lose"  # the heartbeat did not extend its lease


class IllegalTransition(ServiceError):
    """An event that cannot happen in a phase: a bug in the runtime, never a race."""


# Events that may legitimately arrive late (a race with another thread) and change nothing.
IGNORED: frozenset[tuple[Phase, JobEvent]] = frozenset(
    {
        (Phase.FINISHED, JobEvent.ABANDON),  # it finished just in time
        (Phase.SETTLING, JobEvent.ABANDON),
        (Phase.SETTLING, JobEvent.LOSE),  # its settle committed first: not a lost lease
        (Phase.SETTLED, JobEvent.ABANDON),
        (Phase.SETTLED, JobEvent.LOSE),
        (Phase.ABANDONED, JobEvent.ABANDON),
        (Phase.ABANDONED, JobEvent.LOSE),
        (Phase.ABANDONED, JobEvent.FINISH),  # a late result: its lookup is logged, nothing else
        (Phase.LOST, JobEvent.ABANDON),
        (Phase.LOST, JobEvent.LOSE),
        (Phase.LOST, JobEvent.FINISH),  # a late result of a lost lease: logged, nothing else
        (Phase.LOST, JobEvent.START),  # a lost job never starts
        (Phase.ABANDONED, JobEvent.START),
        (Phase.SETTLING, JobEvent.START),  # deferred before it started: never starts
        (Phase.SETTLED, JobEvent.START),
        (Phase.SETTLED, JobEvent.FINISH),  # a late result of an abandoned job whose retry committed
        (Phase.LOST, JobEvent.SETTLED),  # a settle of a job lost meanwhile was refused
        # refused before it could start, but deferred (overdue) or lost meanwhile
        (Phase.SETTLING, JobEvent.HAND_OFF),
        (Phase.SETTLED, JobEvent.HAND_OFF),
        (Phase.LOST, JobEvent.HAND_OFF),
    }
)

MOVES: dict[tuple[Phase, JobEvent], Phase] = {
    (Phase.CLAIMED, JobEvent.START): Phase.STARTED,
    (Phase.CLAIMED, JobEvent.HAND_OFF): Phase.SETTLING,  # refused before it could start
    (Phase.CLAIMED, JobEvent.ABANDON): Phase.SETTLING,  # overdue, never started: deferred
    (Phase.CLAIMED, JobEvent.LOSE): Phase.LOST,
    (Phase.STARTED, JobEvent.FINISH): Phase.FINISHED,
    (Phase.STARTED, JobEvent.ABANDON): Phase.ABANDONED,
    (Phase.STARTED, JobEvent.LOSE): Phase.LOST,
    (Phase.FINISHED, JobEvent.HAND_OFF): Phase.SETTLING,
    (Phase.FINISHED, JobEvent.LOSE): Phase.LOST,
    (Phase.SETTLING, JobEvent.SETTLED): Phase.SETTLED,
    (Phase.ABANDONED, JobEvent.SETTLED): Phase.SETTLED,
}


def transition(phase: Phase, event: JobEvent) -> Phase:
    """The phase after `event`; the same phase for an event that arrives too late to
    matter; IllegalTransition for one that cannot happen."""
    moved = MOVES.get((phase, event))
    if moved is not None:
        return moved
    if (phase, event) in IGNORED:
        return phase
    raise IllegalTransition(f"{event.value} in {phase.value}")


class Flag:
    """Set once, read from any thread: what a job needs of a threading.Event (nobody waits
    on a job's flag), without the lock and condition each Event builds, one per job claimed
    on the claim loop's path."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


@dataclass(eq=False)
class Held:
    """A job this process holds, from its claim until it is settled or lost."""

    job: Job
    ticket: Ticket | None
    # time.monotonic() after which the attempt is abandoned: its claim's deadline until it
    # starts (one not started by then is deferred, its attempt given back), then its start's
    deadline: float
    claimed_at: float = field(default_factory=time.monotonic)
    # time.monotonic() before the last statement that (re)set the lease on the server (the
    # claim, then each heartbeat that extended it): the lease lasts at least until this
    # plus the lease length, and perhaps not a moment longer
    lease_confirmed_at: float | None = None
    phase: Phase = Phase.CLAIMED
    handed_at: float | None = None  # when its settlement went to the settler
    cancelled: Flag = field(default_factory=Flag)
    # set before its lookup runs in a child process (`isolate`)
    isolated: bool = False
    # called (once) when the job is abandoned or lost: interrupts a running lookup
    _cancellers: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.lease_confirmed_at is None:
            self.lease_confirmed_at = self.claimed_at

    @property
    def id(self) -> int:
        return self.job.id

    @property
    def claim(self) -> tuple[int, UUID]:
        """What names this job: its row's id and the claim token of this claim."""
        return (self.job.id, self.job.claim_token)

    @property
    def confirmed(self) -> float:
        assert self.lease_confirmed_at is not None  # set by __post_init__
        return self.lease_confirmed_at


class Jobs:
    """The jobs this process holds, by claim; every change goes through `transition`."""

    def __init__(self, on_lost: Callable[[Held], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[int, UUID], Held] = {}
        self._settling = 0  # of them, handed to the settler and not settled yet
        self._on_lost = on_lost or (lambda held: None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def counts(self) -> tuple[int, int]:
        """The jobs held, and how many of them wait for the settler (handed to it, their
        handlers done or never to start)."""
        with self._lock:
            return len(self._held), self._settling

    def add(self, held: Iterable[Held]) -> None:
        with self._lock:
            for h in held:
                self._held[h.claim] = h

    def _apply(self, held: Held, event: JobEvent) -> tuple[Phase, Phase]:
        before = held.phase
        held.phase = transition(before, event)
        if (before is Phase.SETTLING) != (held.phase is Phase.SETTLING):
            self._settling += 1 if held.phase is Phase.SETTLING else -1
        if held.phase in (Phase.SETTLING, Phase.ABANDONED) and held.handed_at is None:
            held.handed_at = time.monotonic()
        if held.phase in (Phase.SETTLED, Phase.LOST) and self._held.get(held.claim) is held:
            del self._held[held.claim]
        return before, held.phase

    def start(self, held: Sequence[Held], now: float, run_seconds: float) -> list[Held]:
        """Start the jobs that may still start: claimed, and within their deadline at `now`;
        the others never will. A started job may run for `run_seconds` from `now` (the
        attempt deadline bounds running, not the wait for a warehouse slot before it). One
        whose deadline passed while it waited to start (for a slot, or through a database
        outage that kept the claim loop from seeing it overdue) stays claimed, for `overdue`
        to defer with its attempt given back: waiting is not running."""
        started: list[Held] = []
        with self._lock:
            for h in held:
                if h.deadline > now and self._apply(h, JobEvent.START) == (
                    Phase.CLAIMED,
                    Phase.STARTED,
                ):
                    h.deadline = now + run_seconds
                    started.append(h)
        return started

    def hand_off(self, held: Held, *, finished: bool) -> bool:
        """Move a job towards the settler (`finished`: its handler ran; else it never
        started); False when it was abandoned, deferred or lost meanwhile (its result must
        not be settled: only its lookup, if any, is logged)."""
        with self._lock:
            if finished and self._apply(held, JobEvent.FINISH)[1] is not Phase.FINISHED:
                return False
            before, after = self._apply(held, JobEvent.HAND_OFF)
            return before is not Phase.SETTLING and after is Phase.SETTLING

    def settled(self, held: Iterable[Held]) -> None:
        """Their settles committed, or were refused: no longer held."""
        with self._lock:
            for h in held:
                self._apply(h, JobEvent.SETTLED)

    def overdue(self, now: float) -> tuple[list[Held], list[Held]]:
        """Jobs past their deadline: (never started: to defer, running: to retry). Both are
        handed to the settler by this call and cancelled (a wait for an admission ends, a
        running lookup is told to stop)."""
        never: list[Held] = []
        running: list[Held] = []
        with self._lock:
            for h in list(self._held.values()):
                if h.deadline > now:
                    continue
                before, after = self._apply(h, JobEvent.ABANDON)
                if (before, after) == (Phase.CLAIMED, Phase.SETTLING):
                    never.append(h)
                elif after is Phase.ABANDONED and before is Phase.STARTED:
                    running.append(h)
        for h in never + running:
            _cancel(h)
        return never, running

    def lose(self, held: Iterable[Held]) -> list[Held]:
        """The heartbeat found the leases of these claims gone; the jobs that really lost
        theirs (a job already handed to the settler did not: its settle committed first;
        a newer claim of the same row is another job, untouched)."""
        lost: list[Held] = []
        with self._lock:
            for h in held:
                before, after = self._apply(h, JobEvent.LOSE)
                if before is not Phase.LOST and after is Phase.LOST:
                    lost.append(h)
        for h in lost:
            _cancel(h)
            self._on_lost(h)
        return lost

    def confirm(self, held: Iterable[Held], at: float) -> None:
        """A heartbeat that started at `at` extended these leases."""
        with self._lock:
            for h in held:
                h.lease_confirmed_at = max(h.confirmed, at)

    def unconfirmed_since(self, before: float) -> list[Held]:
        """Jobs whose lease the heartbeat extends that no statement has confirmed since
        `before`: past a lease without a heartbeat, the lease may be someone else's."""
        alive = (Phase.CLAIMED, Phase.STARTED, Phase.FINISHED)
        with self._lock:
            return [h for h in self._held.values() if h.phase in alive and h.confirmed < before]

    def heartbeat_jobs(self) -> list[Held]:
        """Jobs whose lease the heartbeat extends: not yet handed to the settler."""
        alive = (Phase.CLAIMED, Phase.STARTED, Phase.FINISHED)
        with self._lock:
            return [h for h in self._held.values() if h.phase in alive]

    def unsettled(self) -> list[Held]:
        """Every job still held, in any phase."""
        with self._lock:
            return list(self._held.values())

    def oldest_unsettled_seconds(self, now: float | None = None) -> float:
        """How long the oldest settlement handed to the settler has waited (0 = none)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            handed = [h.handed_at for h in self._held.values() if h.handed_at is not None]
        return max(0.0, now - min(handed)) if handed else 0.0

    def nearest_deadline(self) -> float | None:
        with self._lock:
            live = [h.deadline for h in self._held.values() if h.phase is not Phase.SETTLING]
        return min(live) if live else None

    @contextmanager
    def interruptible(self, held: Sequence[Held], cancel: Callable[[], None]) -> Iterator[None]:
        """While the block runs, `cancel` is called (once) as soon as every job of `held` is
        cancelled (abandoned or lost): a batch whose one ticket lost its lease still runs
        for the others."""
        fired = threading.Event()

        def maybe() -> None:
            if not fired.is_set() and all(h.cancelled.is_set() for h in held):
                fired.set()
                cancel()

        with self._lock:
            for h in held:
                h._cancellers.append(maybe)
        try:
            maybe()
            yield
        finally:
            with self._lock:
                for h in held:
                    if maybe in h._cancellers:
                        h._cancellers.remove(maybe)


def _cancel(held: Held) -> None:
    held.cancelled.set()
    for cancel in list(held._cancellers):
        # interrupting a lookup is best effort: its statement timeout still holds
        with contextlib.suppress(Exception):
            cancel()
