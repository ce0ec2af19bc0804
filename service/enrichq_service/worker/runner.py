"""The job runner: runs the enrichment of claimed units of jobs on a pool of threads,
admits their lookups, and hands the settler one settlement per job."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import sqlalchemy as sa

from enrichq_schema import metrics
from enrichq_schema.settings import Settings
from enrichq_schema.states import Kind
from enrichq_service.enrich import (
    EnrichContext,
    EnricherChoice,
    Enrichment,
    InvalidResult,
    Lookup,
    PluginAborted,
    Result,
    Surcharge,
    charge_of,
    checked_time,
    enrich_all,
    error_text,
    split_bytes,
    validate,
)
from enrichq_service.errors import Deferral, PermanentError, TransientError
from enrichq_service.isolate import STOPPED_ISOLATED, enrich_in_child, is_suspect
from enrichq_service.queue import SettleAction
from enrichq_service.worker.admission import (
    NOT_NEEDED,
    Admission,
    AdmissionRefused,
    Admitted,
    Withdrawn,
)
from enrichq_service.worker.lifecycle import Held, Jobs
from enrichq_service.worker.settler import Settlement

log = logging.getLogger(__name__)

KINDS = frozenset(k.value for k in Kind)
# Spare threads per slot for plug-ins that hang past their deadline (they cannot be killed).
SPARE_THREADS_PER_SLOT = 1


class NotMirrored(TransientError):
    """The ticket is not in the help-desk mirror yet: transient, retried with backoff."""


# The error of a lookup still running when its worker had to stop without it.
COST_UNKNOWN = "the worker stopped before this lookup returned: it ran, its cost is unknown"


@dataclass(frozen=True, slots=True)
class _Running:
    """A unit's lookup from its admission until its jobs are handed to the settler."""

    held: list[Held]
    admitted: Admitted
    began: float  # time.monotonic()


@dataclass(frozen=True, slots=True)
class JobEnrichment:
    """What one job's enrichment came to, before its settlement is built: its result or
    error, and its share of the warehouse job (also when its result was refused)."""

    held: Held
    value: Enrichment | BaseException
    job_id: str | None = None
    billed: int = 0


