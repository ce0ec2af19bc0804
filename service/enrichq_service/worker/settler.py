"""The settler: settles finished jobs in groups, one transaction per group; a group that
fails is tried again (database away) or settled job by job (anything else)."""

from __future__ import annotations

import logging
import queue as stdqueue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from enrichq_schema import metrics
from enrichq_schema.settings import Settings
from enrichq_schema.states import Outcome
from enrichq_service import queue as q
from enrichq_service.enrich import (
    BYTES_MAX,
    Lookup,
    Result,
    error_text,
    log_lookups,
    write_results,
)
from enrichq_service.worker.db import Backoff, ThreadConnection, is_unavailable
from enrichq_service.worker.lifecycle import Held, Jobs

log = logging.getLogger(__name__)

# A group is one transaction: its BEGIN, its four statements and its COMMIT are paid once
# for all its jobs. Chosen as a default worker's whole batch-enricher load of 8 batches of
# 50 (two batches of 200 now), and never splitting one lookup's settlements (`put`); why not
# smaller: docs/modules.md (enrichq_service.worker.settler).
GROUP_SIZE = 400
GROUP_SECONDS = 0.005  # a group is flushed when full or this old


@dataclass(frozen=True, slots=True)
class Settlement:
    """What to do with one held job: settle it by `action`, and record its lookup.

    `action` None: nothing to settle (the job was abandoned or lost meanwhile, its outcome
    already counted); only its lookup is recorded and charged.
    """

    held: Held
    action: q.SettleAction | None
    result: Result | None = None
    error: str | None = None
    until: datetime | None = None
    lookup: Lookup | None = None

    def settle(self) -> q.Settle | None:
        if self.action is None:
            return None
        return q.Settle(self.held.job, self.action, error=self.error, until=self.until)


