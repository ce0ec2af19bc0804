"""Fleet-wide admission of warehouse lookups: a lookup runs only once one statement has
given it a slot under the warehouse cap and reserved its expected bytes against the daily
budget."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from enrichq_schema import metrics
from enrichq_schema.pooling import WITHOUT_SETTINGS
from enrichq_schema.settings import Settings
from enrichq_service.enrich import SQL, error_text
from enrichq_service.errors import Deferral, ServiceError
from enrichq_service.worker.db import Backoff, is_unavailable

log = logging.getLogger(__name__)

# The advisory-lock space of admissions ("enra": enrichq admission).
ADMISSION_LOCK_SPACE = 0x656E7261
# How long an admission waits for the fleet's admission lock before its statement fails and
# is tried again (the lock_timeout of enrichq.admission_take, migration 0019): in either pool
# mode, although behind a transaction pooler its statement runs without a statement timeout.
ADMISSION_LOCK_WAIT_SECONDS = 2.0
# How long a lookup waits for a free slot under the cap before its jobs are deferred.
SLOT_WAIT_SECONDS = 2.0
SLOT_POLL_SECONDS = 0.05
# A job deferred for want of a slot comes back this much later.
SLOT_DEFER_SECONDS = 2.0
# Why a lookup that waited was refused, by `enrichq_warehouse_deferrals_total` reason.
WAIT_REFUSALS = {
    "cap": "no free warehouse slot (ENRICHQ_WAREHOUSE_MAX_CONCURRENCY)",
    "estimate": "no cost estimate yet: this worker's lookup of unknown cost is still running",
}


class AdmissionRefused(Deferral):
    """The lookup was not admitted: the jobs are deferred, their attempts given back."""

    def __init__(self, until: datetime, reason: str, message: str) -> None:
        super().__init__(until, message)
        self.reason = reason


class Withdrawn(ServiceError):
    """Every job of the lookup was let go (deferred or lost) while it waited: nothing to
    admit any more."""


@dataclass(frozen=True, slots=True)
class Admitted:
    """A lookup allowed to run: its reservation to release, and whether its cost was
    unknown (then it holds the worker's one unknown-cost permit until `learned`)."""

    token: UUID | None
    reserved: int
    unknown_cost: bool
    at: datetime | None  # the database time of the admission


NOT_NEEDED = Admitted(None, 0, False, None)


class Admission:
    """This worker's side of the fleet-wide admission (owned by the job runner)."""

    def __init__(self, engine: sa.Engine, settings: Settings, owner: str) -> None:
        self._engine = engine
        self._settings = settings
        self._owner = owner
        self._unknown = threading.Semaphore(1)  # one lookup of unknown cost at a time
        self._lock = threading.Lock()
        # this worker's rows in lookups_in_flight, as far as it knows: admitted, and not
        # seen released (by `release`, or by the settle that charged the lookup)
        self._live: set[UUID] = set()
        # tokens of takes whose reply was lost: perhaps admitted, never to run
        self._unheard: set[UUID] = set()

    @property
    def needed(self) -> bool:
        return self._settings.daily_bytes_budget > 0 or self._settings.warehouse_max_concurrency > 0

    def holding(self) -> bool:
        """Whether this worker may hold admissions its heartbeat must extend."""
        with self._lock:
            return bool(self._live)

    def admit(self, cancelled: threading.Event) -> Admitted:
        """Admit one lookup, waiting up to SLOT_WAIT_SECONDS for a slot (AdmissionRefused otherwise)
        and out the database's unavailability; Withdrawn once `cancelled` is set."""
        if not self.needed:
            return NOT_NEEDED
        give_up = time.monotonic() + SLOT_WAIT_SECONDS
        waited = False
        while True:
            token, row, permit = self._take_retrying(cancelled)
            if row.refused == "budget":
                metrics.warehouse_deferrals_total.labels("budget").inc()
                metrics.budget_exhausted.set(1)
                raise AdmissionRefused(
                    row.resets_at, "budget", "daily warehouse bytes budget spent"
                )
            reason = "cap"
            if row.refused is None:
                metrics.budget_exhausted.set(0)
                unknown = self._settings.daily_bytes_budget > 0 and not row.known
                if not unknown or permit:
                    return Admitted(token, int(row.reserved or 0), unknown, row.now)
                # wait for this worker's lookup of unknown cost to cost something
                self._give_back([token], quietly=True)
                reason = "estimate"
            if not waited:
                metrics.warehouse_slot_waits_total.inc()
                waited = True
            if cancelled.wait(SLOT_POLL_SECONDS):
                raise Withdrawn
            if time.monotonic() >= give_up:
                metrics.warehouse_deferrals_total.labels(reason).inc()
                until = row.now + timedelta(seconds=SLOT_DEFER_SECONDS)
                raise AdmissionRefused(until, reason, WAIT_REFUSALS[reason])

    def _take_retrying(
        self, cancelled: threading.Event
    ) -> tuple[UUID, sa.Row[tuple[object, ...]], bool]:
        """`_take_with_permit` under a new token, tried again (another token) with backoff
        while the database is unavailable; Withdrawn once `cancelled` is set."""
        backoff = Backoff()
        while not cancelled.is_set():
            token = uuid.uuid4()
            try:
                self._release_unheard()
                return (token, *self._take_with_permit(token))
            except sa_exc.SQLAlchemyError as exc:
                if not is_unavailable(exc):
                    raise
                with self._lock:
                    self._unheard.add(token)  # it may have committed, its reply lost
                log.warning("warehouse admission failed (%s); retrying", error_text(exc))
                cancelled.wait(backoff.next())
        raise Withdrawn

    def learned(self, admitted: Admitted, billed: int) -> None:
        """The admitted lookup ran and cost `billed`: reserve that until its settle charges
        it, and let this worker's next lookup of unknown cost go."""
        if admitted.token is None:
            return
        try:
            # every query's real cost (a known estimate may be below it: a rise), so the
            # fleet's next admissions reserve what a query costs now
            # (a query that billed nothing, one that failed say, teaches nothing)
            if self._settings.daily_bytes_budget > 0 and billed > 0:
                with self._engine.begin() as conn:
                    conn.execute(
                        SQL("admission_reserve"), {"token": admitted.token, "bytes": billed}
                    )
        except sa_exc.SQLAlchemyError as exc:
            if not is_unavailable(exc):
                raise
            # its settle charges the real cost all the same; meanwhile it reserves less
            log.warning("could not reserve a lookup's cost (%s)", error_text(exc))
        finally:
            if admitted.unknown_cost:
                self._unknown.release()

    def give_back(self, admitted: Admitted) -> None:
        """The admitted lookup will not run (its jobs were let go while it was admitted)."""
        if admitted.token is None:
            return
        try:
            self._give_back([admitted.token], quietly=True)
        finally:
            if admitted.unknown_cost:
                self._unknown.release()

    def release(self, tokens: list[UUID]) -> None:
        """Give back admissions of lookups that did not run."""
        self._give_back(tokens, quietly=False)

    def _give_back(self, tokens: Iterable[UUID], *, quietly: bool) -> None:
        """Delete these admissions; `quietly`: a database that is unavailable leaves them
        to expire within a lease (no heartbeat extends them any more)."""
        tokens = list(tokens)
        if not tokens:
            return
        with self._lock:
            self._live.difference_update(tokens)
        try:
            with self._engine.begin() as conn:
                conn.execute(SQL("admission_release"), {"tokens": tokens})
        except sa_exc.SQLAlchemyError as exc:
            if not (quietly and is_unavailable(exc)):
                raise
            log.warning("could not give back a warehouse admission (%s)", error_text(exc))

    def _release_unheard(self) -> None:
        """Delete what takes whose reply was lost may have admitted."""
        with self._lock:
            unheard = list(self._unheard)
        if unheard:
            self._give_back(unheard, quietly=False)
            with self._lock:
                self._unheard.difference_update(unheard)

    def extend(self, conn: sa.Connection) -> None:
        """Keep this worker's admissions alive (called by its heartbeat), and forget those
        that are gone (released by their settles, or expired)."""
        with self._lock:
            # each was committed before this statement starts: it sees every one still there
            tokens = set(self._live)
        if not tokens:
            return
        extended = set(
            conn.execute(
                SQL("admission_extend"),
                {
                    "owner": self._owner,
                    "tokens": list(tokens),
                    "lease_seconds": self._settings.lease_seconds,
                    "now": None,
                },
            ).scalars()
        )
        with self._lock:
            self._live.difference_update(tokens - extended)

    def _take_with_permit(self, token: UUID) -> tuple[sa.Row[tuple[object, ...]], bool]:
        """Take an admission, and say whether it holds this worker's permit for a lookup
        of unknown cost (kept only by an admitted take that found no cost known).

        Only a take made while holding the permit may admit a lookup of unknown cost: the
        permit is released once its lookup's cost is reserved, so such a take sees every
        cost this worker has learned. A take made before that, while the first lookup's
        cost was still unknown, would find no cost either and, reaching the permit after
        it was released, run a second lookup of unknown cost beside one of known cost."""
        permit = self._settings.daily_bytes_budget > 0 and self._unknown.acquire(blocking=False)
        try:
            row = self._take(token)
        except BaseException:
            if permit:
                self._unknown.release()
            raise
        kept = permit and row.refused is None and not row.known
        if permit and not kept:
            self._unknown.release()
        return row, kept

    def _take(self, token: UUID) -> sa.Row[tuple[object, ...]]:
        """One admission statement, in a transaction of its own (no lock outlives it)."""
        with self._engine.connect() as conn:
            # the statement bounds its own wait (no statement timeout here behind a pooler)
            conn.execution_options(isolation_level="AUTOCOMMIT", **{WITHOUT_SETTINGS: True})
            row = conn.execute(
                SQL("admission_take"),
                {
                    "token": token,
                    "owner": self._owner,
                    "cap": self._settings.warehouse_max_concurrency,
                    "budget": self._settings.daily_bytes_budget,
                    "expected": None,
                    "lease_seconds": self._settings.lease_seconds,
                    "now": None,
                    "lock_space": ADMISSION_LOCK_SPACE,
                },
            ).one()
        if row.refused is None:
            with self._lock:
                self._live.add(token)
        return row