class Runner:
    """Runs units of jobs on its own threads; `capacity` says how many jobs can start now."""

    def __init__(
        self,
        settings: Settings,
        jobs: Jobs,
        *,
        enricher: EnricherChoice,
        warehouse: sa.Engine,
        admission: Admission,
        settle: Callable[..., None],
        on_budget_refused: Callable[[], None],
    ) -> None:
        self._settings = settings
        self._jobs = jobs
        self._enricher = enricher
        self._warehouse = warehouse
        self._admission = admission
        self._settle = settle
        self._on_budget_refused = on_budget_refused
        self._threads = settings.concurrency * (1 + SPARE_THREADS_PER_SLOT)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="enrichq-job")
        self._lock = threading.Lock()
        self._busy = 0
        # the lookups running now (admitted, not yet handed to the settler), by unit
        self._running: dict[int, _Running] = {}
        self.errors: list[BaseException] = []  # unexpected errors of unit threads (fatal)

    @property
    def unit_size(self) -> int:
        return self._enricher.unit_size

    @property
    def max_jobs(self) -> int:
        """Jobs this process may run at once: ENRICHQ_CONCURRENCY units of `unit_size` jobs
        each (8 per-ticket calls, or 8 batches of up to 200 tickets, by default)."""
        return self._settings.concurrency * self.unit_size

    def capacity(self) -> int:
        """Jobs that can be claimed and started at once: free slots, and free threads.

        A job handed to the settler frees its slot for the next unit: the claim loop does
        not wait for the settler's commit before the next lookups start. Those jobs are
        still held until settled (within their lease: the heartbeat extends a job's lease
        only until it is handed over), up to `max_jobs` of them: a settler that cannot
        get through stops the claims at twice `max_jobs`. Not under a warehouse cap or a
        budget: there a lookup's admission is released by its settle, and the next unit
        would wait for the very slot its worker still holds (and be deferred after
        SLOT_WAIT_SECONDS).
        """
        with self._lock:
            idle_threads = self._threads - self._busy
        held, settling = self._jobs.counts()
        if self._admission.needed:
            free_slots = self.max_jobs - held
        else:
            free_slots = min(self.max_jobs - (held - settling), 2 * self.max_jobs - held)
        return max(0, min(free_slots, idle_threads * self.unit_size))

    def busy(self) -> int:
        with self._lock:
            return self._busy

    def submit(self, held: Sequence[Held]) -> None:
        """Run the jobs, a unit at a time, each unit on a thread of its own."""
        size = self.unit_size
        for start in range(0, len(held), size):
            unit = list(held[start : start + size])
            with self._lock:
                self._busy += 1
            self._pool.submit(self._run_unit, unit)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def lookups_running(self) -> list[Lookup]:
        """The lookup records of the lookups still running (a plug-in deaf to
        cancellation), for a worker that must stop without them: each ran, at a cost not
        known, so it is recorded as an error charged its share of the bytes its admission
        reserved (the expected cost), and its admission released."""
        with self._lock:
            running = list(self._running.values())
        now = time.monotonic()
        lookups: list[Lookup] = []
        for run in running:
            shares = split_bytes(run.admitted.reserved, len(run.held))
            for held, share in zip(run.held, shares, strict=True):
                lookups.append(
                    Lookup(
                        queue_id=held.id,
                        claim_token=held.job.claim_token,
                        ticket_id=held.job.key,
                        attempt=held.job.attempts,
                        job_id=None,
                        bytes_billed=share,
                        rows=0,
                        duration_ms=(now - run.began) * 1000,
                        status="error",
                        looked_up_at=database_time(held, run.began),
                        error=COST_UNKNOWN,
                        admission=run.admitted.token,
                    )
                )
        return lookups

    # -- one unit

    def _run_unit(self, unit: list[Held]) -> None:
        try:
            self._run(unit)
        except BaseException as exc:  # a bug: the runtime's supervisor stops the process
            log.exception("a job thread failed")
            metrics.worker_errors_total.labels("runner").inc()
            self.errors.append(exc)
        finally:
            with self._lock:
                self._busy -= 1

    def _run(self, unit: list[Held]) -> None:
        ready: list[Held] = []
        for held in unit:
            problem = _precheck(held)
            if problem is None:
                ready.append(held)
            else:
                self._hand_off(held, _settlement_for(held, problem, None), finished=False)
        if not ready:
            return
        # set when the whole unit is deferred, abandoned or lost: waits end, the lookup is
        # told to stop
        cancelled = threading.Event()
        with self._jobs.interruptible(ready, cancelled.set):
            # admitted before the jobs start: waiting for a slot is not running, and a job
            # whose deadline passes meanwhile is deferred with its attempt given back
            try:
                admitted = self._admission.admit(cancelled)
            except Withdrawn:
                return
            except AdmissionRefused as exc:
                if exc.reason == "budget":
                    self._on_budget_refused()
                for held in ready:
                    self._hand_off(held, _settlement_for(held, exc, None), finished=False)
                return
            started = self._jobs.start(
                ready, time.monotonic(), self._settings.attempt_deadline_seconds
            )
            if not started:
                self._admission.give_back(admitted)
                return
            deadline = min(h.deadline for h in started)
            with self._lock:
                self._running[id(unit)] = _Running(started, admitted, time.monotonic())
            try:
                outcomes, lookups = self._enrich(started, admitted, deadline, cancelled)
            except BaseException:
                self._forget(unit)
                raise
        try:
            # handed to the settler together: the lookup's bytes are charged, and its
            # admission released, in one transaction
            handed = [
                self._handed(
                    o.held,
                    _settlement_for(o.held, o.value, lookups.get(o.held.id)),
                    finished=True,
                )
                for o in outcomes
            ]
            self._settle(*(h for h in handed if h is not None))
        finally:
            self._forget(unit)

    def _forget(self, unit: list[Held]) -> None:
        with self._lock:
            self._running.pop(id(unit), None)

    def _enrich(
        self, ready: list[Held], admitted: Admitted, deadline: float, cancelled: threading.Event
    ) -> tuple[list[JobEnrichment], dict[int, Lookup]]:
        """Run the enricher for the ready jobs; their outcomes and lookup records."""
        began = time.monotonic()
        billed = 0
        outcomes: list[JobEnrichment] = []
        try:
            suspects: list[Held] = []
            rest: list[Held] = []
            for held in ready:
                suspect = is_suspect(held.job.attempts, held.job.last_error, held.job.max_attempts)
                (suspects if suspect else rest).append(held)
            if suspects:
                # their last worker vanished mid-attempt: one of them may be what killed it
                outcomes.extend(self._outcomes(suspects, deadline, cancelled, isolated=True))
            if rest:
                outcomes.extend(self._outcomes(rest, deadline, cancelled, isolated=False))
            billed = sum(o.billed for o in outcomes)
        finally:
            self._admission.learned(admitted, billed)
        duration_ms = (time.monotonic() - began) * 1000
        lookups = {o.held.id: _lookup(o, duration_ms, began, admitted) for o in outcomes}
        return outcomes, lookups

    def _outcomes(
        self, held: list[Held], deadline: float, cancelled: threading.Event, *, isolated: bool
    ) -> list[JobEnrichment]:
        """Enrich `held` in this process, or `isolated` in child processes (`isolate`)."""
        context = EnrichContext(
            self._settings,
            self._warehouse,
            cancelled,
            deadline,
            lambda fn: self._jobs.interruptible(held, fn),
            kind="-".join(sorted({h.job.kind for h in held})),
        )
        tickets = [h.ticket for h in held if h.ticket is not None]  # all are: _precheck
        values: Mapping[str, object]
        if isolated:
            for h in held:
                h.isolated = True
            try:
                values = enrich_in_child(context, tickets)
            except Exception as exc:  # no child could be started (out of processes, say)
                # inconclusive: they stay suspects (isolate.is_suspect)
                error = TransientError(f"{error_text(exc)} {STOPPED_ISOLATED}")
                return [JobEnrichment(h, error) for h in held]
        else:
            values = enrich_all(self._enricher, tickets, context)
            if _aborted_batch(values) and not cancelled.is_set():
                # a batch call raised a BaseException (PluginAborted): which ticket caused
                # it is found in child processes, halving, in this same attempt, so the
                # tickets beside it get their outcome now
                log.warning(
                    "a batch enrichment of %d tickets raised %s: enriching them in child processes",
                    len(tickets),
                    next(iter(values.values())),
                )
                return self._outcomes(held, deadline, cancelled, isolated=True)
        return [_checked(h, values[h.job.key]) for h in held]

    def _hand_off(self, held: Held, settlement: Settlement, *, finished: bool) -> None:
        handed = self._handed(held, settlement, finished=finished)
        if handed is not None:
            self._settle(handed)

    def _handed(self, held: Held, settlement: Settlement, *, finished: bool) -> Settlement | None:
        """What of `settlement` goes to the settler: all of it, or only its lookup (the job
        was abandoned or lost meanwhile: its result must not land, its lookup is charged)."""
        if self._jobs.hand_off(held, finished=finished):
            return settlement
        if settlement.lookup is not None:
            return Settlement(held, None, lookup=settlement.lookup)
        return None


