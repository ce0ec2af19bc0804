"""Parity: compare the shadow output with the legacy output, one day of tickets at a time.

Every comparison runs in SQL (``sql/parity.sql``); Python only adds up per-day aggregates.
Each day is one short read-only transaction, so a run never pins the vacuum horizon of the
queue table for long, and the read side may be a replica (``ENRICHQ_PARITY_DATABASE_URL``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from enrichq_parity import names
from enrichq_parity.model import (
    DRIFT_SAMPLE_LIMIT,
    SAMPLE_LIMIT,
    DayResult,
    Exclusion,
    Mismatch,
    ParityReport,
    Tally,
    TenantResult,
    TicketClass,
    decide,
    pct,
    pick_sample,
    tally_of,
    total,
)
from enrichq_schema import runlog
from enrichq_schema.errors import EnrichqError
from enrichq_schema.queries import Queries, load
from enrichq_schema.states import Component, StopReason

if TYPE_CHECKING:
    from enrichq_service.settings import Settings

__all__ = [
    "ParityInputError",
    "ParityReport",
    "export_latest",
    "run_cli",
    "run_parity",
    "run_scheduled",
]

log = logging.getLogger(__name__)

DEFAULT_WINDOW = timedelta(days=7)
SHADOW_TABLES = ("enrichq.ticket_orders", "enrichq.ticket_enrichments", "enrichq.queue")
# Stands in for the warehouse orders table when the parity database does not hold it (a
# BigQuery warehouse): drift then relies on the placed_at the shadow row carries.
NO_ORDERS = (
    "(SELECT CAST(NULL AS text) AS order_id, CAST(NULL AS timestamptz) AS placed_at LIMIT 0)"
)

ProgressCallback = Callable[[int, int], None]
"""Called after each day with (days done, days in the window)."""

EXIT_PASSED = 0
EXIT_BELOW = 1
EXIT_BAD_INPUT = 2


class ParityInputError(EnrichqError):
    """Parity cannot run on this input."""


def _queries() -> Queries:
    return load("enrichq_parity", "sql/parity.sql")


def run_parity(
    read_engine: sa.Engine,
    write_engine: sa.Engine,
    settings: Settings,
    *,
    since: datetime | None,
    until: datetime | None,
    now: datetime | None = None,
    progress: ProgressCallback | None = None,
) -> ParityReport:
    """Run parity over tickets created in [since, until); record and return the report.

    since defaults to until - 7 days, until to now; `now` (tests) replaces the database clock.
    """
    clock = time.monotonic()
    for name, value in (("since", since), ("until", until), ("now", now)):
        if value is not None and value.tzinfo is None:
            raise ParityInputError(f"{name} must carry a time zone")
    relations, at = _prepare(read_engine, write_engine, settings, now)
    until = (until or at).astimezone(UTC)
    since = (since or until - DEFAULT_WINDOW).astimezone(UTC)
    if since >= until:
        raise ParityInputError(f"the window is empty: since {since:%F %T} ≥ until {until:%F %T}")
    young_after = at - timedelta(
        seconds=settings.delay_created_seconds + settings.parity_grace_seconds
    )
    q = _queries()
    with write_engine.begin() as conn:
        log_id = runlog.start(conn, Component.PARITY, _owner(), now=now)
        run = conn.execute(
            q("parity_run_start"),
            {
                "now": now,
                "since": since,
                "until": until,
                "min_order_coverage": settings.parity_min_order_coverage,
                "min_ticket_match_rate": settings.parity_min_ticket_match_rate,
            },
        ).one()
    try:
        days, tenants, samples = _compare(
            read_engine,
            relations=relations,
            since=since,
            until=until,
            young_after=young_after,
            concurrency=settings.parity_concurrency,
            progress=progress,
        )
        whole = total(d.tally for d in days)
        report = ParityReport(
            run_id=run.id,
            since=since,
            until=until,
            now=at,
            young_after=young_after,
            started_at=run.started_at,
            finished_at=None,
            duration_seconds=time.monotonic() - clock,
            min_order_coverage=settings.parity_min_order_coverage,
            min_ticket_match_rate=settings.parity_min_ticket_match_rate,
            total=whole,
            days=tuple(days),
            tenants=tuple(TenantResult(t, tenants[t]) for t in sorted(tenants)),
            sample=pick_sample(samples),
            drift_sample=tuple(samples.get(TicketClass.DRIFT_ONLY, ())[:DRIFT_SAMPLE_LIMIT]),
            verdict=decide(
                whole, settings.parity_min_order_coverage, settings.parity_min_ticket_match_rate
            ),
            sources=_sources(settings, relations),
        )
        return _finish(write_engine, report, log_id, now=now, clock=clock)
    except BaseException as exc:
        _abandon(write_engine, run.id, log_id, exc)
        raise


def _prepare(
    read_engine: sa.Engine, write_engine: sa.Engine, settings: Settings, now: datetime | None
) -> tuple[dict[str, str], datetime]:
    """Check both sides before anything is written: (quoted relations, the time it is)."""
    with read_engine.connect() as conn:
        relations = _check_relations(conn, settings)
        at: datetime = conn.execute(_queries()("parity_now"), {"now": now}).scalar_one()
        conn.rollback()
    with write_engine.connect() as conn:
        if not _exists(conn, "enrichq.parity_runs"):
            raise ParityInputError(
                "table enrichq.parity_runs does not exist where parity writes "
                "(run `enrichq migrate` first)"
            )
        conn.rollback()
    return relations, at


def _sources(settings: Settings, relations: Mapping[str, str]) -> dict[str, str]:
    """What was compared with what, for the report's reader."""
    return {
        "tickets": settings.tickets_table,
        "legacy": settings.legacy_table,
        "shadow": "enrichq.ticket_orders",
        "drift_placed_at": (
            f"shadow rows, else {settings.orders_table}"
            if relations["orders"] != NO_ORDERS
            else "shadow rows only (warehouse orders table not in the parity database)"
        ),
    }