class Settler:
    """Settles what the runner and the claim loop hand it, in groups, until stopped."""

    def __init__(
        self,
        engine: sa.Engine,
        settings: Settings,
        owner: str,
        jobs: Jobs,
        *,
        counted: Callable[[str, int], None],
        freed: Callable[[], None],
    ) -> None:
        self._conn = ThreadConnection(engine)
        self._settings = settings
        self._owner = owner
        self._jobs = jobs
        self._counted = counted
        self._freed = freed
        # each item the settlements of one lookup (or one job), settled in one group: a
        # lookup's bytes are charged in the transaction that releases its admission, so
        # the budget never sees its reservation gone before all of its cost is on the ledger
        self._queue: stdqueue.Queue[tuple[Settlement, ...]] = stdqueue.Queue()
        self._maybe_settled = False  # the last attempt at the pending group may have committed

    def put(self, *settlements: Settlement) -> None:
        """Settle these together, in one group (the jobs of one lookup)."""
        if settlements:
            self._queue.put(settlements)

    def pending(self) -> int:
        return self._queue.qsize()

    def run(self, stop: threading.Event, give_up: threading.Event) -> None:
        """Settle until `stop` is set and nothing is left, or `give_up` is set (the runtime's
        supervisor runs it; on shutdown it gives up after a bounded wait)."""
        backoff = Backoff()
        group: list[Settlement] = []
        try:
            while not give_up.is_set():
                if not group:
                    try:
                        group.extend(self._queue.get(timeout=0.1))
                    except stdqueue.Empty:
                        if stop.is_set():
                            return
                        continue
                first_at = time.monotonic()
                while len(group) < GROUP_SIZE:
                    left = GROUP_SECONDS - (time.monotonic() - first_at)
                    try:
                        group.extend(self._queue.get(timeout=max(left, 0)))
                    except stdqueue.Empty:
                        break
                try:
                    self.flush(group)
                except sa_exc.SQLAlchemyError as exc:
                    if not is_unavailable(exc):
                        raise
                    self._maybe_settled = True
                    log.warning("settle failed (%s); retrying", error_text(exc))
                    give_up.wait(backoff.next())
                    continue
                group = []
                backoff.reset()
        finally:
            self._conn.close()

    def flush(self, group: Sequence[Settlement]) -> None:
        """Settle a group; split it when it fails for its contents (anything but the
        database being unavailable, which the caller retries)."""
        try:
            outcomes = self._settle(group)
        except Exception as exc:
            if is_unavailable(exc):
                raise
            log.warning(
                "a settle group was refused (%s); settling its jobs one by one", error_text(exc)
            )
            outcomes = {}
            for one in group:
                outcomes.update(self._settle_alone(one))
        self._maybe_settled = False
        self._account(group, outcomes)

    def _settle_alone(self, settlement: Settlement) -> dict[int, Outcome]:
        """One job in a transaction of its own. A job refused (by the database, the driver,
        anything) is settled again as a failure that names the refusal, its lookup still
        recorded but stripped to numbers and that text; a late lookup refused is recorded
        stripped the same way."""
        try:
            return self._settle([settlement])
        except Exception as exc:
            if is_unavailable(exc):
                raise
            refused = f"the database refused this job's result: {error_text(exc)}"
        log.warning("queue row %d: %s", settlement.held.id, refused)
        action = None if settlement.action is None else q.SettleAction.FAIL
        failed = replace(
            settlement,
            action=action,
            result=None,
            error=refused,
            until=None,
            lookup=_stripped(settlement.lookup, refused),
        )
        try:
            return self._settle([failed])
        except Exception as again:
            if is_unavailable(again):
                raise
            # nothing of it can be stored: leave the row to its lease and the sweeper
            log.error("queue row %d cannot be settled: %s", settlement.held.id, error_text(again))
            metrics.worker_errors_total.labels("settler").inc()
            return {}

    def _settle(self, group: Sequence[Settlement]) -> dict[int, Outcome]:
        settles = [s for s in (g.settle() for g in group) if s is not None]
        with self._conn.begin() as conn:
            outcomes = q.settle(
                conn,
                owner=self._owner,
                settles=settles,
                backoff_base_seconds=self._settings.backoff_base_seconds,
                backoff_cap_seconds=self._settings.backoff_cap_seconds,
            )
            write_results(
                conn,
                [
                    g.result
                    for g in group
                    if g.result is not None and outcomes.get(g.held.id) is Outcome.DONE
                ],
            )
            log_lookups(conn, [g.lookup for g in group if g.lookup is not None], now=None)
            if self._maybe_settled:
                # a retry after a COMMIT whose reply was lost: what did that COMMIT do?
                refused = [s for s in settles if s.job.id not in outcomes]
                outcomes.update(q.read_back(conn, refused))
        return outcomes

    def _account(self, group: Sequence[Settlement], outcomes: dict[int, Outcome]) -> None:
        now = time.monotonic()
        tally: Counter[str] = Counter()
        settled: list[Held] = []
        for s in group:
            if s.action is None:
                continue  # a late lookup: its job's outcome was counted when it was let go
            job = s.held.job
            outcome = outcomes.get(job.id, Outcome.LOST)
            tally[outcome.value] += 1
            metrics.job_outcomes_total.labels(job.kind, outcome.value).inc()
            metrics.job_duration_seconds.labels(job.kind, outcome.value).observe(
                now - s.held.claimed_at
            )
            settled.append(s.held)
        self._jobs.settled(settled)
        for name, n in tally.items():
            self._counted(name, n)
        self._freed()


def _stripped(lookup: Lookup | None, error: str) -> Lookup | None:
    """`lookup` with nothing that could be refused left: no warehouse job id, `error` (one
    printable line) as its error, its bytes as validation bounds them (else none)."""
    if lookup is None:
        return None
    billed = lookup.bytes_billed if 0 <= lookup.bytes_billed <= BYTES_MAX else 0
    return replace(lookup, job_id=None, error=error, status="error", bytes_billed=billed)
