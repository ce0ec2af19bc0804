"""The parity commands: `enrichq parity` (a comparison, with its progress and summary),
`parity approve`, `parity runs` and `parity show`. The run itself is
`enrichq_parity.parity`, the review `enrichq_parity.review`, the reports
`enrichq_parity.report`; this module checks their input and renders their records."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from enrichq_schema.process import Exit
from enrichq_schema.text import utc_time
from enrichq_service.commands import options, render
from enrichq_service.commands.base import Context, refuse

if TYPE_CHECKING:
    from enrichq_parity.model import ParityReport
    from enrichq_parity.parity import ProgressCallback
    from enrichq_parity.review import RunRow
    from enrichq_schema.errors import EnrichqError


def compare(
    ctx: Context,
    *,
    subcommand: str | None,
    since: str | None,
    until: str | None,
    json_path: Path | None,
    html_path: Path | None,
    csv_path: Path | None,
    accept_path: Path | None,
) -> int:
    """`enrichq parity`: 0 pass, 1 below the bars (or nothing to judge), 2 bad input. Before
    a `subcommand`, refuse the comparison's options (which belong to no subcommand)."""
    files = {"json": json_path, "html": html_path, "csv": csv_path, "accept": accept_path}
    if subcommand is not None:
        window = {"since": since, "until": until}
        given = [f"--{name}" for name, value in window.items() if value is not None]
        given += [f"--{name}" for name, path in files.items() if path is not None]
        if given:
            verb = "belongs" if len(given) == 1 else "belong"
            refuse(
                f"parity {subcommand}: {', '.join(given)} {verb} to a "
                "comparison (`enrichq parity`), not to this command"
            )
        return Exit.OK
    since_at = options.day(since, "--since")
    until_at = options.day(until, "--until")
    if since_at and until_at and since_at >= until_at:
        refuse("--since must be before --until")
    return run(
        ctx,
        since=since_at,
        until=until_at,
        json_path=json_path,
        html_path=html_path,
        csv_path=csv_path,
        accept_path=accept_path,
    )


def run(
    ctx: Context,
    *,
    since: datetime | None,
    until: datetime | None,
    json_path: Path | None,
    html_path: Path | None,
    csv_path: Path | None = None,
    accept_path: Path | None = None,
) -> int:
    """A comparison of checked options: every input (report paths, the accept file) is
    checked before anything is recorded."""
    from enrichq_parity import accept as accepting
    from enrichq_parity import report as reports
    from enrichq_parity.model import AcceptFile
    from enrichq_parity.parity import ParityInputError, engines, run_parity

    settings = ctx.settings
    for option, path in (("--json", json_path), ("--html", html_path), ("--csv", csv_path)):
        problem = unwritable(path)
        if problem:
            refuse(f"parity: {option} {path}: {problem}")
    accept: AcceptFile | None = None
    if accept_path is not None:
        try:
            accept = accepting.load(accept_path)
        except accepting.AcceptFileError as exc:
            refuse(f"parity: --accept {exc}")
    console = render.console(ctx.out)
    with ctx.database() as url:
        read, write = engines(settings, url)
        try:
            with _ProgressBar(console, ctx.err) as progress:
                result = run_parity(
                    read,
                    write,
                    settings,
                    since=since,
                    until=until,
                    progress=progress,
                    accept=accept,
                    csv_path=csv_path,
                )
        except ParityInputError as exc:
            refuse(f"parity: {exc}")
        finally:
            read.dispose()
            write.dispose()
    if json_path is not None:
        json_path.write_text(reports.to_json(result), encoding="utf-8")
    if html_path is not None:
        html_path.write_text(reports.to_html(result), encoding="utf-8")
    print_summary(console, result)
    for label, path in (("json", json_path), ("html", html_path), ("csv", csv_path)):
        if path is not None:
            console.print(f"{label}: {path}", highlight=False, markup=False)
    return Exit.OK if result.passed else Exit.FAILED


def failure(command: str, exc: EnrichqError) -> NoReturn:
    """Refuse `command` in one line saying why it changed nothing: exit 1 when the review
    refused it (a gate), 2 for bad input."""
    from enrichq_parity.review import ParityRefused

    if isinstance(exc, ParityRefused):
        refuse(f"{command} refused: {exc}", Exit.FAILED)
    refuse(f"{command}: {exc}")