def _finish(
    engine: sa.Engine,
    report: ParityReport,
    log_id: int,
    *,
    now: datetime | None,
    clock: float,
) -> ParityReport:
    """Close the parity_runs row (with the full report) and the run log row in one go."""
    q = _queries()
    whole = report.total
    with engine.begin() as conn:
        finished_at = conn.execute(q("parity_now"), {"now": now}).scalar_one()
        report = replace(report, finished_at=finished_at, duration_seconds=time.monotonic() - clock)
        conn.execute(
            q("parity_run_finish"),
            {
                "id": report.run_id,
                "now": finished_at,
                "tickets_compared": whole.compared,
                "tickets_excluded": whole.excluded,
                "exact_matches": whole.exact,
                "order_coverage": whole.order_coverage,
                "ticket_match_rate": whole.ticket_match_rate,
                "passed": report.passed,
                "report": json.dumps(report.as_dict()),
            },
        )
        # A parity run ends when every day is compared: the queue's "no work left".
        runlog.finish(
            conn,
            log_id,
            StopReason.NO_WORK,
            {
                "parity_run_id": report.run_id,
                "days": len(report.days),
                "tickets_compared": whole.compared,
                "tickets_excluded": whole.excluded,
                "passed": report.passed,
            },
            now=finished_at,
        )
    return report


def _compare(
    read_engine: sa.Engine,
    *,
    relations: Mapping[str, str],
    since: datetime,
    until: datetime,
    young_after: datetime,
    concurrency: int,
    progress: ProgressCallback | None,
) -> tuple[list[DayResult], dict[str, Tally], dict[TicketClass, list[Mismatch]]]:
    """Run the day query over each day; aggregate per day, per tenant, and the samples.

    Up to `concurrency` days are compared at once, each in its own short transaction on its
    own connection; their rows are added up in day order, so the report does not depend on
    which day finished first.
    """
    q = _queries()
    statement = names.render(q["parity_day"], **relations)
    windows = list(day_windows(since, until))

    def read_day(window: tuple[date, datetime, datetime]) -> Sequence[Any]:
        _, start, end = window
        # One short read-only transaction per day: the snapshot lives for one statement.
        with read_engine.begin() as conn:
            conn.execute(q("parity_read_only"))
            conn.execute(q("parity_day_settings"))
            return conn.execute(
                statement,
                {
                    "day_start": start,
                    "day_end": end,
                    "young_after": young_after,
                    "sample_size": SAMPLE_LIMIT,
                },
            ).all()

    days: list[DayResult] = []
    tenants: dict[str, Tally] = {}
    samples: dict[TicketClass, list[Mismatch]] = {}
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="parity-day")
    try:
        for index, ((day, start, end), rows) in enumerate(
            zip(windows, pool.map(read_day, windows), strict=True)
        ):
            day_tally = Tally()
            for row in rows:
                if row.row_kind == "sample":
                    kept = samples.setdefault(TicketClass(row.ticket_class), [])
                    if len(kept) < SAMPLE_LIMIT:
                        kept.append(_mismatch(row))
                    continue
                tally = tally_of(
                    row.row_kind,
                    row.ticket_class,
                    row.tickets,
                    (
                        row.legacy_orders,
                        row.matched_orders,
                        row.missing_orders,
                        row.extra_orders,
                        row.drift_orders,
                    ),
                )
                day_tally += tally
                tenants[row.tenant] = tenants.get(row.tenant, Tally()) + tally
            days.append(DayResult(day, start, end, day_tally))
            if progress is not None:
                progress(index + 1, len(windows))
    finally:
        # a failed day (or Ctrl-C) ends the run: the days not started yet are not compared
        pool.shutdown(wait=True, cancel_futures=True)
    return days, tenants, samples


