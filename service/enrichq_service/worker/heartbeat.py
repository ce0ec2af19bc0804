"""The heartbeat: extends every lease (and warehouse admission) this worker still holds,
and tells the handler of a lease that did not come back, or went unconfirmed for a whole
lease, to stop."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from enrichq_schema import metrics, runlog
from enrichq_schema.settings import Settings
from enrichq_service import queue as q
from enrichq_service.enrich import error_text
from enrichq_service.worker.admission import Admission
from enrichq_service.worker.db import is_unavailable
from enrichq_service.worker.lifecycle import Jobs

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Heartbeat:
    """Extends this worker's leases until stopped."""

    _engine: sa.Engine
    _settings: Settings
    _owner: str
    _jobs: Jobs
    _admission: Admission
    # time.monotonic() when the last heartbeat reached the database (or had nothing to do)
    _last: float = field(default_factory=time.monotonic, init=False)
    # this worker's run-log row, stamped by every beat: the sweeper closes runs gone silent
    run_id: int | None = field(default=None, init=False)

    def run(self, stop: threading.Event) -> None:
        period = self._settings.heartbeat_seconds
        while not stop.wait(period):
            self.beat()
            self.stamp_run()  # after the leases: they matter more

    def watch(self, stop: threading.Event) -> None:
        """Until stopped, lose the jobs whose lease went a whole lease unconfirmed."""
        period = min(self._settings.heartbeat_seconds, self._settings.lease_seconds / 8)
        while not stop.wait(period):
            self.lose_unconfirmed(time.monotonic())

    def lose_unconfirmed(self, now: float) -> int:
        """Lose the jobs no statement has confirmed the lease of since a lease before
        `now`; how many."""
        stale = self._jobs.unconfirmed_since(now - self._settings.lease_seconds)
        if not stale:
            return 0
        lost = self._jobs.lose(stale)
        if lost:
            log.warning(
                "no heartbeat has reached the database for %.1f s (a lease): %d leases "
                "treated as lost, their handlers stopped",
                now - self._last,
                len(lost),
            )
        return len(lost)

    def stamp_run(self) -> None:
        """Give this worker's run row a sign of life, in a transaction of its own (a slow
        run log never holds the leases back); a failure is only logged."""
        if self.run_id is None:
            return
        try:
            with self._engine.begin() as conn:
                runlog.seen(conn, self.run_id)
        except sa_exc.SQLAlchemyError as exc:
            log.warning("run log not stamped (%s)", error_text(exc))

    def beat(self) -> None:
        metrics.heartbeat_lag_seconds.set(time.monotonic() - self._last)
        held = self._jobs.heartbeat_jobs()
        started = time.monotonic()
        # admissions too: a lookup whose attempt was abandoned keeps its slot while it runs
        if not held and not self._admission.holding():
            self._last = started
            return
        try:
            with self._engine.begin() as conn:
                missing = q.heartbeat(
                    conn,
                    owner=self._owner,
                    jobs=[h.job for h in held],
                    lease_seconds=self._settings.lease_seconds,
                )
                self._admission.extend(conn)
        except sa_exc.SQLAlchemyError as exc:
            if not is_unavailable(exc):
                raise
            metrics.heartbeat_failures_total.inc()
            log.warning("heartbeat failed (%s)", error_text(exc))
            return
        self._last = time.monotonic()
        gone = set(missing)
        self._jobs.confirm([h for h in held if h.id not in gone], started)
        if gone:
            # the claims this statement named, never a newer claim of the same row
            self._jobs.lose([h for h in held if h.id in gone])
