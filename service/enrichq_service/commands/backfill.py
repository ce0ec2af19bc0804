"""`enrichq backfill`: enqueue what consumers can read and enrichq never enriched."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from enrichq_schema.process import Exit
from enrichq_service.commands import options
from enrichq_service.commands.base import Context, refuse
from enrichq_service.commands.progress import progress_display

if TYPE_CHECKING:
    from enrichq_sweeper.backfill import BackfillResult


def backfill(
    ctx: Context,
    *,
    tenant: str | None,
    since: str | None,
    dry_run: bool,
    page_size: int,
    actor: str | None,
) -> int:
    """0 done, 2 bad input (a missing table)."""
    ctx.settings  # noqa: B018 -- a bad setting stops the command before any other check
    since_at = options.day(since, "--since")
    options.tenant("backfill", tenant)
    who = options.actor("backfill", actor)
    return run(ctx, tenant=tenant, since=since_at, dry_run=dry_run, page_size=page_size, actor=who)


def run(
    ctx: Context,
    *,
    tenant: str | None,
    since: datetime | None,
    dry_run: bool,
    page_size: int,
    actor: str,
) -> int:
    """The backfill of checked options, its progress on stderr and its summary on stdout."""
    from enrichq_sweeper import backfill
    from enrichq_sweeper.errors import BackfillInputError

    settings = ctx.settings
    scope = backfill.BackfillScope(tenant, since)
    with ctx.opened("enrichq-backfill") as engine:
        try:
            total = backfill.count(engine, settings, scope)
            with progress_display(total, ctx.err) as advance:
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
            refuse(f"backfill: {exc}; nothing changed")
    print(render(result), file=ctx.out)
    return Exit.OK


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