def day_windows(since: datetime, until: datetime) -> Iterator[tuple[date, datetime, datetime]]:
    """[since, until) cut at UTC midnights: (day, start, end) per day."""
    start = since.astimezone(UTC)
    end_all = until.astimezone(UTC)
    while start < end_all:
        midnight = datetime.combine(start.date() + timedelta(days=1), datetime.min.time(), UTC)
        end = min(midnight, end_all)
        yield start.date(), start, end
        start = end


def _mismatch(row: Any) -> Mismatch:
    return Mismatch(
        ticket_id=row.ticket_id,
        tenant=row.tenant,
        ticket_class=TicketClass(row.ticket_class),
        created_at=row.created_at,
        enriched_at=row.enriched_at,
        legacy_looked_up_at=row.legacy_looked_up_at,
        legacy_orders=row.legacy_orders,
        matched_orders=row.matched_orders,
        missing=tuple(row.missing_ids or ()),
        extra=tuple(row.extra_ids or ()),
        drift=tuple(row.drift_ids or ()),
    )


def _exists(conn: sa.Connection, qualified: str) -> bool:
    query = _queries()("parity_relation_exists")
    present: bool = conn.execute(query, {"name": qualified}).scalar_one()
    return present


def _check_relations(conn: sa.Connection, settings: Settings) -> dict[str, str]:
    """The quoted relations of the day query; a missing input table is bad input."""
    quoted = {
        "tickets": names.qualified(conn.dialect, settings.tickets_table),
        "legacy": names.qualified(conn.dialect, settings.legacy_table),
        "orders": names.qualified(conn.dialect, settings.orders_table),
    }
    if not _exists(conn, quoted["legacy"]):
        raise ParityInputError(
            f"legacy table {settings.legacy_table} does not exist (ENRICHQ_LEGACY_TABLE)"
        )
    if not _exists(conn, quoted["tickets"]):
        raise ParityInputError(
            f"tickets table {settings.tickets_table} does not exist (ENRICHQ_TICKETS_TABLE)"
        )
    # The day query looks each ticket's legacy rows up by ticket_id: without an index that is
    # a scan of the whole table per ticket, which would never finish on a real table.
    indexed = conn.execute(
        _queries()("parity_legacy_indexed"), {"name": quoted["legacy"]}
    ).scalar_one()
    if not indexed:
        raise ParityInputError(
            f"legacy table {settings.legacy_table} has no index on ticket_id, which parity "
            f"reads it by: CREATE INDEX CONCURRENTLY ON {quoted['legacy']} (ticket_id)"
        )
    for table in SHADOW_TABLES:
        if not _exists(conn, table):
            raise ParityInputError(
                f"table {table} does not exist where parity reads (run `enrichq migrate`)"
            )
    if not _exists(conn, quoted["orders"]):
        quoted["orders"] = NO_ORDERS
    return quoted


def _abandon(engine: sa.Engine, run_id: int, log_id: int, exc: BaseException) -> None:
    """Record a failed run: the parity row stays unfinished, the run log says error."""
    q = _queries()
    error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    try:
        with engine.begin() as conn:
            conn.execute(q("parity_run_abandon"), {"id": run_id, "error": error})
            runlog.finish(conn, log_id, StopReason.ERROR, {"parity_run_id": run_id}, error[:2000])
    except sa.exc.SQLAlchemyError:
        log.exception("could not record the failure of parity run %s", run_id)


def _owner() -> str:
    return f"{Component.PARITY.value}@{socket.gethostname()}:{os.getpid()}"


def export_latest(conn: sa.Connection) -> None:
    """Set the enrichq_parity_* gauges from the latest finished parity run (none: untouched)."""
    from enrichq_service import metrics

    row = conn.execute(_queries()("parity_latest")).first()
    if row is None:
        return
    metrics.parity_order_coverage.set(
        math.nan if row.order_coverage is None else row.order_coverage
    )
    metrics.parity_ticket_match_rate.set(
        math.nan if row.ticket_match_rate is None else row.ticket_match_rate
    )
    metrics.parity_pass.set(1 if row.passed else 0)
    metrics.parity_last_run_timestamp_seconds.set(row.finished_at.timestamp())


