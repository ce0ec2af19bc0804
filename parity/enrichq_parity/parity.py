"""Parity: compare the shadow output with the legacy output, one day of tickets at a time.

Every comparison runs in SQL (``sql/parity.sql``); Python only adds up per-day aggregates.
Each day is one short read-only transaction, so a run never pins the vacuum horizon of the
queue table for long, and the read side may be a replica (``ENRICHQ_PARITY_DATABASE_URL``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import sqlalchemy as sa

from enrichq_parity.errors import ParityError
from enrichq_parity.model import (
    DIFFERING,
    RULE_SAMPLE_LIMIT,
    SAMPLE_LIMIT,
    AcceptFile,
    Coverage,
    DayResult,
    Mismatch,
    ParityReport,
    RuleResult,
    Tally,
    TenantCoverage,
    TenantResult,
    Thresholds,
    TicketClass,
    keep_top,
    merge_rule_tickets,
    tally_of,
    total,
)
from enrichq_schema import runlog
from enrichq_schema.identifiers import qualified, relation_exists, render
from enrichq_schema.process import process_id
from enrichq_schema.queries import Queries, load
from enrichq_schema.states import Component, StopReason

if TYPE_CHECKING:
    from enrichq_schema.settings import Settings

__all__ = [
    "ParityInputError",
    "ParityReport",
    "export_latest",
    "run_parity",
    "run_scheduled",
]

log = logging.getLogger(__name__)

SHADOW_TABLES = ("enrichq.ticket_orders", "enrichq.ticket_enrichments", "enrichq.queue")
# Stand in for the warehouse tables when the parity database does not hold them (a BigQuery
# warehouse): no shadow-only order can then be verified, so each one is unverified.
NO_ORDERS = (
    "(SELECT CAST(NULL AS text) AS order_id, CAST(NULL AS text) AS customer_id,"
    " CAST(NULL AS timestamptz) AS placed_at LIMIT 0)"
)
NO_CUSTOMERS = "(SELECT CAST(NULL AS text) AS customer_id, CAST(NULL AS text) AS email LIMIT 0)"
# Id columns parity compares as text, and the types whose text form is the id: text and
# varchar compare as they are (their index serves a text comparison); the others through
# CAST(... AS text).
ID_COLUMNS = ("ticket_id", "order_id")
TEXT_ID_TYPES = frozenset({"text", "varchar"})
COMPARABLE_ID_TYPES = TEXT_ID_TYPES | {"bpchar", "name", "citext", "int2", "int4", "int8", "uuid"}
# The CSV export's rows stream from the server this many at a time (a server-side cursor).
EXPORT_BATCH_ROWS = 2000

ProgressCallback = Callable[[int, int], None]
"""Called after each day with (days done, days in the window)."""


class ParityInputError(ParityError):
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
    accept: AcceptFile | None = None,
    csv_path: Path | None = None,
) -> ParityReport:
    """Run parity over tickets created in [since, until); record and return the report.

    since defaults to until - 7 days, until to now; `now` (tests) replaces the database clock.
    `accept`: the reviewed rules to apply. `csv_path`: where to export every differing
    ticket (written whole at the end of a run that finished, never half).
    """
    clock = time.monotonic()
    for name, value in (("since", since), ("until", until), ("now", now)):
        if value is not None and value.tzinfo is None:
            raise ParityInputError(f"{name} must carry a time zone")
    relations, at, side = _prepare(read_engine, write_engine, settings, now)
    until = (until or at).astimezone(UTC)
    since = (since or until - timedelta(days=settings.parity_window_days)).astimezone(UTC)
    if since >= until:
        raise ParityInputError(f"the window is empty: since {since:%F %T} ≥ until {until:%F %T}")
    young_after = at - timedelta(
        seconds=settings.delay_created_seconds + settings.parity_grace_seconds
    )
    thresholds = thresholds_of(settings)
    q = _queries()
    with write_engine.begin() as conn:
        log_id = runlog.start(conn, Component.PARITY, _owner(), now=now)
        run = conn.execute(
            q("parity_run_start"),
            {
                "now": now,
                "since": since,
                "until": until,
                "min_order_coverage": thresholds.min_order_coverage,
                "min_ticket_match_rate": thresholds.min_ticket_match_rate,
                "max_shadow_fault_rate": thresholds.max_shadow_fault_rate,
                "accept_rules": len(accept.rules) if accept else 0,
                "accept_sha256": accept.sha256 if accept else None,
            },
        ).one()
    try:
        with _Export(csv_path) as export:
            compared = _compare(
                read_engine,
                list(day_windows(since, until)),
                relations=relations,
                young_after=young_after,
                concurrency=settings.parity_concurrency,
                progress=progress,
                accept=accept,
                export=export,
            )
            with read_engine.begin() as conn:
                conn.execute(q("parity_read_only"))
                coverage = read_coverage(conn, relations, young_after)
            report = ParityReport(
                run_id=run.id,
                since=since,
                until=until,
                now=at,
                young_after=young_after,
                started_at=run.started_at,
                finished_at=None,
                duration_seconds=time.monotonic() - clock,
                thresholds=thresholds,
                total=total(d.tally for d in compared.days),
                days=tuple(compared.days),
                tenants=tuple(
                    TenantResult(t, compared.tenants[t]) for t in sorted(compared.tenants)
                ),
                mismatches={c: compared.mismatches[c] for c in DIFFERING},
                rules=_rule_results(accept, compared),
                accept_file=accept,
                sources={**_sources(settings, relations), "read_side": side.describe(at)},
                coverage=coverage,
            )
            return _finish(write_engine, report, side, log_id, now=now, clock=clock)
    except BaseException as exc:
        _abandon(write_engine, run.id, log_id, exc)
        raise


def thresholds_of(settings: Settings) -> Thresholds:
    """The bars of a run from the settings."""
    return Thresholds(
        min_order_coverage=settings.parity_min_order_coverage,
        max_shadow_fault_rate=settings.parity_max_shadow_fault_rate,
        min_ticket_match_rate=settings.parity_min_ticket_match_rate,
    )


def _rule_results(accept: AcceptFile | None, compared: _Compared) -> tuple[RuleResult, ...]:
    """Every rule of the file, in file order, with what it matched (nothing: 0 tickets)."""
    if accept is None:
        return ()
    return tuple(
        RuleResult(
            rule,
            compared.rule_matches.get(rule.number, 0),
            compared.rule_tickets.get(rule.number, ()),
        )
        for rule in accept.rules
    )


@dataclass(frozen=True, slots=True)
class ReadSide:
    """Where parity read: a standby (and how far its replay was behind) or a primary."""

    standby: bool
    lag_seconds: float | None

    def describe(self, data_at: datetime) -> str:
        """In words, for the report."""
        if not self.standby:
            return f"the primary, as of {data_at:%Y-%m-%d %H:%M:%S} UTC"
        return (
            f"a standby {self.lag_seconds or 0:.1f} s behind: its data is as of "
            f"{data_at:%Y-%m-%d %H:%M:%S} UTC"
        )


def read_coverage(
    conn: sa.Connection,
    relations: Mapping[str, str],
    young_after: datetime,
    *,
    legacy_only: bool = True,
) -> Coverage:
    """Every ticket consumers can read, all time: per tenant, what enrichq never enriched;
    and (`legacy_only`) the legacy tickets the mirror lacks, else counted as none."""
    statement = render(
        _queries()["parity_coverage"], tickets=relations["tickets"], legacy=relations["legacy"]
    )
    tenants: list[TenantCoverage] = []
    lacking = lacking_never = 0
    params = {"young_after": young_after, "legacy_only": legacy_only}
    for row in conn.execute(statement, params):
        if row.tenant is None:
            lacking, lacking_never = int(row.tickets), int(row.not_enriched)
            continue
        tenants.append(
            TenantCoverage(
                row.tenant,
                int(row.tickets),
                int(row.not_enriched),
                int(row.enriched),
                int(row.shadow_orders),
            )
        )
    return Coverage(tuple(tenants), lacking, lacking_never)


def _prepare(
    read_engine: sa.Engine, write_engine: sa.Engine, settings: Settings, now: datetime | None
) -> tuple[dict[str, str], datetime, ReadSide]:
    """Check both sides before anything is written: (quoted relations, the time it is,
    the read side)."""
    with read_engine.connect() as conn:
        relations = _check_relations(conn, settings)
        at: datetime = conn.execute(_queries()("parity_now"), {"now": now}).scalar_one()
        row = conn.execute(_queries()("parity_read_side")).one()
        conn.rollback()
    side = ReadSide(bool(row.standby), None if row.lag_seconds is None else float(row.lag_seconds))
    if side.standby:
        log.info(
            "parity reads a standby %.1f s behind: tickets are judged as of its last "
            "replayed commit, %s",
            side.lag_seconds,
            f"{at:%F %T%z}",
        )
    with write_engine.connect() as conn:
        if not relation_exists(conn, "enrichq.parity_runs"):
            raise ParityInputError(
                "table enrichq.parity_runs does not exist where parity writes "
                "(run `enrichq migrate` first)"
            )
        conn.rollback()
    return relations, at, side


def _sources(settings: Settings, relations: Mapping[str, str]) -> dict[str, str]:
    """What was compared with what, for the report's reader."""
    verifiable = relations["orders"] != NO_ORDERS and relations["customers"] != NO_CUSTOMERS
    return {
        "tickets": settings.tickets_table,
        "legacy": settings.legacy_table,
        "shadow": "enrichq.ticket_orders",
        "verified_against": (
            f"{settings.orders_table} and {settings.customers_table}"
            if verifiable
            else (
                f"nothing: {settings.orders_table} or {settings.customers_table} is not in the "
                "parity database, so no shadow-only order can be verified"
            )
        ),
    }


