"""The worker runtime: the claim loop, and the parts it hands work to (runner, settler,
heartbeat, listener), each thread under a supervisor."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import prometheus_client
import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from enrichq_schema import connections, metrics, runlog
from enrichq_schema.errors import constraint_name
from enrichq_schema.process import lease_owner, stop_on_signals
from enrichq_schema.settings import Settings
from enrichq_schema.states import Component, Kind, Outcome, StopReason
from enrichq_schema.tables import LEASED_KEY_INDEX
from enrichq_service import queue as q
from enrichq_service.enrich import EnricherChoice, choose, error_text, log_lookups, read_tickets
from enrichq_service.isolate import STOPPED_ISOLATED, is_suspect
from enrichq_service.terminal import say
from enrichq_service.worker.admission import Admission
from enrichq_service.worker.db import Backoff, ThreadConnection, is_unavailable
from enrichq_service.worker.engines import WorkerEngines, build_engines
from enrichq_service.worker.heartbeat import Heartbeat
from enrichq_service.worker.lifecycle import Held, Jobs
from enrichq_service.worker.listener import listen
from enrichq_service.worker.runner import Runner
from enrichq_service.worker.settler import Settlement, Settler

log = logging.getLogger(__name__)

KINDS: tuple[str, ...] = (Kind.ENRICH.value, Kind.REFRESH.value, Kind.BACKFILL.value)
# Freed slots are gathered before claiming again: until half are free or the first has
# waited this long. Claiming the moment one slot frees would shrink every claim and every
# settle to a job or two, each paying its own round trips; a slow job loses at most this.
CLAIM_GATHER_SECONDS = 0.02
# On shutdown, how long the settler may take to flush what it was handed.
FLUSH_SECONDS = 10.0
# On shutdown, how long lookups told to stop at the end of the grace may take to return
# (what they cost is then charged; one still running is recorded at an unknown cost).
LATE_LOOKUP_SECONDS = 5.0
# How long after a lookup window's boundary an idle worker claims: its cohort is visible
# by then (its rows were committed before the boundary).
WINDOW_WAKE_SLACK_SECONDS = 0.05
DEADLINE_EXCEEDED = "attempt deadline of {seconds:g} s exceeded"
SHUT_DOWN_MID_ATTEMPT = "worker shut down mid-attempt"


@dataclass
class RunResult:
    """How a worker run ended, and what it did (the `enrichq.runs` row)."""

    stop_reason: StopReason = StopReason.NO_WORK
    counts: Counter[str] = field(default_factory=Counter)
    error: str | None = None


class RunCounts:
    """The run's counts, added to by several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self._counts)


SUMMARY_SECONDS = 60.0
"""How often a running worker logs a one-line account of its work (at INFO)."""


class Summary:
    """The one-line account of a worker's work since the last one: rows claimed and their
    outcomes (from the run's tally), lookups and bytes billed (from the process's counters)."""

    def __init__(self, tally: RunCounts, *, every: float = SUMMARY_SECONDS) -> None:
        self._tally = tally
        self._every = every
        self._last_at = time.monotonic()
        self._last = self._now()

    def _now(self) -> Counter[str]:
        counts = self._tally.snapshot()
        counts["lookups"] = int(_counter_total(metrics.lookups_total))
        counts["bytes_billed"] = int(_counter_total(metrics.warehouse_bytes_billed_total))
        return counts

    def due(self) -> bool:
        """Whether a summary is due (a minute since the last)."""
        return time.monotonic() - self._last_at >= self._every

    def line(self) -> str:
        """The account since the last line (and start counting again)."""
        now, at = self._now(), time.monotonic()
        delta = now - self._last  # Counter subtraction keeps positive counts only
        seconds = at - self._last_at
        self._last, self._last_at = now, at
        parts = ", ".join(
            f"{name.replace('_', ' ')} {delta[name]:,}"
            for name in ("claimed", "done", "retry", "failed", "dead_letter", "deferred", "lost")
        )
        return (
            f"worker: last {seconds:.0f} s: {parts}; lookups {delta['lookups']:,}, "
            f"bytes billed {delta['bytes_billed']:,}"
        )


