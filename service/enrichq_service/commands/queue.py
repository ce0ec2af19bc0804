"""The queue's commands: `enrichq enqueue`, `status`, `worker`, `serve` and `sweep`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, TextIO

from enrichq_schema.process import Exit
from enrichq_schema.states import State
from enrichq_service.commands import render
from enrichq_service.commands.base import Context, refuse
from enrichq_service.commands.render import shown
from enrichq_service.terminal import say

if TYPE_CHECKING:
    from enrichq_service.status import StatusReport


def enqueue(
    ctx: Context, *, keys: tuple[str, ...], reason: str, tenant: str | None, kind: str
) -> int:
    """Enqueue `keys`; one line per key: inserted or merged, and its row id."""
    from enrichq_service import queue
    from enrichq_service.queue import EnqueueRequest, QueueInputError

    settings = ctx.settings
    try:
        requests = [
            EnqueueRequest.build(key=k, kind=kind, reason=reason, tenant=tenant) for k in keys
        ]
    except QueueInputError as exc:
        refuse(str(exc))
    with ctx.opened("enrichq", statement_timeout=False) as engine, engine.begin() as conn:
        results = queue.enqueue(conn, requests, settings=settings)
    for result in results:
        state = "inserted" if result.inserted else "merged"
        print(f"{result.key}\t{state}\t{result.id}", file=ctx.out)
    return Exit.OK


def status(ctx: Context, *, as_json: bool) -> int:
    """The queue's counts, leases, pauses and dead letters: tables, or JSON."""
    ctx.settings  # noqa: B018 -- a bad setting stops the command before any import or connection
    from enrichq_service.status import collect

    with ctx.opened("enrichq", statement_timeout=False) as engine, engine.connect() as conn:
        report = collect(conn)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, default=str), file=ctx.out)
    else:
        render_status(report, ctx.out)
    return Exit.OK


def worker(ctx: Context, *, drain: bool, time_budget: float | None, no_wait: bool) -> int:
    """Claim and enrich until stopped (or drained, or out of time); the worker's exit code."""
    from enrichq_service.worker import run_worker

    settings = ctx.settings
    with ctx.database() as url:
        return run_worker(
            settings, url, drain=drain, time_budget=time_budget, wait_for_schema=not no_wait
        )


def serve(ctx: Context, *, no_wait: bool) -> int:
    """HTTP ingest, health, /metrics and a worker in one process; its exit code."""
    from enrichq_service.serve import run_serve

    settings = ctx.settings
    with ctx.database() as url:
        return run_serve(settings, url, wait_for_schema=not no_wait)


def sweep(ctx: Context, *, once: bool, no_wait: bool) -> int:
    """The sweeper, until stopped (or each task once); its exit code."""
    from enrichq_sweeper.scheduler import ScheduledTask, run_sweeper

    settings = ctx.settings
    scheduled_parity: ScheduledTask | None = None
    if settings.parity_interval_hours > 0:
        from enrichq_parity.parity import run_scheduled  # only when parity is scheduled

        scheduled_parity = run_scheduled
    with ctx.database() as url:
        return run_sweeper(
            settings,
            url,
            once=once,
            tell=lambda line: say(line, ctx.err),
            scheduled_parity=scheduled_parity,
            wait_for_schema=not no_wait,
        )


def render_status(report: StatusReport, out: TextIO) -> None:
    """The report as rich tables."""
    from rich.markup import escape
    from rich.table import Table

    from enrichq_schema.text import printable
    from enrichq_service.controls.pauses import PauseScope

    console = render.console(out)
    states = [s.value for s in State]
    table = Table(title="enrichq queue")
    table.add_column("kind")
    for s in states:
        table.add_column(s, justify="right")
    table.add_column("oldest visible", justify="right")
    table.add_column("not visible yet", justify="right")
    for kind in sorted(report.counts) or ["enrich"]:
        row = report.counts.get(kind, {})
        age = report.oldest_visible_seconds.get(kind)
        table.add_row(
            kind,
            *(str(row.get(s, 0)) for s in states),
            f"{age:.0f} s" if age else "-",
            _upcoming(report.next_visible.get(kind)),
        )
    console.print(table)
    console.print(
        f"leases: {report.live_leases} live, {report.expired_leases} expired (awaiting sweep)"
    )
    for p in report.pauses:
        scope = PauseScope(p["kind"], p["tenant"]).describe()  # type: ignore[arg-type]  # JSON of a PauseScope
        why = f": {printable(p['reason'])}" if p["reason"] else ""
        console.print(
            f"[bold]PAUSED[/] {escape(scope)} since {p['paused_at']} by"
            f" {shown(p['paused_by'])}{escape(why)}"
        )
    if report.dead_letters:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(report.dead_letters.items()))
        console.print(f"dead letters by reason: {reasons}")
    else:
        console.print("dead letters: none")


def _upcoming(rows: dict[str, float] | None) -> str:
    """'12, the first in 4 min 10 s': queued rows waiting for their visibility, or '-'."""
    if not rows:
        return "-"
    seconds = max(0, round(rows["in_seconds"]))
    minutes, rest = divmod(seconds, 60)
    when = f"{minutes} min {rest} s" if minutes else f"{rest} s"
    return f"{int(rows['waiting']):,}, the first in {when}"