def _aborted_batch(values: Mapping[str, object]) -> bool:
    """Did a batch call for several tickets raise a BaseException (not an Exception)?"""
    return any(isinstance(v, PluginAborted) and v.shared for v in values.values())


def _checked(held: Held, value: object) -> JobEnrichment:
    """One job's outcome from what the plug-in gave for it: an exception as it is, a result
    validated where it enters (an invalid one fails this job alone, still charged); a
    surcharge (bytes billed under answers the batch was not asked for) is added to it."""
    if isinstance(value, Surcharge):
        inner = _checked(held, value.value)
        return replace(
            inner, job_id=inner.job_id or value.job_id, billed=inner.billed + value.bytes_billed
        )
    if isinstance(value, BaseException):
        # a failed warehouse job still billed: the built-in lookup records each share on it
        return JobEnrichment(held, value, *charge_of(value, held.job.key))
    try:
        checked = validate(value)
    except PermanentError as exc:
        return JobEnrichment(held, exc, *charge_of(value))
    return JobEnrichment(held, checked, checked.job_id, checked.bytes_billed)


def _precheck(held: Held) -> BaseException | None:
    """Why a job cannot be enriched at all, or None."""
    job = held.job
    if job.kind not in KINDS:
        return PermanentError(f"unknown kind {job.kind!r}")
    if not isinstance(job.payload, Mapping):
        return PermanentError("payload must be a JSON object")
    if held.ticket is None:
        return NotMirrored(f"ticket {job.key!r} is not in the help-desk mirror yet")
    return None


