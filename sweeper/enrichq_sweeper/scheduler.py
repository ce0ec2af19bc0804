"""`enrichq sweep`: elect one leader among the replicas, then run the sweeper's tasks on a
schedule."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from enrichq_schema import metrics
from enrichq_schema.db import await_schema, redact
from enrichq_schema.metrics import metrics_port_problem
from enrichq_schema.process import Exit, process_id, stop_on_signals
from enrichq_schema.settings import Settings
from enrichq_sweeper import passes
from enrichq_sweeper.errors import HookError
from enrichq_sweeper.leader import Leadership, check_seconds, leadership
from enrichq_sweeper.recovery import GaveUpHook, load_hook

log = logging.getLogger(__name__)

RETENTION_INTERVAL_SECONDS = 86_400.0
SECONDS_PER_HOUR = 3600.0
SCHEDULER_THREADS = 4


# A task the caller adds to the leader's schedule: (settings, database URL) -> None. The
# sweeper runs parity this way without importing it (`enrichq sweep` passes
# enrichq_parity.parity.run_scheduled), so the sweeper and parity stay side by side.
ScheduledTask = Callable[[Settings, str], None]


@dataclass(frozen=True, slots=True)
class _Tasks:
    """The leader's jobs over one engine; `should_stop` ends a pass between batches."""

    engine: sa.Engine
    settings: Settings
    url: str
    hook: GaveUpHook
    owner: str
    should_stop: Callable[[], bool]
    scheduled_parity: ScheduledTask | None = None

    def recovery(self) -> bool:
        report = passes.recovery_pass(
            self.engine,
            self.settings,
            gave_up_hook=self.hook,
            should_stop=self.should_stop,
            owner=self.owner,
        )
        return report.ok

    def retention(self) -> bool:
        report = passes.retention_pass(
            self.engine, self.settings, should_stop=self.should_stop, owner=self.owner
        )
        return report.ok

    def refresh(self) -> bool:
        return passes.refresh_pass(self.engine, self.settings, owner=self.owner).ok

    def reconcile(self) -> bool:
        report = passes.reconcile_pass(
            self.engine, self.settings, should_stop=self.should_stop, owner=self.owner
        )
        return report.ok

    def counts(self) -> bool:
        return passes.counts_pass(self.engine, self.settings, owner=self.owner).ok

    def parity(self) -> bool:
        if self.scheduled_parity is None:
            log.error("scheduled parity skipped: this sweeper was started without it")
            return False
        try:
            self.scheduled_parity(self.settings, self.url)
        except Exception:
            log.exception("scheduled parity failed")
            return False
        return True

    def schedule(self) -> list[tuple[str, Callable[[], bool], float]]:
        """(name, job, interval in seconds) of every task this configuration runs."""
        jobs: list[tuple[str, Callable[[], bool], float]] = [
            ("recovery", self.recovery, self.settings.sweep_interval_seconds),
            ("retention", self.retention, RETENTION_INTERVAL_SECONDS),
            ("refresh", self.refresh, self.settings.refresh_interval_seconds),
            # the terminal counts /metrics reads, as fresh as lease recovery
            ("counts", self.counts, self.settings.sweep_interval_seconds),
        ]
        if self.settings.reconcile_interval_seconds > 0:
            jobs.append(("reconcile", self.reconcile, self.settings.reconcile_interval_seconds))
        if self.settings.parity_interval_hours > 0:
            hours = self.settings.parity_interval_hours
            jobs.append(("parity", self.parity, hours * SECONDS_PER_HOUR))
        return jobs


def _start_scheduler(tasks: _Tasks) -> Any:
    """A running APScheduler BackgroundScheduler with every task due now."""
    from apscheduler.executors.pool import ThreadPoolExecutor
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.interval import IntervalTrigger

    scheduler = BackgroundScheduler(
        timezone=UTC,
        executors={"default": ThreadPoolExecutor(SCHEDULER_THREADS)},
        # A pass that overruns its interval is not run twice at once, nor caught up later.
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
    )
    first = datetime.now(UTC)
    for name, job, seconds in tasks.schedule():
        scheduler.add_job(
            job,
            IntervalTrigger(seconds=seconds, timezone=UTC),
            id=name,
            name=name,
            next_run_time=first,
        )
    scheduler.start()
    return scheduler


def _quiet_apscheduler(settings: Settings) -> None:
    """APScheduler logs every job start and end at INFO; keep that for DEBUG only."""
    if settings.log_level != "DEBUG":
        logging.getLogger("apscheduler").setLevel(logging.WARNING)


