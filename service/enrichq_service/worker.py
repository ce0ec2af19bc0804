"""The worker runtime: claim, heartbeat, enrich, settle (DESIGN §3, §4; issue 4).

Threads of one worker process:
- the claim loop (``Worker.run``): claims only as many rows as it has free slots, of every
  kind at once, in the claim's fair order;
- handlers in a thread pool: read nothing from the queue, call the enricher;
- the settler: groups finished jobs and settles them in one transaction per group
  (fenced state changes, and the results of exactly the jobs that won);
- the heartbeat: extends every held lease in one statement each ``heartbeat_seconds``;
  a lease it lost cancels its handler, and that job's result is never written;
- the listener: LISTENs on its own connection (a LISTEN that shares a connection with
  queries stalls them) and wakes the claim loop; the loop also polls as a backstop.

Losing the database is survived everywhere: each thread logs, backs off and carries on;
fencing makes a late settle harmless.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue as stdqueue
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from types import FrameType
from typing import NamedTuple

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from enrichq_schema import runlog
from enrichq_schema.db import create_engine, normalize_url
from enrichq_schema.errors import constraint_name
from enrichq_schema.states import Component, Kind, Outcome, StopReason
from enrichq_schema.tables import LEASED_KEY_INDEX
from enrichq_service import enrich, metrics
from enrichq_service import queue as q
from enrichq_service.enrich import (
    Budget,
    EnrichContext,
    Enrichment,
    Lookup,
    Ticket,
    load_enricher,
    log_lookups,
    read_budget,
    read_tickets,
    write_results,
)
from enrichq_service.errors import Deferral, PermanentError
from enrichq_service.isolate import enrich_in_child, is_suspect
from enrichq_service.settings import Settings

log = logging.getLogger(__name__)

KINDS: tuple[str, ...] = (Kind.ENRICH.value, Kind.REFRESH.value)
SETTLE_GROUP_SIZE = 50
SETTLE_GROUP_SECONDS = 0.005  # a group is flushed when full or this old
# Freed slots are gathered before claiming again: until half are free or the first has
# waited this long. Claiming the moment one slot frees would shrink every claim and every
# settle to a job or two, each paying its own round trips; a slow job loses at most this.
CLAIM_GATHER_SECONDS = 0.02
BUDGET_CACHE_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 5.0


class Action(StrEnum):
    COMPLETE = "complete"
    RETRY = "retry"
    FAIL = "fail"
    DEFER = "defer"
    DROP = "drop"  # the lease is gone: only the lookup (if any) is recorded


_SETTLE_ACTIONS = {
    Action.COMPLETE: q.SettleAction.COMPLETE,
    Action.RETRY: q.SettleAction.RETRY,
    Action.FAIL: q.SettleAction.FAIL,
    Action.DEFER: q.SettleAction.DEFER,
}


@dataclass(eq=False)
class Held:
    """A job whose lease this process holds, from claim until its settle committed."""

    job: q.Job
    ticket: Ticket | None
    deadline: float  # time.monotonic()
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    settling: bool = False  # handed to the settler; a later handler result is dropped
    claimed_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class Settlement:
    """What the settler should do with one held job."""

    held: Held
    action: Action
    enrichment: Enrichment | None = None
    error: str | None = None
    until: datetime | None = None
    lookup: Lookup | None = None


@dataclass
class RunResult:
    """How a worker run ended, and what it did (the `enrichq.runs` row)."""

    stop_reason: StopReason = StopReason.NO_WORK
    counts: Counter[str] = field(default_factory=Counter)
    error: str | None = None


def new_owner() -> str:
    """A lease owner unique to this worker: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class ThreadConnection:
    """A connection one thread keeps between its transactions (the claim loop's, the
    settler's): no pool checkout, and no ping, per transaction. After any error inside a
    transaction it is closed, so the next transaction starts on a fresh one from the pool
    (which a server restart has then invalidated)."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._conn: sa.Connection | None = None

    @contextlib.contextmanager
    def begin(self) -> Iterator[sa.Connection]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        if self._conn is None:
            self._conn = self._engine.connect()
        try:
            with self._conn.begin():
                yield self._conn
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sa_exc.DBAPIError):
                conn.close()


class Worker:
    """One worker process's runtime; `run()` blocks until it stops."""

    def __init__(
        self,
        settings: Settings,
        engine: sa.Engine,
        *,
        warehouse: sa.Engine | None = None,
        claims: sa.Engine | None = None,
        owner: str | None = None,
        kinds: Sequence[str] = KINDS,
        enricher: enrich.Enricher | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.warehouse = warehouse or engine
        self.claims = claims or engine
        self._claim_conn = ThreadConnection(self.claims)
        self._settle_conn = ThreadConnection(engine)
        self.owner = owner or new_owner()
        self.kinds = tuple(kinds)
        self.enricher = enricher or load_enricher(settings.enricher)
        self.stop = threading.Event()  # set by a signal or by the embedding process
        self._stop_claiming = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}
        self._settle_q: stdqueue.Queue[Settlement] = stdqueue.Queue()
        self._settler_done = threading.Event()
        self._threads_stop = threading.Event()
        self._budget: Budget | None = None
        self._budget_read_at = 0.0
        self._result = RunResult()
        self._last_heartbeat = time.monotonic()
        self._free_since: float | None = None
        metrics.start_counters_at_zero(self.kinds)

    # -- the claim loop

    def run(self, *, drain: bool = False, time_budget: float | None = None) -> RunResult:
        """Work until stopped, out of time budget, or (with `drain`) out of visible work."""
        run_id = self._start_run()
        started = time.monotonic()
        pool = ThreadPoolExecutor(
            # Abandoned attempts (past their deadline) may keep a thread busy for a while;
            # the spare threads keep `concurrency` slots usable meanwhile.
            max_workers=self.settings.concurrency * 2,
            thread_name_prefix="enrichq-job",
        )
        threads = [
            threading.Thread(target=self._settler, name="enrichq-settler", daemon=True),
            threading.Thread(target=self._heartbeat, name="enrichq-heartbeat", daemon=True),
            threading.Thread(target=self._listen, name="enrichq-listen", daemon=True),
        ]
        for t in threads:
            t.start()
        result = self._result
        backoff = _Backoff()
        try:
            while True:
                if self.stop.is_set():
                    result.stop_reason = StopReason.SHUTDOWN
                    break
                if time_budget is not None and time.monotonic() - started >= time_budget:
                    result.stop_reason = StopReason.TIME_BUDGET
                    break
                self._abandon_overdue()
                # Read before the claim: a settle that commits during the claim (after its
                # snapshot) may put a row back in the queue that this claim cannot see yet.
                held_before_claim = self._held_count()
                try:
                    claimed, budget = self._claim_round(pool)
                    backoff.reset()
                except sa_exc.DBAPIError as exc:
                    log.warning("claim failed (%s); retrying", _one_line(exc))
                    self.stop.wait(backoff.next())
                    continue
                if claimed:
                    continue
                if drain and not held_before_claim:
                    exhausted = budget is not None and budget.exhausted
                    result.stop_reason = (
                        StopReason.BUDGET_EXHAUSTED if exhausted else StopReason.NO_WORK
                    )
                    break
                self._wake.wait(self._idle_wait(budget))
                self._wake.clear()
        except Exception as exc:
            log.exception("worker stopped by an unexpected error")
            result.stop_reason = StopReason.ERROR
            result.error = _one_line(exc)
        finally:
            self._stop_claiming.set()
            self._claim_conn.close()
            self._wind_down(pool)
            self._threads_stop.set()
            for t in threads:
                t.join(timeout=10)
            self._finish_run(run_id, result)
        return result

    def _claim_round(self, pool: ThreadPoolExecutor) -> tuple[bool, Budget | None]:
        """Claim one batch (every kind, in the claim's fair order); dispatch it."""
        in_flight = self._held_count()
        free = self.settings.concurrency - in_flight
        # With the budget spent, work is still claimed: its handler defers it to the reset,
        # so it stops counting as visible backlog instead of waiting in plain sight.
        budget = self._read_budget()
        if free <= 0:
            self._free_since = None
            return False, budget
        now = time.monotonic()
        if self._free_since is None:
            self._free_since = now
        gathering = in_flight and free * 2 < self.settings.concurrency
        if gathering and now - self._free_since < CLAIM_GATHER_SECONDS:
            return False, budget
        lease = self.settings.lease_seconds
        try:
            with self._claim_conn.begin() as conn:
                jobs = q.claim(
                    conn,
                    kinds=self.kinds,
                    owner=self.owner,
                    limit=free,
                    lease_seconds=lease,
                    aging_seconds=self.settings.priority_aging_seconds,
                )
                tickets = read_tickets(conn, self.settings, sorted({j.key for j in jobs}))
        except sa_exc.IntegrityError as exc:
            if constraint_name(exc) != LEASED_KEY_INDEX:
                raise
            # another claim of one of these keys committed after this claim's snapshot:
            # a new claim sees its lease
            return True, budget
        if not jobs:
            return False, budget
        deadline = time.monotonic() + self.settings.attempt_deadline_seconds
        with self._lock:
            batch = [Held(j, tickets.get(j.key), deadline) for j in jobs]
            self._held.update((h.job.id, h) for h in batch)
        self._free_since = None
        metrics.jobs_in_flight.set(self._held_count())
        self._result.counts["claimed"] += len(jobs)
        for job in batch:
            pool.submit(self._execute, job)
        return True, budget

    def _idle_wait(self, budget: Budget | None) -> float:
        wait = self.settings.poll_seconds
        if self._free_since is not None and self._held_count():
            wait = min(wait, CLAIM_GATHER_SECONDS)
        with self._lock:
            if self._held:
                wait = min(
                    wait, max(0.01, min(h.deadline for h in self._held.values()) - time.monotonic())
                )
        return wait

    def _held_count(self) -> int:
        with self._lock:
            return len(self._held)

    def _read_budget(self) -> Budget | None:
        limit = self.settings.daily_bytes_budget
        if limit <= 0:
            return None
        if self._budget is None or time.monotonic() - self._budget_read_at > BUDGET_CACHE_SECONDS:
            with self.engine.connect() as conn:
                self._budget = read_budget(conn, limit)
            self._budget_read_at = time.monotonic()
            metrics.budget_exhausted.set(1 if self._budget.exhausted else 0)
        return self._budget

    # -- one job

    def _execute(self, held: Held) -> None:
        """Run one job in a pool thread and hand its outcome to the settler."""
        if self._stop_claiming.is_set() and not held.started:
            # Shutting down before the job started: give it back, attempt and all.
            self._settle(Settlement(held, Action.DEFER))
            return
        held.started = True
        job = held.job
        lookup: Lookup | None = None
        try:
            if job.kind not in KINDS:
                raise PermanentError(f"unknown kind {job.kind!r}")
            if not isinstance(job.payload, Mapping):
                raise PermanentError("payload must be a JSON object")
            if held.ticket is None:
                raise _NotMirrored(f"ticket {job.key!r} is not in the help-desk mirror yet")
            budget = self._read_budget()
            if budget is not None and budget.exhausted:
                raise Deferral(budget.resets_at, "daily warehouse bytes budget spent")
            context = EnrichContext(self.settings, self.warehouse, held.cancelled, held.deadline)
            lookup_start = time.perf_counter()
            try:
                if is_suspect(job.attempts, job.last_error):
                    # its last worker vanished mid-attempt: it may be what killed it
                    enrichment = enrich_in_child(
                        self.settings,
                        self.warehouse.url.render_as_string(hide_password=False),
                        held.ticket,
                        timeout=max(1.0, held.deadline - time.monotonic()),
                    )
                else:
                    enrichment = self.enricher(held.ticket, context)
            except Exception as exc:
                status = "deferred" if isinstance(exc, Deferral) else "error"
                lookup = self._lookup(held, None, lookup_start, status, _one_line(exc))
                raise
            lookup = self._lookup(held, enrichment, lookup_start, "ok", None)
            settlement = Settlement(held, Action.COMPLETE, enrichment=enrichment, lookup=lookup)
        except Deferral as exc:
            settlement = Settlement(held, Action.DEFER, until=exc.until, lookup=lookup)
        except PermanentError as exc:
            settlement = Settlement(held, Action.FAIL, error=_one_line(exc), lookup=lookup)
        except Exception as exc:  # anything else is worth a retry
            settlement = Settlement(held, Action.RETRY, error=_one_line(exc), lookup=lookup)
        if held.cancelled.is_set():
            # Lease lost or attempt abandoned: nothing this attempt computed may land.
            settlement = Settlement(held, Action.DROP, lookup=lookup)
        self._settle(settlement)

    def _lookup(
        self,
        held: Held,
        enrichment: Enrichment | None,
        start: float,
        status: str,
        error: str | None,
    ) -> Lookup:
        rows = len(enrichment.orders) if enrichment else 0
        if status == "ok" and rows == 0:
            status = "empty"
        billed = enrichment.bytes_billed if enrichment else 0
        metrics.lookups_total.labels(status).inc()
        metrics.warehouse_bytes_billed_total.inc(billed)
        return Lookup(
            queue_id=held.job.id,
            ticket_id=held.job.key,
            attempt=held.job.attempts,
            job_id=enrichment.job_id if enrichment else None,
            bytes_billed=billed,
            rows=rows,
            duration_ms=(time.perf_counter() - start) * 1000,
            status=status,
            error=error,
        )

    def _settle(self, settlement: Settlement) -> None:
        with self._lock:
            held = settlement.held
            if held.settling and settlement.action is not Action.DROP:
                return  # already abandoned and settled by the claim loop
            if held.settling:
                # The abandoned attempt came back late: record its lookup only.
                if settlement.lookup is not None:
                    self._settle_q.put(settlement)
                return
            held.settling = True
        self._settle_q.put(settlement)

    def _abandon_overdue(self) -> None:
        """Attempts past their deadline are cancelled and retried."""
        now = time.monotonic()
        with self._lock:
            overdue = [h for h in self._held.values() if not h.settling and h.deadline <= now]
        for held in overdue:
            held.cancelled.set()
            error = f"attempt deadline of {self.settings.attempt_deadline_seconds:g} s exceeded"
            self._settle(Settlement(held, Action.RETRY, error=error))

    # -- settling

    def _settler(self) -> None:
        backoff = _Backoff()
        pending: list[Settlement] = []
        while True:
            if not pending:
                try:
                    pending.append(self._settle_q.get(timeout=0.1))
                except stdqueue.Empty:
                    if self._threads_stop.is_set():
                        break
                    continue
            first_at = time.monotonic()
            while len(pending) < SETTLE_GROUP_SIZE:
                left = SETTLE_GROUP_SECONDS - (time.monotonic() - first_at)
                try:
                    pending.append(self._settle_q.get(timeout=max(left, 0)))
                except stdqueue.Empty:
                    break
            try:
                self._flush(pending)
                pending = []
                backoff.reset()
            except sa_exc.DBAPIError as exc:
                log.warning("settle failed (%s); retrying", _one_line(exc))
                time.sleep(backoff.next())
        self._settle_conn.close()
        self._settler_done.set()

    def _flush(self, group: Sequence[Settlement]) -> None:
        """Settle a group in one transaction: fenced state changes, then the winners' results."""
        by_action: dict[Action, list[Settlement]] = {a: [] for a in Action}
        for s in group:
            by_action[s.action].append(s)
        settles = [
            q.Settle(s.held.job, _SETTLE_ACTIONS[s.action], error=s.error, until=s.until)
            for s in group
            if s.action is not Action.DROP
        ]
        with self._settle_conn.begin() as conn:
            outcomes = q.settle(
                conn,
                owner=self.owner,
                settles=settles,
                backoff_base_seconds=self.settings.backoff_base_seconds,
                backoff_cap_seconds=self.settings.backoff_cap_seconds,
            )
            done = by_action[Action.COMPLETE]
            write_results(
                conn,
                {
                    s.held.job.id: (s.held.job.key, s.enrichment)
                    for s in done
                    if outcomes.get(s.held.job.id) is Outcome.DONE and s.enrichment is not None
                },
                looked_up_at=datetime.now(UTC),
            )
            lookups = [s.lookup for s in group if s.lookup is not None]
            log_lookups(conn, lookups, now=None)
        if any(x.bytes_billed for x in lookups):
            self._budget_read_at = 0.0  # the ledger moved: read it again before the next job
        self._account(group, outcomes)

    def _account(self, group: Sequence[Settlement], outcomes: Mapping[int, Outcome]) -> None:
        now = time.monotonic()
        counts = self._result.counts
        with self._lock:
            for s in group:
                job = s.held.job
                if self._held.get(job.id) is s.held:
                    del self._held[job.id]
                elif s.action is Action.DROP:
                    continue  # a late lookup of an attempt already settled
                outcome = outcomes.get(job.id, Outcome.LOST)
                counts[outcome.value] += 1
                metrics.job_outcomes_total.labels(job.kind, outcome.value).inc()
                metrics.job_duration_seconds.labels(job.kind, outcome.value).observe(
                    now - s.held.claimed_at
                )
            metrics.jobs_in_flight.set(len(self._held))
        self._wake.set()  # slots are free again

    # -- heartbeat

    def _heartbeat(self) -> None:
        period = self.settings.heartbeat_seconds
        while not self._threads_stop.wait(period):
            with self._lock:
                held = list(self._held.values())
            metrics.heartbeat_lag_seconds.set(time.monotonic() - self._last_heartbeat)
            if not held:
                self._last_heartbeat = time.monotonic()
                continue
            try:
                with self.engine.begin() as conn:
                    lost = q.heartbeat(
                        conn,
                        owner=self.owner,
                        jobs=[h.job for h in held],
                        lease_seconds=self.settings.lease_seconds,
                    )
                self._last_heartbeat = time.monotonic()
            except sa_exc.DBAPIError as exc:
                metrics.heartbeat_failures_total.inc()
                log.warning("heartbeat failed (%s)", _one_line(exc))
                continue
            for h in held:
                if h.job.id in lost:
                    # Someone else may own this row now: stop the handler, write nothing.
                    h.cancelled.set()
                    self._settle(Settlement(h, Action.DROP))

    # -- wakeups

    def _listen(self) -> None:
        import psycopg

        conninfo = normalize_url(self.engine.url).set(drivername="postgresql")
        dsn = conninfo.render_as_string(hide_password=False)
        backoff = _Backoff()
        while not self._threads_stop.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {q.NOTIFY_CHANNEL}")
                    backoff.reset()
                    while not self._threads_stop.is_set():
                        for _ in conn.notifies(timeout=1.0, stop_after=1):
                            self._wake.set()
            except psycopg.Error as exc:
                log.info("LISTEN connection lost (%s); polling meanwhile", _one_line(exc))
                self._threads_stop.wait(backoff.next())

    # -- stopping

    def _wind_down(self, pool: ThreadPoolExecutor) -> None:
        """Let in-flight work finish within the grace period; give the rest back."""
        deadline = time.monotonic() + self.settings.shutdown_grace_seconds
        while self._held_count() and time.monotonic() < deadline:
            self._abandon_overdue()
            self._wake.wait(0.05)
            self._wake.clear()
        with self._lock:
            leftovers = [h for h in self._held.values() if not h.settling]
        for held in leftovers:
            held.cancelled.set()
            if held.started:
                self._settle(Settlement(held, Action.RETRY, error="worker shut down mid-attempt"))
            else:
                self._settle(Settlement(held, Action.DEFER))
        flush_deadline = time.monotonic() + 10
        while self._held_count() and time.monotonic() < flush_deadline:
            time.sleep(0.02)
        pool.shutdown(wait=False, cancel_futures=True)

    def _start_run(self) -> int | None:
        try:
            with self.engine.begin() as conn:
                return runlog.start(conn, Component.WORKER, self.owner)
        except sa_exc.DBAPIError as exc:
            log.warning("could not write the run log (%s)", _one_line(exc))
            return None

    def _finish_run(self, run_id: int | None, result: RunResult) -> None:
        if run_id is None:
            return
        for attempt in range(3):
            try:
                with self.engine.begin() as conn:
                    runlog.finish(
                        conn, run_id, result.stop_reason, dict(result.counts), result.error
                    )
                return
            except sa_exc.DBAPIError as exc:
                log.warning("could not finish the run log (%s)", _one_line(exc))
                time.sleep(0.5 * (attempt + 1))


