"""`enrichq backfill`: validate, open the engine once, run the domain's backfill with a
progress display, print its record, return an exit code."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, TextIO

from enrichq_schema.process import Exit, say

if TYPE_CHECKING:
    from enrichq_schema.settings import Settings
    from enrichq_sweeper.backfill import BackfillResult

PLAIN_EVERY_PAGES = 10
"""Without a terminal, one progress line per this many pages."""


@contextmanager
def progress_display(total: int, out: TextIO) -> Iterator[Callable[[int], None]]:
    """A callback advancing a progress display by the tickets of a page: a rich bar on a
    terminal, a plain line every few pages otherwise (a log or a pipe)."""
    if out.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        with Progress(
            "backfill",
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(file=out),
            transient=True,
        ) as bar:
            task = bar.add_task("tickets", total=total)
            yield lambda n: bar.advance(task, n)
        return
    done = [0, 0]

    def line(n: int) -> None:
        done[0] += n
        done[1] += 1
        if done[1] % PLAIN_EVERY_PAGES == 0:
            print(f"backfill: {done[0]:,}/{total:,} tickets read", file=out, flush=True)

    yield line


def render(result: BackfillResult) -> str:
    """The one-paragraph summary of a backfill."""
    verb = "would enqueue" if result.dry_run else "enqueued"
    scope = "every tenant" if result.scope.tenant is None else f"tenant {result.scope.tenant!r}"
    if result.scope.since is not None:
        scope += f", created since {result.scope.since:%Y-%m-%d %H:%M} UTC"
    lines = [
        f"backfill ({scope}): {result.scanned:,} tickets consumers can read, "
        f"{result.never_enriched:,} never enriched; {verb} {result.enqueued:,} at the lowest "
        f"priority, {result.in_queue:,} already in the queue"
    ]
    if result.legacy_only:
        lines.append(
            f"note: {result.legacy_only:,} tickets have legacy rows but are missing from the "
            "tickets mirror: a worker retries them until the mirror has them"
        )
    if result.audit_id is not None:
        lines.append(f"audit #{result.audit_id}; follow it with `enrichq status` (kind backfill)")
    return "\n".join(lines)


def run_backfill(
    settings: Settings,
    url: str,
    *,
    tenant: str | None,
    since: datetime | None,
    dry_run: bool,
    page_size: int,
    actor: str,
) -> int:
    """0 done, 2 bad input (a missing table)."""
    from enrichq_schema.connections import create_engine
    from enrichq_sweeper import backfill
    from enrichq_sweeper.errors import BackfillInputError

    scope = backfill.Scope(tenant, since)
    engine = create_engine(
        settings,
        url,
        application_name="enrichq-backfill",
        pool_size=1,
        statement_timeout_seconds=settings.statement_timeout_seconds,
    )
    try:
        total = backfill.count(engine, settings, scope)
        with progress_display(total, sys.stderr) as advance:
            result = backfill.run(
                engine,
                settings,
                scope,
                actor=actor,
                dry_run=dry_run,
                page_size=page_size,
                progress=advance,
            )
    except BackfillInputError as exc:
        say(f"backfill: {exc}; nothing changed")
        return Exit.USAGE
    finally:
        engine.dispose()
    print(render(result))
    return Exit.OK