def run_sweeper(
    settings: Settings,
    url: str,
    *,
    once: bool,
    tell: Callable[[str], None],
    scheduled_parity: ScheduledTask | None = None,
    wait_for_schema: bool = True,
) -> int:
    """Run the sweeper until SIGTERM/SIGINT (or each task once with `once`); the exit code.
    `tell` says one line to the operator (a refused setting, a failed pass).

    With ENRICHQ_PARITY_INTERVAL_HOURS set, the leader also runs `scheduled_parity`."""
    from enrichq_schema.connections import engine_from_settings, preflight

    try:
        hook = load_hook(settings.gave_up_hook)
    except HookError as exc:
        tell(f"invalid setting ENRICHQ_GAVE_UP_HOOK: {exc}")
        return Exit.USAGE
    # a pool mode the URL contradicts, or no mirror table (refresh and reconcile read it):
    # exit 2, before anything else
    preflight(settings, url, mirror=True)
    owner = process_id()
    engine = engine_from_settings(
        settings,
        url,
        application_name="enrichq-sweeper",
        pool_size=SCHEDULER_THREADS,
        statement_timeout_seconds=settings.statement_timeout_seconds,
    )
    lock = leadership(settings, url, owner=owner, check_seconds=check_seconds(settings))
    sweeper = _Sweeper(engine, settings, url, hook, owner, lock, tell, scheduled_parity)
    try:
        _quiet_apscheduler(settings)
        with stop_on_signals(sweeper.stop):
            # before `enrichq migrate` has run: wait for it, saying so (or exit 2 when told
            # not to wait)
            if not await_schema(engine, wait=wait_for_schema, stop=sweeper.stop, what="sweep"):
                return Exit.OK
            if once:
                return sweeper.run_once()
            if settings.metrics_port:
                from prometheus_client import start_http_server

                try:
                    start_http_server(settings.metrics_port)
                except OSError as exc:
                    tell(metrics_port_problem(settings.metrics_port, exc))
                    return Exit.USAGE
            return sweeper.lead_or_follow()
    finally:
        metrics.sweeper_is_leader.set(0)
        sweeper.lock.close()
        engine.dispose()


@dataclass
class _Sweeper:
    """One sweeper process: its engine, its leader lock and its stop signal."""

    engine: sa.Engine
    settings: Settings
    url: str
    hook: GaveUpHook
    owner: str
    lock: Leadership
    tell: Callable[[str], None]
    scheduled_parity: ScheduledTask | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def tasks(self, should_stop: Callable[[], bool]) -> _Tasks:
        return _Tasks(
            self.engine,
            self.settings,
            self.url,
            self.hook,
            self.owner,
            should_stop,
            self.scheduled_parity,
        )

    def run_once(self) -> int:
        """Every task once, if no other sweeper leads; 1 when a task failed or the
        leadership was lost on the way (the pass then stops before its next batch)."""
        if not self.lock.try_acquire():
            log.warning("another sweeper holds the leader lock and runs these tasks; nothing done")
            return Exit.OK
        metrics.sweeper_is_leader.set(1)
        lost = threading.Event()
        done = threading.Event()

        def keep_leading() -> None:
            # the lease renewed (or the lock's session checked) every check, as the
            # scheduled sweeper does, for as long as the tasks run
            while not done.wait(check_seconds(self.settings)):
                if not self.lock.still_held():
                    log.warning("sweeper %s lost the leadership; stopping", self.owner)
                    lost.set()
                    return

        keeper = threading.Thread(target=keep_leading, name="sweeper-leadership", daemon=True)
        keeper.start()

        def should_stop() -> bool:
            return self.stop.is_set() or lost.is_set()

        failed = []
        schedule = self.tasks(should_stop).schedule()
        log.info(
            "sweep --once as %s: %s, on %s",
            self.owner,
            ", ".join(name for name, _, _ in schedule),
            redact(self.url),
        )
        try:
            for name, job, _ in schedule:
                if should_stop():
                    break
                if not job():
                    failed.append(name)
        finally:
            done.set()
            keeper.join()
            self.lock.release()
            metrics.sweeper_is_leader.set(0)
        if lost.is_set():
            self.tell("sweep --once: the leadership was lost during the pass; stopped early")
            return Exit.FAILED
        if failed:
            self.tell(f"sweep --once: {', '.join(failed)} failed (see the log)")
            return Exit.FAILED
        log.info("sweep --once done: every task ran")
        return Exit.OK

    def lead_or_follow(self) -> int:
        """Follow until the lock is free, lead while it is held, until `stop` is set."""
        retry_seconds = check_seconds(self.settings)
        scheduler: Any = None
        leading = threading.Event()

        def should_stop() -> bool:
            return self.stop.is_set() or not leading.is_set()

        def step_down() -> None:
            nonlocal scheduler
            leading.clear()
            metrics.sweeper_is_leader.set(0)
            if scheduler is not None:
                # Running passes see `leading` cleared and stop after their current batch.
                scheduler.shutdown(wait=True)
                scheduler = None

        log.info("sweeper %s started; waiting for the leader lock", self.owner)
        try:
            while not self.stop.is_set():
                if scheduler is None:
                    try:
                        acquired = self.lock.try_acquire()
                    except Exception as exc:
                        log.warning("leader lock unavailable: %s", type(exc).__name__)
                        acquired = False
                    if acquired:
                        log.info("sweeper %s is the leader", self.owner)
                        leading.set()
                        metrics.sweeper_is_leader.set(1)
                        scheduler = _start_scheduler(self.tasks(should_stop))
                elif not self.lock.still_held():
                    log.warning("sweeper %s lost the leader lock; stepping down", self.owner)
                    step_down()
                self.stop.wait(retry_seconds)
        finally:
            step_down()
            self.lock.release()
        log.info("sweeper %s stopped", self.owner)
        return Exit.OK