def _finish(
    engine: sa.Engine,
    report: ParityReport,
    side: ReadSide,
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
                "shadow_faults": whole.shadow_faults,
                "shadow_fault_rate": whole.shadow_fault_rate,
                "legacy_faults": whole.legacy_faults,
                "accepted_legacy_faults": whole.accepted_legacy_faults,
                "passed": report.passed,
                "data_at": report.now,
                "replica_lag_seconds": side.lag_seconds,
                "coverage": json.dumps(
                    None if report.coverage is None else report.coverage.as_dict()
                ),
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


@dataclass
class _Compared:
    """What the day queries found, added up in day order."""

    days: list[DayResult] = field(default_factory=list)
    tenants: dict[str, Tally] = field(default_factory=dict)
    mismatches: dict[TicketClass, tuple[Mismatch, ...]] = field(
        default_factory=lambda: dict.fromkeys(DIFFERING, ())
    )
    rule_matches: dict[int, int] = field(default_factory=dict)
    rule_tickets: dict[int, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Day:
    """One day's aggregate rows (few), and its part of the CSV export (a temporary file)."""

    rows: list[Any]
    part: Path | None


def _compare(
    read_engine: sa.Engine,
    windows: Sequence[tuple[date, datetime, datetime]],
    *,
    relations: Mapping[str, str],
    young_after: datetime,
    concurrency: int,
    progress: ProgressCallback | None,
    accept: AcceptFile | None,
    export: _Export,
) -> _Compared:
    """Run the day query over each day window; aggregate per day, per tenant, samples and rules.

    Up to `concurrency` days are compared at once, each in its own short transaction on its
    own connection; their rows are added up in day order, so the report does not depend on
    which day finished first. With an export, each day streams its differing tickets into a
    file of its own, and the parts are joined in day order.
    """
    q = _queries()
    statement = render(q["parity_day"], **relations)
    rules = json.dumps([r.as_sql() for r in accept.rules] if accept else [])

    def read_day(window: tuple[date, datetime, datetime]) -> _Day:
        day, start, end = window
        params = {
            "day_start": start,
            "day_end": end,
            "young_after": young_after,
            "sample_size": SAMPLE_LIMIT,
            "rules": rules,
            "rule_sample": RULE_SAMPLE_LIMIT,
            "export": export.enabled,
        }
        # One short read-only transaction per day: the snapshot lives for one statement.
        with read_engine.begin() as conn:
            conn.execute(q("parity_read_only"))
            conn.execute(q("parity_day_settings"))
            if not export.enabled:
                return _Day(list(conn.execute(statement, params)), None)
            # Stream the rows: a day's differing tickets go to its part of the export as they
            # arrive, so memory holds a batch of them, never the day.
            streamed = conn.execution_options(stream_results=True, yield_per=EXPORT_BATCH_ROWS)
            kept: list[Any] = []
            with export.part(day) as (path, writer):
                for row in streamed.execute(statement, params):
                    if row.row_kind == "ticket":
                        writer(_mismatch(row))
                    else:
                        kept.append(row)
            return _Day(kept, path)

    out = _Compared()
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="parity-day")
    try:
        for index, ((day, start, end), result) in enumerate(
            zip(windows, pool.map(read_day, windows), strict=True)
        ):
            out.days.append(DayResult(day, start, end, _add_day(out, result.rows)))
            if result.part is not None:
                export.append(result.part)
            if progress is not None:
                progress(index + 1, len(windows))
    finally:
        # a failed day (or Ctrl-C) ends the run: the days not started yet are not compared
        pool.shutdown(wait=True, cancel_futures=True)
    return out


def _add_day(out: _Compared, rows: list[Any]) -> Tally:
    """Add one day's aggregate rows to the run's; the day's tally."""
    day_tally = Tally()
    samples: dict[TicketClass, list[Mismatch]] = {}
    for row in rows:
        if row.row_kind == "sample":
            samples.setdefault(TicketClass(row.ticket_class), []).append(_mismatch(row))
            continue
        if row.row_kind == "rule":
            out.rule_matches[row.rule] = out.rule_matches.get(row.rule, 0) + row.tickets
            out.rule_tickets[row.rule] = merge_rule_tickets(
                out.rule_tickets.get(row.rule, ()), row.matched_ids or ()
            )
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
                row.unverified_orders,
            ),
            row.accepted,
        )
        day_tally += tally
        out.tenants[row.tenant] = out.tenants.get(row.tenant, Tally()) + tally
    for ticket_class, kept in samples.items():
        out.mismatches[ticket_class] = keep_top(out.mismatches[ticket_class], kept)
    return day_tally


