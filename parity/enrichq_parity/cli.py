"""`enrichq parity`: the command line over a parity run, with its progress bar and summary.

The run itself (orchestration and comparison) is `enrichq_parity.parity`; the reports are
`enrichq_parity.report`.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from enrichq_parity.model import AcceptFile, Exclusion, Fault, ParityReport, pct, plural
from enrichq_parity.parity import ParityInputError, ProgressCallback, engines, run_parity
from enrichq_schema.process import Exit, say
from enrichq_schema.settings import Settings
from enrichq_schema.text import utc_time


def run_cli(
    settings: Settings,
    url: str,
    *,
    since: datetime | None,
    until: datetime | None,
    json_path: Path | None,
    html_path: Path | None,
    csv_path: Path | None = None,
    accept_path: Path | None = None,
) -> int:
    """`enrichq parity`: 0 pass, 1 below the bars (or nothing to judge), 2 bad input.

    Every input (report paths, the accept file) is checked before anything is recorded.
    """
    from rich.console import Console

    from enrichq_parity import accept as accepting
    from enrichq_parity import report as render

    console = Console()
    for option, path in (("--json", json_path), ("--html", html_path), ("--csv", csv_path)):
        problem = unwritable(path)
        if problem:
            say(f"parity: {option} {path}: {problem}")
            return Exit.USAGE
    accept: AcceptFile | None = None
    if accept_path is not None:
        try:
            accept = accepting.load(accept_path)
        except accepting.AcceptFileError as exc:
            say(f"parity: --accept {exc}")
            return Exit.USAGE
    read, write = engines(settings, url)
    try:
        with _ProgressBar(console) as progress:
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
        say(f"parity: {exc}")
        return Exit.USAGE
    finally:
        read.dispose()
        write.dispose()
    if json_path is not None:
        json_path.write_text(render.to_json(result), encoding="utf-8")
    if html_path is not None:
        html_path.write_text(render.to_html(result), encoding="utf-8")
    print_summary(console, result)
    for label, path in (("json", json_path), ("html", html_path), ("csv", csv_path)):
        if path is not None:
            console.print(f"{label}: {path}", highlight=False, markup=False)
    return Exit.OK if result.passed else Exit.FAILED


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

    def __init__(self, console: Any) -> None:
        self._plain = not console.is_terminal
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
                file=sys.stderr,
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

    from enrichq_parity.model import CLASS_LABELS, FAULT_LABELS, classes_of

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
