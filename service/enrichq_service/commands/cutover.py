"""`enrichq cutover [--rollback] [--tenant T]... | --status`: move consumers between the
legacy rows and enrichq's, or show what they read. The gate and the swap are
`enrichq_parity.cutover`'s; this module checks the options and renders the outcome."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from enrichq_schema.process import Exit
from enrichq_schema.text import utc_time
from enrichq_service.commands import options, render
from enrichq_service.commands.base import Context, refuse
from enrichq_service.commands.parity import failure

if TYPE_CHECKING:
    from enrichq_parity.cutover import Action, Status

WAIT_SECONDS_DEFAULT = 60.0
"""`--wait`'s default (`enrichq_parity.cutover.WAIT_SECONDS_DEFAULT`)."""


def cutover(
    ctx: Context,
    *,
    rollback: bool,
    tenants: Sequence[str],
    exclude: Sequence[str],
    show_status: bool,
    as_json: bool,
    actor: str | None,
    wait_seconds: float,
) -> int:
    """Check the combination of options, then run (or show) the cutover."""
    if show_status and (rollback or tenants or exclude or actor is not None):
        refuse(
            "cutover: --status only shows the state; it takes no --rollback, --tenant or --actor"
        )
    if exclude and (tenants or rollback):
        refuse("cutover: --exclude-tenant goes with a whole cutover, not --tenant or --rollback")
    if as_json and not show_status:
        refuse("cutover: --json goes with --status")
    ctx.settings  # noqa: B018 -- a bad setting stops the command before any other check
    return run(
        ctx,
        rollback=rollback,
        actor=actor,
        tenants=tenants,
        exclude=exclude,
        show_status=show_status,
        as_json=as_json,
        wait_seconds=wait_seconds,
    )


def run(
    ctx: Context,
    *,
    rollback: bool,
    actor: str | None,
    tenants: Sequence[str] = (),
    exclude: Sequence[str] = (),
    show_status: bool = False,
    as_json: bool = False,
    wait_seconds: float = WAIT_SECONDS_DEFAULT,
) -> int:
    """0 done (or nothing to do), 1 refused, 2 bad input."""
    import sqlalchemy as sa

    from enrichq_parity import cutover
    from enrichq_parity.cutover import LOCK_TIMEOUT, VIEW, Action

    action = Action.ROLLBACK if rollback else Action.CUTOVER
    who = options.actor("cutover", actor)
    chosen = options.tenants("cutover", tenants) if tenants else None
    excluded = options.tenants("cutover", exclude)
    settings = ctx.settings
    try:
        with ctx.opened("enrichq-cutover") as engine:
            if show_status:
                with engine.connect() as conn:
                    report = cutover.status(conn, settings)
                if as_json:
                    print(json.dumps(report.as_dict(), indent=2), file=ctx.out)
                else:
                    render_status(report, ctx.out)
                return Exit.OK
            result = cutover.repoint_waiting(
                engine,
                settings,
                action=action,
                tenants=chosen,
                actor=who,
                exclude=excluded,
                wait_seconds=wait_seconds,
                on_retry=lambda tries: _waiting(ctx, action, tries),
            )
    except (cutover.CutoverRefused, cutover.CutoverError) as exc:
        failure(action.value, exc)
    except sa.exc.OperationalError as exc:
        if not cutover.lock_not_available(exc):
            raise
        refuse(
            f"{action.value}: {VIEW} is held by a long-running reader (tried for "
            f"{wait_seconds:g} s, readers never held up longer than {LOCK_TIMEOUT}); nothing "
            "changed: end that reader or try again with a longer --wait",
            Exit.FAILED,
        )
    print(f"{action.value}: {result.message}", file=ctx.out)
    return Exit.OK


def _waiting(ctx: Context, action: Action, tries: int) -> None:
    """Tell the operator, once and then every 10 tries, why the step has not happened yet."""
    from enrichq_parity.cutover import LOCK_TIMEOUT, VIEW

    if tries == 1 or tries % 10 == 0:
        print(
            f"{action.value}: waiting for readers of {VIEW} to let the swap through "
            f"(try {tries}); readers are held up {LOCK_TIMEOUT} at most per try",
            file=ctx.err,
        )


def render_status(report: Status, out: TextIO) -> None:
    """Per tenant: what consumers read, since when, moved by whom (140 columns wide when
    `out` is no terminal to fit)."""
    from rich.table import Table

    from enrichq_parity.cutover import SHADOW_TABLE, VIEW, tenant_name

    console = render.console(out, width=140)
    console.print(f"{VIEW} reads {report.description}", highlight=False, markup=False)
    if not report.tenants:
        console.print("no tenant known yet (none in the latest parity run, none ever moved)")
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("tenant", "reads", "since (UTC)", "by", "event", "parity run"):
        table.add_column(name)
    for t in report.tenants:
        table.add_row(
            tenant_name(t.tenant),
            t.reads,
            utc_time(t.since, seconds=True),
            t.actor or "—",
            "—" if t.event_id is None else f"#{t.event_id}",
            "—" if t.parity_run_id is None else f"#{t.parity_run_id}",
            style="green" if t.reads == SHADOW_TABLE else None,
        )
    console.print(table)