class _Export:
    """The CSV export of a run: day parts streamed to temporary files, joined in day order.

    The file appears at its path (renamed over it) only when the run finished; a failed run
    leaves nothing behind.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.enabled = path is not None
        self._dir: Path | None = None
        self._out: IO[str] | None = None
        self._tmp: Path | None = None

    def __enter__(self) -> _Export:
        if self.path is not None:
            from enrichq_parity import export

            parent = self.path.parent if str(self.path.parent) else Path()
            self._dir = Path(tempfile.mkdtemp(prefix=".enrichq-parity-", dir=parent))
            self._tmp = self._dir / "export.csv"
            self._out = self._tmp.open("w", encoding="utf-8", newline="")
            export.write_header(self._out)
        return self

    @contextlib.contextmanager
    def part(self, day: date) -> Iterator[tuple[Path, Callable[[Mismatch], None]]]:
        """A day's part: (its path, a function that writes one mismatch to it)."""
        from enrichq_parity import export

        assert self._dir is not None
        path = self._dir / f"{day.isoformat()}.csv"
        with path.open("w", encoding="utf-8", newline="") as handle:
            yield path, export.writer(handle)

    def append(self, part: Path) -> None:
        """Append a day's part to the export and drop it."""
        assert self._out is not None
        with part.open(encoding="utf-8", newline="") as handle:
            shutil.copyfileobj(handle, self._out)
        part.unlink()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._out is None or self._tmp is None or self._dir is None or self.path is None:
            return
        self._out.close()
        try:
            if exc_type is None:
                os.replace(self._tmp, self.path)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


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
        unverified=tuple(row.unverified_ids or ()),
        accepted_by=tuple(row.accepted_by or ()),
    )


