"""Fleet-wide admission of warehouse lookups: the daily bytes budget and the warehouse cap.

Before a lookup runs, it is admitted in a short transaction of its own that serializes
with every other admission of the fleet (an advisory lock) and inserts a row into
`enrichq.lookups_in_flight`: the lookup's slot under `ENRICHQ_WAREHOUSE_MAX_CONCURRENCY`,
and the bytes it is expected to cost reserved against `ENRICHQ_DAILY_BYTES_BUDGET`. The
admission is refused when every slot is taken, or when the bytes billed today plus the
bytes reserved by the lookups in flight reach the budget. The settle that charges the
lookup's real bytes releases the row in the same transaction; a worker that dies leaves
its rows behind only until they expire, one lease after its last heartbeat.

The expected cost of a lookup is the latest day's average (the ledger knows it), or,
before any lookup was charged, the real cost of a lookup that ran and is not settled yet.
With nothing known at all, a worker admits one lookup at a time until its first one has
cost something; that lookup then reserves what it really cost, before its settle. So the
fleet overspends its budget by at most one lookup per worker.

With neither a budget nor a cap, nothing is admitted and nothing is written: a lookup
just runs.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

import sqlalchemy as sa

from enrichq_schema import metrics
from enrichq_schema.settings import Settings
from enrichq_service.enrich import SQL
from enrichq_service.errors import Deferral

# The advisory-lock space of admissions ("enra": enrichq admission).
ADMISSION_LOCK_SPACE = 0x656E7261
# How long a lookup waits for a free slot under the cap before its jobs are deferred.
SLOT_WAIT_SECONDS = 2.0
SLOT_POLL_SECONDS = 0.05
# A job deferred for want of a slot comes back this much later.
SLOT_DEFER_SECONDS = 2.0


class Refused(Deferral):
    """The lookup was not admitted: the jobs are deferred, their attempts given back."""

    def __init__(self, until: datetime, reason: str, message: str) -> None:
        super().__init__(until, message)
        self.reason = reason


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

    @property
    def needed(self) -> bool:
        return self._settings.daily_bytes_budget > 0 or self._settings.warehouse_max_concurrency > 0

    def admit(self, cancelled: threading.Event) -> Admitted:
        """Admit one lookup, waiting up to SLOT_WAIT_SECONDS for a slot; Refused otherwise."""
        if not self.needed:
            return NOT_NEEDED
        give_up = time.monotonic() + SLOT_WAIT_SECONDS
        waited = False
        while True:
            token = uuid.uuid4()
            row, permit = self._take_with_permit(token)
            if row.refused == "budget":
                metrics.warehouse_deferrals_total.labels("budget").inc()
                metrics.budget_exhausted.set(1)
                raise Refused(row.resets_at, "budget", "daily warehouse bytes budget spent")
            if row.refused is None:
                metrics.budget_exhausted.set(0)
                unknown = self._settings.daily_bytes_budget > 0 and not row.reserved
                if not unknown or permit:
                    return Admitted(token, int(row.reserved or 0), unknown, row.now)
                self.release([token])  # wait for this worker's first lookup to cost something
            if not waited:
                metrics.warehouse_slot_waits_total.inc()
                waited = True
            if time.monotonic() >= give_up or cancelled.wait(SLOT_POLL_SECONDS):
                metrics.warehouse_deferrals_total.labels("cap").inc()
                until = row.now + timedelta(seconds=SLOT_DEFER_SECONDS)
                raise Refused(
                    until, "cap", "no free warehouse slot (ENRICHQ_WAREHOUSE_MAX_CONCURRENCY)"
                )

    def learned(self, admitted: Admitted, billed: int) -> None:
        """The admitted lookup ran and cost `billed`: reserve that until its settle charges
        it, and let this worker's next lookup of unknown cost go."""
        if admitted.token is None:
            return
        try:
            if admitted.unknown_cost and billed:
                with self._engine.begin() as conn:
                    conn.execute(
                        SQL("admission_reserve"), {"token": admitted.token, "bytes": billed}
                    )
        finally:
            if admitted.unknown_cost:
                self._unknown.release()

    def release(self, tokens: list[UUID]) -> None:
        """Give back admissions of lookups that did not run."""
        if tokens:
            with self._engine.begin() as conn:
                conn.execute(SQL("admission_release"), {"tokens": tokens})

    def extend(self, conn: sa.Connection) -> None:
        """Keep this worker's admissions alive (called by its heartbeat)."""
        if self.needed:
            conn.execute(
                SQL("admission_extend"),
                {"owner": self._owner, "lease_seconds": self._settings.lease_seconds, "now": None},
            )

    def _take_with_permit(self, token: UUID) -> tuple[sa.Row[tuple[object, ...]], bool]:
        """Take an admission, and say whether it holds this worker's permit for a lookup
        of unknown cost (kept only by an admitted take that found no cost to reserve).

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
        kept = permit and row.refused is None and not row.reserved
        if permit and not kept:
            self._unknown.release()
        return row, kept

    def _take(self, token: UUID) -> sa.Row[tuple[object, ...]]:
        with self._engine.begin() as conn:
            conn.execute(SQL("admission_serialize"), {"lock_space": ADMISSION_LOCK_SPACE})
            return conn.execute(
                SQL("admission_take"),
                {
                    "token": token,
                    "owner": self._owner,
                    "cap": self._settings.warehouse_max_concurrency,
                    "budget": self._settings.daily_bytes_budget,
                    "expected": None,
                    "lease_seconds": self._settings.lease_seconds,
                    "now": None,
                },
            ).one()