def _engines(settings: Settings, url: str) -> tuple[sa.Engine, sa.Engine]:
    from enrichq_schema.db import create_engine

    read = create_engine(
        settings.parity_database_url or url,
        application_name="enrichq-parity",
        pool_size=settings.parity_concurrency,
        statement_timeout_seconds=settings.statement_timeout_seconds,
    )
    write = create_engine(
        url,
        application_name="enrichq-parity",
        pool_size=1,
        statement_timeout_seconds=settings.statement_timeout_seconds,
    )
    return read, write


def run_scheduled(settings: Settings, url: str) -> None:
    """The sweeper's daily parity: the default window, recorded, gauges updated."""
    read, write = _engines(settings, url)
    try:
        report = run_parity(read, write, settings, since=None, until=None)
        with write.connect() as conn:
            export_latest(conn)
        log.info(
            "parity run %s: %s (%s)",
            report.run_id,
            "pass" if report.passed else "FAIL",
            report.verdict.reason,
        )
    except ParityInputError as exc:
        log.error("parity: %s", exc)
    finally:
        read.dispose()
        write.dispose()


def run_cli(
    settings: Settings,
    url: str,
    *,
    since: datetime | None,
    until: datetime | None,
    json_path: Path | None,
    html_path: Path | None,
) -> int:
    """`enrichq parity`: 0 pass, 1 below the thresholds (or nothing to judge), 2 bad input."""
    from rich.console import Console

    from enrichq_parity import report as render

    console = Console()
    for option, path in (("--json", json_path), ("--html", html_path)):
        problem = _unwritable(path)
        if problem:
            print(f"enrichq: parity: {option} {path}: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
    read, write = _engines(settings, url)
    try:
        with _ProgressBar(console) as progress:
            result = run_parity(read, write, settings, since=since, until=until, progress=progress)
    except ParityInputError as exc:
        print(f"enrichq: parity: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        read.dispose()
        write.dispose()
    if json_path is not None:
        json_path.write_text(render.to_json(result), encoding="utf-8")
    if html_path is not None:
        html_path.write_text(render.to_html(result), encoding="utf-8")
    _print_summary(console, result, json_path, html_path)
    return EXIT_PASSED if result.passed else EXIT_BELOW


def _unwritable(path: Path | None) -> str | None:
    """Why a report cannot be written to `path`, checked before any work; None if it can."""
    if path is None:
        return None
    if path.is_dir():
        return "is a directory"
    parent = path.parent if str(path.parent) else Path()
    if not parent.is_dir():
        return "its directory does not exist"
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "not writable"
    return None


class _ProgressBar:
    """A rich progress bar over the days on a terminal; nothing when output is not a tty."""

    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(
            TextColumn("parity: days"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self._task = self._bar.add_task("days", total=None)

    def __enter__(self) -> ProgressCallback:
        self._bar.start()
        return self._advance

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def _advance(self, done: int, days: int) -> None:
        self._bar.update(self._task, completed=done, total=days)


def _print_summary(
    console: Any, report: ParityReport, json_path: Path | None, html_path: Path | None
) -> None:
    from rich.table import Table

    t = report.total
    status = "[bold green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
    console.print(
        f"{status}  parity run #{report.run_id}  "
        f"{report.since:%Y-%m-%d %H:%M} → {report.until:%Y-%m-%d %H:%M} UTC",
        highlight=False,
    )
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    table.add_row("order coverage", pct(t.order_coverage), f"min {pct(report.min_order_coverage)}")
    table.add_row(
        "ticket match rate",
        pct(t.ticket_match_rate),
        f"min {pct(report.min_ticket_match_rate)}",
    )
    table.add_row("tickets compared", f"{t.compared:,}", "")
    table.add_row(
        "tickets excluded",
        f"{t.excluded:,}",
        ", ".join(f"{e.value.replace('_', ' ')} {t.count(e):,}" for e in Exclusion),
    )
    for c in TicketClass:
        table.add_row(f"  {c.value.replace('_', ' ')}", f"{t.count(c):,}", "")
    table.add_row(
        "orders",
        f"{t.legacy_orders:,}",
        f"legacy; matched {t.matched_orders:,}, missing {t.missing_orders:,}, "
        f"extra {t.extra_orders:,}, drift {t.drift_orders:,}",
    )
    console.print(table)
    console.print(report.verdict.reason, highlight=False, markup=False)
    for label, path in (("json", json_path), ("html", html_path)):
        if path is not None:
            console.print(f"{label}: {path}", highlight=False, markup=False)