def _counter_total(counter: prometheus_client.Counter) -> float:
    """The sum of a counter's samples over all its labels."""
    return sum(
        sample.value
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )


class _WakingEvent(threading.Event):
    """An event whose setting also sets `wake`: a stop must not wait for the next poll."""

    def __init__(self, wake: threading.Event) -> None:
        super().__init__()
        self._also = wake

    def set(self) -> None:
        super().set()
        self._also.set()


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
        enricher: EnricherChoice | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.owner = owner or lease_owner()
        self.kinds = tuple(kinds)
        self._wake = threading.Event()
        # set by a signal or by the embedding process; setting it wakes the claim loop
        self.stop: threading.Event = _WakingEvent(self._wake)
        self._tally = RunCounts()
        self._fatal: str | None = None
        self._budget_refused = threading.Event()
        self._claim_conn = ThreadConnection(claims or engine)
        self.jobs = Jobs(on_lost=self._lost)
        self.admission = Admission(engine, settings, self.owner)
        self.settler = Settler(
            engine, settings, self.owner, self.jobs, counted=self._tally.add, freed=self._wake.set
        )
        self.runner = Runner(
            settings,
            self.jobs,
            enricher=enricher or choose(settings),
            warehouse=warehouse or engine,
            admission=self.admission,
            settle=self.settler.put,
            on_budget_refused=self._budget_refused.set,
        )
        self.heartbeat = Heartbeat(engine, settings, self.owner, self.jobs, self.admission)
        self._free_since: float | None = None
        # a claim failed in a way that may have committed (its COMMIT reply lost)
        self._claim_unheard = False
        metrics.start_counters_at_zero(self.kinds)
        metrics.oldest_unsettled_seconds.set_function(self.jobs.oldest_unsettled_seconds)

    # -- health, for /healthz and the supervisor

    def health(self) -> str | None:
        """Why this worker is not healthy, or None: a part stopped on an error, or a
        settlement has waited longer than a lease (the settler cannot get through)."""
        if self._fatal is not None:
            return f"worker stopped: {self._fatal}"
        waited = self.jobs.oldest_unsettled_seconds()
        if waited > self.settings.lease_seconds:
            return f"a result has waited {waited:.0f} s to be settled"
        return None

    # -- the claim loop

    def run(self, *, drain: bool = False, time_budget: float | None = None) -> RunResult:
        """Work until stopped, out of time budget, or (with `drain`) out of visible work."""
        began_at = datetime.now(UTC)
        run_id = self._start_run()
        self.heartbeat.run_id = run_id
        started = time.monotonic()
        parts_stop = threading.Event()  # heartbeat and listener
        settler_stop, settler_give_up = threading.Event(), threading.Event()
        threads = [
            self._supervised("settler", lambda: self.settler.run(settler_stop, settler_give_up)),
            self._supervised("heartbeat", lambda: self.heartbeat.run(parts_stop)),
            self._supervised("lease-watch", lambda: self.heartbeat.watch(parts_stop)),
        ]
        url = self.engine.url.render_as_string(hide_password=False)
        listen_at = connections.listen_url(self.settings, url)
        if listen_at is not None:
            params = connections.listen_connect_params(self.settings, listen_at)
            threads.append(
                self._supervised("listener", lambda: listen(params, self._wake.set, parts_stop))
            )
        else:
            log.info(
                "no LISTEN in transaction pool mode: polling every %gs", self.settings.poll_seconds
            )
        result = RunResult()
        try:
            result.stop_reason, result.error = self._claim_loop(drain, time_budget, started)
        except Exception as exc:
            log.exception("worker stopped by an unexpected error")
            metrics.worker_errors_total.labels("claims").inc()
            result.stop_reason, result.error = StopReason.ERROR, error_text(exc)
        finally:
            self._claim_conn.close()
            self._wind_down(settler_stop, settler_give_up)
            parts_stop.set()
            for t in threads:
                t.join(timeout=10)
            self.runner.shutdown()
            result.counts = self._tally.snapshot()
            self._finish_run(run_id, result, began_at)
        return result

    def _claim_loop(
        self, drain: bool, time_budget: float | None, started: float
    ) -> tuple[StopReason, str | None]:
        """Claim until a reason to stop; that reason (and the error, for `error`)."""
        backoff = Backoff()
        summary = Summary(self._tally)
        while True:
            if summary.due():
                log.info("%s", summary.line())
            if self.stop.is_set():
                return StopReason.SHUTDOWN, None
            if self.runner.errors and self._fatal is None:
                self._fatal = f"runner: {error_text(self.runner.errors[0])}"
            if self._fatal is not None:
                return StopReason.ERROR, self._fatal
            if time_budget is not None and time.monotonic() - started >= time_budget:
                return StopReason.TIME_BUDGET, None
            self._expire(time.monotonic())
            # Read before the claim: a settle that commits during the claim (after its
            # snapshot) may put a row back in the queue that this claim cannot see yet.
            idle_before = not len(self.jobs) and not self.settler.pending()
            try:
                if self._claim_unheard:
                    self._give_back_unheard()
                claimed = self._claim_round()
                backoff.reset()
            except sa_exc.SQLAlchemyError as exc:
                if not is_unavailable(exc):
                    raise
                self._claim_unheard = True
                log.warning("claim failed (%s); retrying", error_text(exc))
                self.stop.wait(backoff.next())
                continue
            if claimed:
                continue
            if drain and idle_before:
                if self._budget_refused.is_set():
                    return StopReason.BUDGET_EXHAUSTED, None
                return StopReason.NO_WORK, None
            self._wake.wait(self._idle_wait())
            self._wake.clear()

    def _give_back_unheard(self) -> None:
        """Give back the rows a claim whose COMMIT reply was lost leased to this worker,
        with the attempt it counted: the worker never heard of them, so nothing would work
        them until their leases expired and the sweeper took them as suspects."""
        held = [h.id for h in self.jobs.unsettled()]  # only this thread adds to them
        with self._claim_conn.begin() as conn:
            unheard = q.leases_not_held(conn, owner=self.owner, held_ids=held)
            given = q.defer(conn, owner=self.owner, deferrals=[(job, None) for job in unheard])
        self._claim_unheard = False
        if unheard:
            log.warning(
                "gave back %d row(s) a claim whose reply was lost had leased to this worker",
                len(given),
            )
            self._tally.add("given_back", len(given))

    def _claim_round(self) -> bool:
        """Claim as many rows as can start at once and hand them to the runner; whether it
        claimed anything (or should claim again at once)."""
        free = self.runner.capacity()
        if free <= 0:
            self._free_since = None
            return False
        now = time.monotonic()
        if self._free_since is None:
            self._free_since = now
        held_now = len(self.jobs)
        gathering = held_now and free * 2 < self.runner.max_jobs
        if gathering and now - self._free_since < CLAIM_GATHER_SECONDS:
            return False
        try:
            with self._claim_conn.begin() as conn:
                jobs = q.claim(
                    conn,
                    kinds=self.kinds,
                    owner=self.owner,
                    limit=free,
                    lease_seconds=self.settings.lease_seconds,
                    aging_seconds=self.settings.priority_aging_seconds,
                )
                tickets = read_tickets(conn, self.settings, sorted({j.key for j in jobs}))
        except sa_exc.IntegrityError as exc:
            if constraint_name(exc) != LEASED_KEY_INDEX:
                raise
            return True  # another claim of a key committed after this one's snapshot
        received = time.monotonic()
        if not jobs:
            return False
        deadline = received + self.settings.attempt_deadline_seconds
        # the lease was set by the claim, which started no earlier than `now`
        batch = [
            Held(j, tickets.get(j.key), deadline, claimed_at=received, lease_confirmed_at=now)
            for j in jobs
        ]
        self.jobs.add(batch)
        self._free_since = None
        metrics.jobs_in_flight.set(len(self.jobs))
        self._tally.add("claimed", len(jobs))
        self.runner.submit(batch)
        return True

    def _expire(self, now: float) -> None:
        """Hand attempts past their deadline to the settler: one that never started is
        deferred with its attempt given back, one that runs is retried (and told to stop)."""
        never, running = self.jobs.overdue(now)
        self._hand(
            never, running, DEADLINE_EXCEEDED.format(seconds=self.settings.attempt_deadline_seconds)
        )

    def _hand(self, never: list[Held], running: list[Held], error: str) -> None:
        for held in never:
            self.settler.put(Settlement(held, q.SettleAction.DEFER))
        for held in running:
            # a suspect stopped in its child stays one: see isolate.is_suspect
            # (or one about to be: stopped before its runner marked it)
            job = held.job
            suspect = held.isolated or is_suspect(job.attempts, job.last_error, job.max_attempts)
            said = f"{error} {STOPPED_ISOLATED}" if suspect else error
            self.settler.put(Settlement(held, q.SettleAction.RETRY, error=said))

    def _idle_wait(self) -> float:
        wait = self.settings.poll_seconds
        window = self.settings.lookup_window_seconds
        if window > 0:
            # a cohort becomes visible at the window's boundary, and nothing NOTIFYs then:
            # wake just after it (by this host's clock; the poll is the backstop for skew)
            wait = min(wait, window - time.time() % window + WINDOW_WAKE_SLACK_SECONDS)
        if self._free_since is not None and len(self.jobs):
            wait = min(wait, CLAIM_GATHER_SECONDS)
        nearest = self.jobs.nearest_deadline()
        if nearest is not None:
            wait = min(wait, max(0.01, nearest - time.monotonic()))
        return wait

    def _lost(self, held: Held) -> None:
        """The heartbeat found a lease gone (someone else's now): count it once."""
        metrics.heartbeat_lost_leases_total.inc()
        metrics.job_outcomes_total.labels(held.job.kind, Outcome.LOST.value).inc()
        self._tally.add(Outcome.LOST.value)
        self._wake.set()

    # -- the parts' threads

    def _supervised(self, name: str, body: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                body()
            except BaseException as exc:
                log.exception("the worker's %s stopped on an error", name)
                metrics.worker_errors_total.labels(name).inc()
                if self._fatal is None:
                    self._fatal = f"{name}: {error_text(exc)}"
                self._wake.set()

        thread = threading.Thread(target=run, name=f"enrichq-{name}", daemon=True)
        thread.start()
        return thread

    # -- stopping

    def _wind_down(self, settler_stop: threading.Event, give_up: threading.Event) -> None:
        """Let in-flight work finish within the grace period; give the rest back."""
        deadline = time.monotonic() + self.settings.shutdown_grace_seconds
        while len(self.jobs) and time.monotonic() < deadline and self._fatal is None:
            self._expire(time.monotonic())
            self._wake.wait(0.05)
            self._wake.clear()
        never, running = self.jobs.overdue(float("inf"))
        self._hand(never, running, SHUT_DOWN_MID_ATTEMPT)
        # The lookups told to stop may still return (a plug-in deaf to cancellation): what
        # they cost is charged by the settler, which runs until they have or time is up.
        late_deadline = time.monotonic() + LATE_LOOKUP_SECONDS
        while self.runner.busy() and time.monotonic() < late_deadline and self._fatal is None:
            time.sleep(0.02)
        settler_stop.set()
        flush_deadline = time.monotonic() + FLUSH_SECONDS
        while (len(self.jobs) or self.settler.pending()) and time.monotonic() < flush_deadline:
            time.sleep(0.02)
        give_up.set()
        self._record_lookups_left_running()

    def _record_lookups_left_running(self) -> None:
        """Record the lookups still running, which this process stops without: each ran
        at a cost not known (`Runner.lookups_running`), and its warehouse slot and bytes
        reservation are released. Recorded once per claim, like every lookup: if one
        returns after all, nothing is charged twice."""
        lookups = self.runner.lookups_running()
        if not lookups:
            return
        try:
            with self.engine.begin() as conn:
                logged = log_lookups(conn, lookups, now=None)
        except sa_exc.SQLAlchemyError as exc:
            log.warning(
                "could not record %d lookup(s) still running at stop (%s): their "
                "reservations expire a lease from now",
                len(lookups),
                error_text(exc),
            )
            return
        metrics.lookups_total.labels("error").inc(logged)
        log.warning(
            "stopping without %d lookup(s) still running past the grace period: recorded "
            "as run at an unknown cost",
            logged,
        )

    def _start_run(self) -> int | None:
        try:
            with self.engine.begin() as conn:
                return runlog.start(conn, Component.WORKER, self.owner)
        except sa_exc.SQLAlchemyError as exc:
            log.warning("could not write the run log (%s)", error_text(exc))
            return None

    def _finish_run(self, run_id: int | None, result: RunResult, began_at: datetime) -> None:
        """Close this run's row; open it first if its start could not be written (the
        worker started in an outage), so every run that ends says why. That row's start
        is the worker's clock, the only one that saw it."""
        for attempt in range(3):
            try:
                with self.engine.begin() as conn:
                    row = run_id
                    if row is None:  # in this transaction: a rolled-back try leaves no id
                        row = runlog.start(conn, Component.WORKER, self.owner, now=began_at)
                    runlog.finish(conn, row, result.stop_reason, dict(result.counts), result.error)
                return
            except sa_exc.SQLAlchemyError as exc:
                log.warning("could not finish the run log (%s)", error_text(exc))
                time.sleep(0.5 * (attempt + 1))


@contextlib.contextmanager
def worker_process(settings: Settings, url: str) -> Iterator[tuple[Worker, WorkerEngines]]:
    """A worker wired as every process that runs one has it (`worker`, `serve`, `demo`):
    its engines, the build info and queue gauges of /metrics, the worker itself."""
    from enrichq_service.observe import register_queue_collector, set_build_info

    if settings.warehouse_url and sa.make_url(settings.warehouse_url).get_backend_name() == (
        "bigquery"
    ):
        from enrichq_service import bigquery

        bigquery.preflight(settings)  # credentials, tables, columns: SettingsError, exit 2
    engines = build_engines(settings, url)
    try:
        set_build_info(settings.mode.value)
        register_queue_collector(engines.queue)
        worker = Worker(settings, engines.queue, warehouse=engines.warehouse, claims=engines.claims)
        yield worker, engines
    finally:
        engines.dispose()


def run_worker(
    settings: Settings,
    url: str,
    *,
    drain: bool = False,
    time_budget: float | None = None,
    wait_for_schema: bool = True,
) -> int:
    """`enrichq worker`: run until stopped; exit 0 on a healthy stop, 1 on an error.

    Before anything starts, the preflight (`connections.preflight`): a database that
    cannot be reached stops the worker with its error (exit 1), a pool mode that the URL
    contradicts, or a help-desk mirror (ENRICHQ_TICKETS_TABLE) that does not exist, with a
    SettingsError (exit 2); a worker never loops on either."""
    from enrichq_schema.db import await_schema, redact
    from enrichq_service.observe import start_metrics_server

    connections.preflight(settings, url, mirror=True)
    with worker_process(settings, url) as (worker, _):
        start_metrics_server(settings.metrics_port)
        log.info(
            "worker %s starting: database %s, warehouse %s, kinds %s, concurrency %d, "
            "lookup batch %d%s",
            worker.owner,
            redact(url),
            redact(settings.warehouse_url) if settings.warehouse_url else "the database",
            ",".join(worker.kinds),
            settings.concurrency,
            settings.lookup_batch_size,
            ", draining" if drain else "",
        )
        with stop_on_signals(worker.stop, doing="finishing in-flight work"):
            # before `enrichq migrate` has run: wait for it, saying so (or exit 2 when told
            # not to wait)
            if not await_schema(
                worker.engine, wait=wait_for_schema, stop=worker.stop, what="worker"
            ):
                return 0
            result = worker.run(drain=drain, time_budget=time_budget)
    log.info(
        "worker stopped (%s): %s",
        result.stop_reason.value,
        ", ".join(f"{k} {v:,}" for k, v in sorted(result.counts.items())) or "nothing done",
    )
    code = 0
    if result.stop_reason is StopReason.ERROR:
        say(f"worker stopped on an error: {result.error}")
        code = 1
    if worker.runner.busy():
        # a plug-in deaf to cancellation still holds a job thread, which the interpreter
        # would wait for at exit: its lookup is recorded (`Worker._wind_down`), go now
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