def _check_relations(conn: sa.Connection, settings: Settings) -> dict[str, str]:
    """The quoted relations of the day query; a missing input table is bad input."""
    quoted = {
        "tickets": qualified(conn.dialect, settings.tickets_table),
        "legacy": qualified(conn.dialect, settings.legacy_table),
        "orders": qualified(conn.dialect, settings.orders_table),
        "customers": qualified(conn.dialect, settings.customers_table),
    }
    if not relation_exists(conn, quoted["legacy"]):
        raise ParityInputError(
            f"legacy table {settings.legacy_table} does not exist (ENRICHQ_LEGACY_TABLE)"
        )
    if not relation_exists(conn, quoted["tickets"]):
        raise ParityInputError(
            f"tickets table {settings.tickets_table} does not exist (ENRICHQ_TICKETS_TABLE)"
        )
    legacy_types = _id_types(conn, quoted["legacy"], f"legacy table {settings.legacy_table}")
    # The day query looks each ticket's legacy rows up by ticket_id as text: without an index
    # serving that, it is a scan of the whole table per ticket, which would never finish.
    direct = legacy_types.get("ticket_id") in TEXT_ID_TYPES
    indexed = conn.execute(
        _queries()("parity_legacy_indexed"), {"name": quoted["legacy"], "direct": direct}
    ).scalar_one()
    if not indexed:
        raise ParityInputError(
            f"legacy table {settings.legacy_table} has no index on ticket_id, which parity "
            f"reads it by: CREATE INDEX CONCURRENTLY ON {quoted['legacy']} (ticket_id)"
            if direct
            else f"legacy table {settings.legacy_table} has no index on its ticket_id "
            f"({legacy_types.get('ticket_id')}) as text, which parity reads it by: CREATE "
            f"INDEX CONCURRENTLY ON {quoted['legacy']} ((CAST(ticket_id AS text)))"
        )
    for table in SHADOW_TABLES:
        if not relation_exists(conn, table):
            raise ParityInputError(
                f"table {table} does not exist where parity reads (run `enrichq migrate`)"
            )
    if not relation_exists(conn, quoted["orders"]):
        quoted["orders"] = NO_ORDERS
    else:
        _id_types(conn, quoted["orders"], f"orders table {settings.orders_table}")
    if not relation_exists(conn, quoted["customers"]):
        quoted["customers"] = NO_CUSTOMERS
    return quoted