class _NotMirrored(Exception):
    """The ticket is not in the help-desk mirror yet: transient, retried with backoff."""


class _Backoff:
    """Capped exponential backoff for reconnecting."""

    def __init__(self) -> None:
        self._n = 0

    def next(self) -> float:
        self._n += 1
        return float(min(BACKOFF_MAX_SECONDS, 0.1 * 2.0**self._n))

    def reset(self) -> None:
        self._n = 0


def _one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:500]


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT stop the worker gracefully (main thread only)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: finishing in-flight work", signal.Signals(signum).name)
        stop.set()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class WorkerEngines(NamedTuple):
    """The connection pools of one worker process."""

    queue: sa.Engine  # settles, heartbeats, run log, HTTP (serve), metrics
    claims: sa.Engine  # the claim loop only
    warehouse: sa.Engine  # lookups

    def dispose(self) -> None:
        for engine in self:
            engine.dispose()


def build_engines(settings: Settings, url: str) -> WorkerEngines:
    """The queue, claim and warehouse engines of a worker.

    The warehouse always gets a pool of its own, sized to the concurrency, even when it is
    the same database: slow lookups must never hold the connections that claims,
    heartbeats and settles need, or a slow warehouse would let leases expire.

    The claim loop gets one connection of its own, tuned for its two statements (the claim
    and the ticket read, whose generic plans tests/db/test_queue_plans.py checks): the
    prepared claim keeps its generic plan instead of being planned again on every call
    (planning cost about as much as running it), claims commit asynchronously (one that a
    server crash undoes only returns its rows to the queue, and the fence refuses whatever
    this worker then settles for them), and no ping precedes each checkout, since a failed
    claim is simply retried.
    """
    # A worker frozen mid-transaction (SIGSTOP, a VM pause) would hold the row locks of its
    # claim or settle, and the sweeper would wait on them: the server ends such a session
    # after one lease, the time after which its work is someone else's anyway.
    session = functools.partial(
        create_engine,
        url,
        statement_timeout_seconds=settings.statement_timeout_seconds,
        idle_in_transaction_timeout_seconds=settings.lease_seconds,
    )
    queue = session(application_name="enrichq-worker", pool_size=4)
    claims = session(
        application_name="enrichq-worker-claims",
        pool_size=1,
        pre_ping=False,
        generic_plans=True,
        asynchronous_commit=True,
    )
    warehouse = create_engine(
        settings.warehouse_url or url,
        application_name="enrichq-warehouse",
        pool_size=settings.concurrency,
    )
    return WorkerEngines(queue, claims, warehouse)


def run_worker(
    settings: Settings, url: str, *, drain: bool = False, time_budget: float | None = None
) -> int:
    """`enrichq worker`: run until stopped; exit 0 on a healthy stop, 1 on an error."""
    from enrichq_service.observe import (
        register_queue_collector,
        set_build_info,
        start_metrics_server,
    )

    engines = build_engines(settings, url)
    worker = Worker(settings, engines.queue, warehouse=engines.warehouse, claims=engines.claims)
    set_build_info(settings.mode.value)
    register_queue_collector(engines.queue)
    start_metrics_server(settings.metrics_port)
    try:
        with stop_on_signals(worker.stop):
            result = worker.run(drain=drain, time_budget=time_budget)
    finally:
        engines.dispose()
    log.info("worker stopped: %s %s", result.stop_reason.value, dict(result.counts))
    return 1 if result.stop_reason is StopReason.ERROR else 0