def _settlement_for(held: Held, value: object, lookup: Lookup | None) -> Settlement:
    """The settlement of one job's outcome: a result to complete, or an error's action."""
    if isinstance(value, Enrichment):
        result = Result(held.id, held.job.key, value, lookup.looked_up_at if lookup else None)
        return Settlement(held, SettleAction.COMPLETE, result=result, lookup=lookup)
    assert isinstance(value, BaseException)
    if isinstance(value, Deferral):
        try:
            # a time without an offset, as UTC: sent as it is, it could fail its whole
            # settle group (the binary format refuses one beside a time with an offset)
            until = checked_time(value.until, "Deferral.until")
        except InvalidResult as bad:
            return Settlement(held, SettleAction.RETRY, error=error_text(bad), lookup=lookup)
        return Settlement(held, SettleAction.DEFER, until=until, lookup=lookup)
    error = error_text(value)
    if isinstance(value, PermanentError):
        return Settlement(held, SettleAction.FAIL, error=error, lookup=lookup)
    return Settlement(held, SettleAction.RETRY, error=error, lookup=lookup)


def _lookup(outcome: JobEnrichment, duration_ms: float, began: float, admitted: Admitted) -> Lookup:
    """The lookup-log record of one job's part of a lookup: its share of the warehouse job,
    whatever became of its result."""
    held, value = outcome.held, outcome.value
    if isinstance(value, Enrichment):
        status = "ok" if value.orders else "empty"
        rows, error = len(value.orders), None
    else:
        status = "deferred" if isinstance(value, Deferral) else "error"
        rows, error = 0, error_text(value)
    metrics.lookups_total.labels(status).inc()
    metrics.warehouse_bytes_billed_total.inc(outcome.billed)
    return Lookup(
        queue_id=held.id,
        claim_token=held.job.claim_token,
        ticket_id=held.job.key,
        attempt=held.job.attempts,
        job_id=outcome.job_id,
        bytes_billed=outcome.billed,
        rows=rows,
        duration_ms=duration_ms,
        status=status,
        looked_up_at=database_time(held, began),
        error=error,
        admission=admitted.token if admitted is not NOT_NEEDED else None,
    )


def database_time(held: Held, moment: float) -> datetime | None:
    """The database's time at monotonic `moment`: the claim's database time (the claim
    statement's now()) plus what the monotonic clock counted since the claim returned."""
    claimed = held.job.claimed_at
    if claimed is None:
        return None
    return claimed + timedelta(seconds=moment - held.claimed_at)
