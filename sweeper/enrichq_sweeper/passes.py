"""One sweeper pass of each task, as the scheduler runs it: the run-log row and the metrics.

Every pass writes one `enrichq.runs` row (opened when it starts, closed with its stop
reason and counts when it ends) and updates the sweeper metrics. A pass that fails is
logged and recorded with stop reason `error`; it never stops the scheduler.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Concatenate, ParamSpec, TypedDict, Unpack, cast

import sqlalchemy as sa

from enrichq_schema import metrics, runlog
from enrichq_schema.process import process_id
from enrichq_schema.settings import Settings
from enrichq_schema.states import Component, DeadReason, StopReason
from enrichq_schema.text import error_line
from enrichq_sweeper import counts, reconcile, recovery, refresh, retention

log = logging.getLogger(__name__)

ERROR_MAX_CHARS = 1000
# An open worker run whose heartbeat has not stamped it for this many leases is lost (its
# heartbeat stamps it at least twice a lease); sweeper and parity runs, stamped only when
# they start, after a day.
RUN_LOST_AFTER_LEASES = 3
RUN_LOST_AFTER_SECONDS_OTHERS = 86_400.0
# Lost runs closed per transaction.
LOST_RUNS_BATCH = 1000


class Task(StrEnum):
    """The sweeper's periodic tasks (the `task` label and the run log's counts.task)."""

    RECOVERY = "recovery"
    RETENTION = "retention"
    REFRESH = "refresh"
    COUNTS = "counts"
    RECONCILE = "reconcile"


# What a pass's body returns: its run-log counts, and whether it was asked to stop.
PassCounts = tuple[dict[str, float], bool]


@dataclass(frozen=True, slots=True)
class PassReport:
    """How one pass ended: its stop reason, the counts written to the run log, the error."""

    task: Task
    stop_reason: StopReason
    counts: dict[str, object] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the pass finished without an error."""
        return self.stop_reason is not StopReason.ERROR


def _counts(task: Task, duration: float, **values: float) -> dict[str, object]:
    base: dict[str, object] = {
        "task": task.value,
        "promoted": 0,
        "superseded": 0,
        "exhausted": 0,
        "pruned": 0,
    }
    base.update(values)
    base["duration_seconds"] = round(duration, 6)
    return base


def run_pass(
    engine: sa.Engine,
    task: Task,
    body: Callable[[], PassCounts],
    *,
    owner: str | None = None,
) -> PassReport:
    """Run `body` (returning its counts and whether it was stopped) inside a run-log row."""
    owner = owner or process_id()
    run_id: int | None = None
    try:
        with engine.begin() as conn:
            run_id = runlog.start(conn, Component.SWEEPER, owner, counts={"task": task.value})
    except Exception as exc:
        # The pass would fail the same way; say so once and let the next pass try again.
        log.error("sweeper %s pass not started: %s", task.value, error_line(exc, ERROR_MAX_CHARS))
        return PassReport(
            task, StopReason.ERROR, {"task": task.value}, error_line(exc, ERROR_MAX_CHARS)
        )
    started = time.perf_counter()
    error: str | None = None
    try:
        values, stopped = body()
        stop_reason = StopReason.SHUTDOWN if stopped else StopReason.NO_WORK
    except Exception as exc:
        log.exception("sweeper %s pass failed", task.value)
        values, stop_reason, error = {}, StopReason.ERROR, error_line(exc, ERROR_MAX_CHARS)
    counts = _counts(task, time.perf_counter() - started, **values)
    try:
        with engine.begin() as conn:
            runlog.finish(conn, run_id, stop_reason, counts, error)
    except Exception as exc:
        log.error(
            "sweeper %s pass: run log not closed: %s", task.value, error_line(exc, ERROR_MAX_CHARS)
        )
    if stop_reason is not StopReason.ERROR:
        metrics.sweeper_last_pass_timestamp_seconds.labels(task.value).set_to_current_time()
        # a pass that changed something says so at INFO; an idle one only at DEBUG
        did = {k: v for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool)}
        log.log(
            logging.INFO if any(did.values()) else logging.DEBUG,
            "sweeper %s pass: %s (%.2f s)",
            task.value,
            ", ".join(f"{k} {v:,}" for k, v in did.items()) or "nothing to do",
            counts.get("duration_seconds", 0.0),
        )
    return PassReport(task, stop_reason, counts, error)


class PassOptions(TypedDict, total=False):
    """What every pass takes beside its engine and settings (each may be left out)."""

    now: datetime | None  # a test's clock; None = the database's
    should_stop: Callable[[], bool] | None  # asked between batches: end the pass early
    owner: str | None  # the run log's owner; None = this process


P = ParamSpec("P")


def logged(
    task: Task,
) -> Callable[
    [Callable[Concatenate[sa.Engine, Settings, P], PassCounts]],
    Callable[Concatenate[sa.Engine, Settings, P], PassReport],
]:
    """The pass whose work is the decorated body, run inside its run-log row (`run_pass`)."""

    def decorate(
        body: Callable[Concatenate[sa.Engine, Settings, P], PassCounts],
    ) -> Callable[Concatenate[sa.Engine, Settings, P], PassReport]:
        @functools.wraps(body)
        def logged_pass(
            engine: sa.Engine, settings: Settings, /, *args: P.args, **kwargs: P.kwargs
        ) -> PassReport:
            owner = cast("str | None", kwargs.get("owner"))
            work = functools.partial(body, engine, settings, *args, **kwargs)
            return run_pass(engine, task, work, owner=owner)

        return logged_pass

    return decorate