def _id_types(conn: sa.Connection, relation: str, what: str) -> dict[str, str]:
    """The types of the relation's ticket_id and order_id columns (those it has); a type
    whose values cannot be compared with ids as text is bad input."""
    rows = conn.execute(
        _queries()("parity_column_types"),
        {"name": relation, "columns": list(ID_COLUMNS)},
    ).all()
    types = {row.column_name: row.type_name for row in rows}
    for column, type_name in sorted(types.items()):
        if type_name not in COMPARABLE_ID_TYPES:
            raise ParityInputError(
                f"{what}: {column} is {type_name}, which parity cannot compare with ids as "
                "text (text, varchar, char, integer or uuid columns can be)"
            )
    return types


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
    return f"{Component.PARITY.value}@{process_id()}"


def export_latest(conn: sa.Connection) -> None:
    """Set the enrichq_parity_* gauges from the latest finished parity run (none: untouched)."""
    from enrichq_schema import metrics

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


def engines(settings: Settings, url: str) -> tuple[sa.Engine, sa.Engine]:
    """(read, write): the engine parity reads through (ENRICHQ_PARITY_DATABASE_URL, a
    replica, or the database) and the one it records its run on (the database)."""
    from enrichq_schema.connections import engine_from_settings

    read = engine_from_settings(
        settings,
        settings.parity_database_url or url,
        application_name="enrichq-parity",
        pool_size=settings.parity_concurrency,
        statement_timeout_seconds=settings.statement_timeout_seconds,
    )
    write = engine_from_settings(
        settings,
        url,
        application_name="enrichq-parity",
        pool_size=1,
        statement_timeout_seconds=settings.statement_timeout_seconds,
    )
    return read, write


def run_scheduled(settings: Settings, url: str) -> None:
    """The sweeper's daily parity: the default window, recorded, gauges updated."""
    read, write = engines(settings, url)
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