def unwritable(path: Path | None) -> str | None:
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
    """A rich progress bar over the days on a terminal; when output is not a terminal (a
    CronJob's log), a plain line on stderr at each tenth of the days."""

    def __init__(self, console: Any, err: TextIO) -> None:
        self._plain = not console.is_terminal
        self._err = err
        self._said = 0
        self._began = time.monotonic()
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
        if self._plain and (done == days or done * 10 // days > self._said * 10 // days):
            self._said = done
            seconds = time.monotonic() - self._began
            print(
                f"parity: {done} of {days} days compared ({seconds:.1f} s, "
                f"{done / seconds if seconds else 0:.1f} days/s)",
                file=self._err,
            )


_STATE_MARKUP = {
    "pass": "[bold green]PASS[/]",
    "review": "[bold yellow]PASS[/] [yellow](legacy faults to accept)[/]",
    "fail": "[bold red]FAIL[/]",
    "empty": "[bold red]FAIL[/] [dim](nothing to judge)[/]",
}


def print_summary(console: Any, report: ParityReport) -> None:
    """The run's figures on the terminal: verdict, bars, fault groups, classes, rules."""
    from rich.table import Table

    from enrichq_parity.model import (
        CLASS_LABELS,
        FAULT_LABELS,
        Exclusion,
        Fault,
        classes_of,
        pct,
        plural,
    )

    t, bars, verdict = report.total, report.thresholds, report.verdict
    console.print(
        f"{_STATE_MARKUP[verdict.state]}  parity run #{report.run_id}  "
        f"{utc_time(report.since)} → {utc_time(report.until)} UTC",
        highlight=False,
    )
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    table.add_row("order coverage", pct(t.order_coverage), f"min {pct(bars.min_order_coverage)}")
    table.add_row(
        "shadow fault rate", pct(t.shadow_fault_rate), f"max {pct(bars.max_shadow_fault_rate)}"
    )
    table.add_row("ticket match rate", pct(t.ticket_match_rate), "both flows agree (not a bar)")
    table.add_row("tickets compared", f"{t.compared:,}", f"exact matches {t.exact:,}")
    table.add_row(
        "tickets excluded",
        f"{t.excluded:,}",
        ", ".join(f"{e.value.replace('_', ' ')} {t.count(e):,}" for e in Exclusion),
    )
    for fault in Fault:
        note = ""
        if fault is Fault.LEGACY:
            note = (
                f"accepted {t.accepted_legacy_faults:,}, "
                f"not accepted {t.unaccepted_legacy_faults:,}"
            )
        table.add_row(FAULT_LABELS[fault].lower(), f"{t.in_group(fault):,}", note)
        for c in classes_of(fault):
            table.add_row(f"  {CLASS_LABELS[c].lower()}", f"{t.count(c):,}", "")
    table.add_row(
        "orders",
        f"{t.legacy_orders:,}",
        f"legacy; matched {t.matched_orders:,}, missing {t.missing_orders:,}, "
        f"extra {t.extra_orders:,}, drift {t.drift_orders:,}, "
        f"unverified {t.unverified_orders:,}",
    )
    if report.coverage is not None:
        every = report.coverage
        lacking = every.legacy_only
        table.add_row(
            "not yet enriched",
            f"{every.not_enriched:,}",
            "all time, every ticket consumers can read; cutover needs 0 (`enrichq backfill`)"
            + (f"; {lacking:,} legacy tickets the mirror lacks" if lacking else ""),
        )
    if "read_side" in report.sources:
        table.add_row("read", "", report.sources["read_side"])
    console.print(table)
    for r in report.rules:
        flag = "[yellow]matched nothing[/]" if r.unused else plural(r.matched, "ticket")
        console.print(
            f"  rule {r.rule.number} (line {r.rule.line}) {r.rule.ticket_class.value}, "
            f"{r.rule.scope()}: {flag}  [dim]by {r.rule.author}[/]",
            highlight=False,
        )
    console.print(verdict.reason, highlight=False, markup=False)


def approve(ctx: Context, *, run_id: int, by: str, note: str | None) -> int:
    """`enrichq parity approve RUN --by NAME`: 0 approved, 1 refused, 2 unknown run/bad name."""
    from enrichq_parity import review

    try:
        with ctx.opened("enrichq-parity") as engine, engine.begin() as conn:
            done = review.approve(conn, run_id, by=by, note=note)
    except (review.ReviewInputError, review.ApprovalRefused) as exc:
        failure("parity approve", exc)
    a, out = done.approval, ctx.out
    for line in done.failing:
        print(f"note: {line}", file=out)
    if done.changed:
        when = utc_time(a.approved_at, seconds=True)
        print(f"approved parity run #{run_id} by {a.approved_by} at {when} UTC", file=out)
    else:
        print(
            f"parity run #{run_id} was already approved by {a.approved_by} at "
            f"{utc_time(a.approved_at, seconds=True)} UTC; nothing changed",
            file=out,
        )
    for line in done.notes:
        print(f"note: {line}", file=out)
    return Exit.OK


def runs(ctx: Context, *, limit: int, as_json: bool) -> int:
    """`enrichq parity runs`: the recent runs with verdict, accepted rules and approvals."""
    from enrichq_parity.review import list_runs

    with ctx.opened("enrichq-parity") as engine, engine.connect() as conn:
        rows = list_runs(conn, limit)
    if as_json:
        for row in rows:
            print(json.dumps(row.as_dict()), file=ctx.out)
        return Exit.OK
    render_runs(rows, ctx.out)
    return Exit.OK


def show(
    ctx: Context,
    *,
    run_id: int,
    json_path: Path | None,
    html_path: Path | None,
) -> int:
    """`enrichq parity show RUN`: a stored run's summary, and its reports with its approvals."""
    from enrichq_parity import report as reports
    from enrichq_parity.review import ReviewInputError, load_report

    for option, path in (("--json", json_path), ("--html", html_path)):
        problem = unwritable(path)
        if problem:
            refuse(f"parity show: {option} {path}: {problem}")
    try:
        with ctx.opened("enrichq-parity") as engine, engine.connect() as conn:
            report, approvals = load_report(conn, run_id)
    except ReviewInputError as exc:
        failure("parity show", exc)
    if json_path is not None:
        json_path.write_text(reports.to_json(report, approvals), encoding="utf-8")
    if html_path is not None:
        html_path.write_text(reports.to_html(report, approvals), encoding="utf-8")
    console = render.console(ctx.out)
    print_summary(console, report)
    for a in approvals:
        console.print(
            f"approved by {a.approved_by} at {utc_time(a.approved_at, seconds=True)} UTC"
            + (f": {a.note}" if a.note else ""),
            highlight=False,
            markup=False,
        )
    if not approvals:
        console.print("not approved", highlight=False, markup=False)
    for label, path in (("json", json_path), ("html", html_path)):
        if path is not None:
            console.print(f"{label}: {path}", highlight=False, markup=False)
    return Exit.OK


def render_runs(rows: Sequence[RunRow], out: TextIO) -> None:
    """The runs as a table (140 columns wide when `out` is no terminal to fit)."""
    from rich.table import Table

    from enrichq_parity.model import pct

    console = render.console(out, width=140)
    if not rows:
        console.print("no parity runs recorded yet: run `enrichq parity`", highlight=False)
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name, justify in (
        ("run", "right"),
        ("finished (UTC)", "left"),
        ("window", "left"),
        ("verdict", "left"),
        ("coverage", "right"),
        ("shadow faults", "right"),
        ("legacy faults", "right"),
        ("rules", "left"),
        ("approved by", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]  # justify is one of rich's literals, typed str here
    for r in rows:
        rules = "—" if r.accept_rules == 0 else f"{r.accept_rules}"
        if r.unused_rules:
            rules += f" ({r.unused_rules} matched nothing)"
        table.add_row(
            f"#{r.id}",
            utc_time(r.finished_at, seconds=True),
            f"{r.window_since:%m-%d} → {r.window_until:%m-%d}",
            _STATE_WORDS.get(r.state, r.state),
            pct(r.order_coverage),
            pct(r.shadow_fault_rate),
            f"{r.accepted_legacy_faults:,}/{r.legacy_faults:,} accepted"
            if r.legacy_faults
            else "0",
            rules,
            ", ".join(a.approved_by for a in r.approvals) or "—",
        )
    console.print(table)


_STATE_WORDS = {
    "pass": "[green]pass[/]",
    "review": "[green]pass[/], [yellow]legacy faults to accept[/]",
    "fail": "[red]fail[/]",
    "empty": "[red]nothing to judge[/]",
    "error": "[red]error[/]",
    "running": "running",
    "old": "[dim]before verdicts by fault[/]",
}