@logged(Task.RECOVERY)
def recovery_pass(
    engine: sa.Engine,
    settings: Settings,
    *,
    gave_up_hook: recovery.GaveUpHook | None = recovery.log_gave_up,
    **options: Unpack[PassOptions],
) -> PassCounts:
    """One lease-recovery pass, then the silent runs closed as lost; logged and counted."""
    result = recovery.run_once(
        engine,
        now=options.get("now"),
        gave_up_hook=gave_up_hook,
        statement_timeout_seconds=settings.statement_timeout_seconds,
        should_stop=options.get("should_stop"),
    )
    metrics.sweeper_lease_expiries_total.inc(result.recovered)
    metrics.sweeper_promoted_total.inc(result.promoted)
    for reason, n in (
        (DeadReason.SUPERSEDED, result.superseded),
        (DeadReason.ATTEMPTS_EXHAUSTED, result.exhausted),
    ):
        metrics.sweeper_dead_letters_total.labels(reason.value).inc(n)
    if result.recovered:
        log.info(
            "recovered %d expired lease(s): %d promoted, %d superseded, %d exhausted",
            result.recovered,
            result.promoted,
            result.superseded,
            result.exhausted,
        )
    lost = close_lost_runs(engine, settings, now=options.get("now"))
    return {**result.counts(), "lost_runs": lost}, result.stopped


def close_lost_runs(engine: sa.Engine, settings: Settings, *, now: datetime | None = None) -> int:
    """Close the open runs that went silent (stop reason `lost`), a page per transaction, so
    retention prunes them like any finished run; how many."""
    closed = 0
    while True:
        with engine.begin() as conn:
            by_component = runlog.close_silent(
                conn,
                worker_silent_seconds=RUN_LOST_AFTER_LEASES * settings.lease_seconds,
                other_silent_seconds=RUN_LOST_AFTER_SECONDS_OTHERS,
                limit=LOST_RUNS_BATCH,
                now=now,
            )
        page = sum(by_component.values())
        closed += page
        for component, n in by_component.items():
            log.warning("closed %d %s run(s) that gave no sign of life as lost", n, component)
        if page < LOST_RUNS_BATCH:
            return closed


@logged(Task.REFRESH)
def refresh_pass(
    engine: sa.Engine, settings: Settings, **options: Unpack[PassOptions]
) -> PassCounts:
    """One refresh-enqueue pass (one statement: `should_stop` is not asked), logged and counted."""
    enqueued = refresh.run_once(engine, settings, now=options.get("now"))
    metrics.sweeper_refresh_enqueued_total.inc(enqueued)
    if enqueued:
        log.info("enqueued %d refresh row(s)", enqueued)
    return {"enqueued": enqueued}, False


@logged(Task.RECONCILE)
def reconcile_pass(
    engine: sa.Engine, settings: Settings, **options: Unpack[PassOptions]
) -> PassCounts:
    """One reconcile pass (tickets changed with no event for the change), logged and counted."""
    result = reconcile.run_once(
        engine, settings, now=options.get("now"), should_stop=options.get("should_stop")
    )
    for tenant, n in result.by_tenant.items():
        metrics.reconciled_total.labels(tenant).inc(n)
    if result.enqueued:
        log.warning(
            "reconcile: enqueued %d ticket(s) changed in the mirror with no event for the "
            "change (events lost upstream), tenants: %s",
            result.enqueued,
            ", ".join(f"{t or '(none)'} {n}" for t, n in sorted(result.by_tenant.items())),
        )
    return {"enqueued": result.enqueued, "scanned": result.scanned, "pages": result.pages}, (
        result.stopped
    )


@logged(Task.RETENTION)
def retention_pass(
    engine: sa.Engine, settings: Settings, **options: Unpack[PassOptions]
) -> PassCounts:
    """One retention pass, logged and counted."""
    result = retention.run_once(
        engine,
        retention_days=settings.retention_days,
        dead_letter_retention_days=settings.dead_letter_retention_days,
        now=options.get("now"),
        statement_timeout_seconds=settings.statement_timeout_seconds,
        should_stop=options.get("should_stop"),
        event_dedupe_hours=settings.event_dedupe_hours,
    )
    for state in ("done", "failed", "dead_letter"):
        metrics.sweeper_pruned_total.labels(state).inc(getattr(result, state))
    if result.pruned:
        log.info("pruned %d queue row(s) past retention", result.pruned)
    return result.counts(), result.stopped


@logged(Task.COUNTS)
def counts_pass(
    engine: sa.Engine, settings: Settings, **options: Unpack[PassOptions]
) -> PassCounts:
    """One recount of the terminal rows for /metrics (one statement), logged."""
    timeout = settings.statement_timeout_seconds
    return {
        "groups": counts.run_once(engine, statement_timeout_seconds=timeout, now=options.get("now"))
    }, False
