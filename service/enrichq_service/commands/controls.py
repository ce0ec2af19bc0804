"""The operator controls' commands: `enrichq cancel`, `dlq list|redrive|discard`, `pause`,
`resume` and `audit`. Each checks its options before any connection, runs the domain's
action (`enrichq_service.controls.actions`, `.pauses`, `.dlq`, `enrichq_schema.audit`) on one
engine, and renders the record it returns."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TextIO

from enrichq_schema.process import Exit
from enrichq_schema.states import AuditCommand
from enrichq_schema.text import printable, utc_time
from enrichq_service.commands import options, render
from enrichq_service.commands.base import Context, refuse
from enrichq_service.commands.progress import Progress, confirm_every_row
from enrichq_service.commands.render import shown
from enrichq_service.terminal import say

if TYPE_CHECKING:
    from enrichq_schema.audit import AuditEntry
    from enrichq_service.controls.actions import ActionResult, ActionStopped
    from enrichq_service.controls.dlq import DeadLetter
    from enrichq_service.controls.filters import Filter
    from enrichq_service.controls.pauses import Pause, PauseScope

ERROR_COLUMN_WIDTH = 60
"""How much of a dead letter's last error `dlq list` shows."""

# -- cancel, dlq discard, dlq redrive: one filter language


def act(ctx: Context, command: str, given: Mapping[str, Any]) -> int:
    """Parse the filter (bad input: one line, exit 2, before any connection), then act:
    `--all` asks for confirmation on a terminal (cancel, discard; --yes skips it), and a run
    of more than one batch shows its progress on stderr."""
    from enrichq_service.controls.actions import SCOPE_OF
    from enrichq_service.controls.errors import FilterError
    from enrichq_service.controls.filters import Filter
    from enrichq_sweeper.common import DEFAULT_BATCH_SIZE

    action = AuditCommand(command)
    # what is not how to act (--actor, --dry-run, --json, --yes) is the filter's criteria
    criteria = dict(given)
    actor, dry_run, as_json = (criteria.pop(name) for name in ("actor", "dry_run", "as_json"))
    yes = bool(criteria.pop("yes", False))
    options.unpadded(command, "--tenant", criteria["tenant"])
    try:
        flt = Filter.build(SCOPE_OF[action], **criteria)
    except FilterError as exc:
        refuse(f"{command}: {exc}")
    who = options.actor(command, actor)
    ask = confirm_every_row(command, yes=yes) if flt.all_rows and "yes" in given else None
    progress = Progress(command, batch_size=DEFAULT_BATCH_SIZE, stream=ctx.err)

    def before(would: ActionResult) -> bool:
        if ask is not None and not ask(would):
            return False
        progress.start(would)
        return True

    return run_action(
        ctx,
        action,
        flt,
        actor=who,
        dry_run=dry_run,
        as_json=as_json,
        batch_size=DEFAULT_BATCH_SIZE,
        confirm=before,
        on_batch=progress.batch,
        on_end=progress.stop,
    )


def run_action(
    ctx: Context,
    command: AuditCommand,
    flt: Filter,
    *,
    actor: str,
    dry_run: bool,
    as_json: bool = False,
    batch_size: int,
    confirm: Callable[[ActionResult], bool] | None = None,
    on_batch: Callable[[int, Mapping[str, int]], None] | None = None,
    on_end: Callable[[], None] | None = None,
) -> int:
    """Run an action of a checked filter and render what it did (or would do).

    `confirm` and `on_batch` are `enrichq_service.controls.actions.run`'s; `on_end` is told when
    the action ends, however it ends, before anything is rendered (a progress display
    stops there)."""
    from enrichq_schema import audit
    from enrichq_service.controls import actions as controls
    from enrichq_service.controls.errors import FilterError

    settings = ctx.settings
    try:
        with ctx.opened(f"enrichq-{command.value}", statement_timeout=False) as engine:
            result = controls.run(
                engine,
                command,
                flt,
                actor=actor,
                dry_run=dry_run,
                batch_size=batch_size,
                statement_timeout_seconds=settings.statement_timeout_seconds,
                confirm=confirm,
                on_batch=on_batch,
            )
    except (FilterError, audit.AuditInputError) as exc:
        refuse(f"{command.value}: {exc}; nothing changed")
    except controls.ActionStopped as stopped:
        refuse(stopped_message(stopped, settings.statement_timeout_seconds), Exit.FAILED)
    except KeyboardInterrupt:
        refuse(
            f"{command.value}: interrupted; the batches committed so far stay done "
            "(`enrichq audit` shows how many rows)",
            Exit.INTERRUPTED,
        )
    finally:
        if on_end is not None:
            on_end()
    if result.dry_run and not dry_run:
        refuse(f"{command.value}: not confirmed; nothing changed", Exit.FAILED)
    if as_json:
        print(json.dumps(result_json(result), default=str), file=ctx.out)
    else:
        render_result(result, ctx.out)
    return Exit.OK


def stopped_message(stopped: ActionStopped, statement_timeout_seconds: float) -> str:
    """One line: why an action stopped, and what it committed before (which stays done)."""
    from enrichq_schema.errors import describe_database_error

    done = stopped.done
    if stopped.timed_out:
        why = (
            f"a statement ran past the statement timeout ({statement_timeout_seconds:g} s, "
            "ENRICHQ_STATEMENT_TIMEOUT_SECONDS)"
        )
    else:
        why = describe_database_error(stopped.cause) or str(stopped.cause).splitlines()[0]
    if done.audit_id is None:
        return f"{done.command.value}: stopped while selecting rows: {why}; nothing changed"
    if done.batches == 0:
        return (
            f"{done.command.value}: stopped during its first batch: {why}; nothing changed "
            f"(audit id {done.audit_id} records the attempt)"
        )
    return (
        f"{done.command.value}: stopped during batch {done.batches + 1}: {why}; the batches "
        f"before it committed and stay done: {done_counts(done)}; run it again for the rest"
    )


def result_json(result: ActionResult) -> dict[str, Any]:
    """An action's result as one JSON object."""
    return {
        "command": result.command.value,
        "dry_run": result.dry_run,
        "filter": result.filter.as_json(),
        "matched": result.matched,
        "affected": result.affected,
        "counts": dict(result.counts),
        "states": dict(result.states),
        "batches": result.batches,
        "audit_id": result.audit_id,
        "sample": [asdict(s) for s in result.sample],
    }


VERB = {
    AuditCommand.CANCEL: ("cancel", "cancelled"),
    AuditCommand.DLQ_DISCARD: ("discard", "discarded"),
    AuditCommand.DLQ_REDRIVE: ("redrive", "redriven"),
}


def render_result(result: ActionResult, out: TextIO) -> None:
    """One summary line; a dry run adds the sample as a table."""
    from enrichq_service.controls.filters import Scope

    verb, _ = VERB[result.command]
    what = "row" if result.filter.scope is Scope.OPEN else "dead letter"
    one = result.matched == 1
    states = ""
    if result.states:
        states = " (" + ", ".join(f"{n} {s}" for s, n in result.states.items()) + ")"
    where = printable(result.filter.describe())
    if result.dry_run:
        if result.command is AuditCommand.DLQ_REDRIVE and result.counts["merged"]:
            would = (
                f"would redrive {result.counts['redriven']} and merge "
                f"{result.counts['merged']} (left dead: their ticket has a newer match or a "
                "queued row)"
            )
        else:
            would = f"would {verb} {'it' if one else 'them'}"
        print(
            f"{result.matched} {what}{'' if one else 's'}{states} "
            f"{'matches' if one else 'match'} {where}; {would} (dry run: nothing changed)",
            file=out,
        )
        _render_sample(result, out)
        return
    print(
        f"{result.matched} {what}{'' if one else 's'} matched {where}: {done_counts(result)}",
        file=out,
    )


def done_counts(result: ActionResult) -> str:
    """What a run did, as the end of its summary line (or of the line saying it stopped)."""
    _, done = VERB[result.command]
    if result.command is AuditCommand.DLQ_REDRIVE:
        counts = (
            f"{result.counts['redriven']} redriven, {result.counts['merged']} merged "
            "(left dead: their ticket has a newer match or a queued row)"
        )
    else:
        counts = f"{result.affected} {done}"
        if result.command is AuditCommand.CANCEL and result.affected:
            counts += f" ({result.counts['queued']} queued, {result.counts['leased']} leased)"
        if result.counts.get("kept"):
            counts += (
                f", {result.counts['kept']} kept (new work merged into "
                f"{'it' if result.counts['kept'] == 1 else 'them'} after the cancel began)"
            )
    return (
        f"{counts}; {result.batches} batch{'' if result.batches == 1 else 'es'}, "
        f"audit id {result.audit_id}"
    )


def _render_sample(result: ActionResult, out: TextIO) -> None:
    from rich.table import Table

    from enrichq_service.controls.filters import Scope

    if not result.sample:
        return
    table = Table(title=f"first {len(result.sample)} of {result.matched} (in the order worked)")
    open_scope = result.filter.scope is Scope.OPEN
    columns = ["id", "kind", "key", "tenant", "state" if open_scope else "dead reason"]
    columns += ["reason", "attempts", "created (UTC)" if open_scope else "dead since (UTC)"]
    for column in columns:
        # keys and tenants wrap instead of being cut: an operator must see all of them
        table.add_column(
            column,
            justify="right" if column == "id" else "left",
            overflow="fold" if column in {"key", "tenant"} else "ellipsis",
        )
    for r in result.sample:
        when = r.created_at if open_scope else (r.finished_at or r.created_at)
        table.add_row(
            str(r.id),
            shown(r.kind),
            shown(r.key),
            shown(r.tenant or ""),
            r.state if open_scope else (r.dead_reason or ""),
            r.reason,
            f"{r.attempts}/{r.max_attempts}",
            utc_time(when, seconds=True),
        )
    render.console(out).print(table)


# -- dlq list


def dlq_list(ctx: Context, *, reason: str | None, limit: int, as_json: bool) -> int:
    """Dead letters newest first: a table, or one JSON object per line."""
    from enrichq_service.controls.dlq import list_dead
    from enrichq_service.controls.errors import DlqInputError

    try:
        with ctx.opened("enrichq-dlq") as engine, engine.connect() as conn:
            rows = list_dead(conn, reason=reason, limit=limit)
    except DlqInputError as exc:
        refuse(str(exc))
    if as_json:
        render.json_lines(rows, ctx.out)
    else:
        render_dead_letters(rows, ctx.out)
    return Exit.OK


def render_dead_letters(rows: Sequence[DeadLetter], out: TextIO) -> None:
    """The dead letters as a rich table; keys, tenants and errors escaped."""
    table = render.newest_first("dead letters", len(rows), none="no dead letters", out=out)
    if table is None:
        return
    for column in ("id", "kind", "key", "tenant", "dead reason", "by", "attempts", "finished"):
        table.add_column(
            column,
            justify="right" if column in {"id", "by"} else "left",
            overflow="fold" if column in {"key", "tenant"} else "ellipsis",
        )
    table.add_column("last error", overflow="ellipsis", max_width=ERROR_COLUMN_WIDTH)
    for r in rows:
        # keys and tenants stored before ingest refused control characters, and errors,
        # are shown escaped: no terminal escape or markup reaches the screen
        table.add_row(
            str(r.id),
            shown(r.kind),
            shown(r.key),
            shown(r.tenant or ""),
            r.dead_reason,
            _superseder(r),
            f"{r.attempts}/{r.max_attempts}",
            r.finished_at.isoformat(timespec="seconds"),
            shown((r.last_error or "").splitlines()[0]) if r.last_error else "",
        )
    render.console(out).print(table)


def _superseder(row: DeadLetter) -> str:
    """The 'by' column: the superseding row and its state, or that it was pruned."""
    if row.superseded_by is None:
        return ""
    return f"{row.superseded_by} ({row.superseded_by_state or 'pruned'})"


# -- pause, resume


def pause_scope(command: str, kind: str | None, tenant: str | None) -> PauseScope:
    """The scope of `--kind` and `--tenant`, checked."""
    from enrichq_service.controls.errors import PauseError
    from enrichq_service.controls.pauses import PauseScope

    options.unpadded(command, "--tenant", tenant)
    try:
        return PauseScope.build(kind=kind, tenant=tenant)
    except PauseError as exc:
        refuse(f"{command}: {exc}; nothing changed")


def _listing(pauses: Sequence[Pause]) -> str:
    return "; ".join(p.scope.describe() for p in pauses) or "nothing"


def pause(
    ctx: Context,
    *,
    kind: str | None,
    tenant: str | None,
    reason: str | None,
    actor: str | None,
    as_json: bool,
) -> int:
    """`enrichq pause`: pause, print what is paused now; the exit code."""
    from enrichq_service.controls import pauses
    from enrichq_service.controls.errors import PauseError
    from enrichq_service.controls.pauses import PauseScope, check_reason

    paused = pause_scope("pause", kind, tenant)
    who = options.actor("pause", actor)
    try:
        reason = check_reason(reason)
    except PauseError as exc:
        refuse(f"pause: {exc}; nothing changed")
    with ctx.opened("enrichq-pause", statement_timeout=False) as engine, engine.begin() as conn:
        done, created = pauses.pause(conn, paused, actor=who, reason=reason)
        known = paused == PauseScope() or pauses.seen(conn, paused)
    if not known:
        say(
            f"pause: warning: no work of {paused.describe()} has ever been seen (no plan, no "
            "claims, no open rows): the pause is in place but may stop nothing; check the "
            "spelling (`enrichq status` lists the pauses)",
            ctx.err,
        )
    if as_json:
        line = json.dumps({"paused": done.as_json(), "created": created, "seen": known})
        print(line, file=ctx.out)
    elif created:
        print(
            f"paused {done.scope.describe()}: no worker claims its work until resumed"
            + ("" if known else " (none seen so far)"),
            file=ctx.out,
        )
    else:
        since = f"{utc_time(done.paused_at, seconds=True)} UTC"
        print(
            f"{done.scope.describe()} was already paused (since {since} by {done.paused_by})",
            file=ctx.out,
        )
    return Exit.OK


def resume(
    ctx: Context,
    *,
    kind: str | None,
    tenant: str | None,
    all_pauses: bool,
    actor: str | None,
    as_json: bool,
) -> int:
    """`enrichq resume`: resume one scope (or every pause); the exit code (1 when nothing
    was paused at that scope: what is paused is said, nothing changed)."""
    from enrichq_service.controls import pauses

    if all_pauses and (kind is not None or tenant is not None):
        refuse("resume: --all stands alone (no --kind or --tenant); nothing changed")
    scope = None if all_pauses else pause_scope("resume", kind, tenant)
    who = options.actor("resume", actor)
    with ctx.opened("enrichq-resume", statement_timeout=False) as engine, engine.begin() as conn:
        resumed = pauses.resume(conn, scope, actor=who)
        left = pauses.in_place(conn)
    if as_json:
        line = json.dumps(
            {
                "resumed": [p.as_json() for p in resumed],
                "still_paused": [p.as_json() for p in left],
            }
        )
        print(line, file=ctx.out)
        return Exit.OK if resumed else Exit.FAILED
    if not resumed:
        asked = "any scope" if scope is None else scope.describe()
        refuse(
            f"resume: nothing is paused at {asked}; paused: {_listing(left)}; nothing changed",
            Exit.FAILED,
        )
    still = f"; still paused: {_listing(left)}" if left else ""
    print(f"resumed {_listing(resumed)}{still}", file=ctx.out)
    return Exit.OK


# -- audit


def audit(ctx: Context, *, limit: int, command: str | None, as_json: bool) -> int:
    """The newest `limit` operator actions: a table, or one JSON object per line."""
    from enrichq_schema.audit import AuditInputError, recent

    try:
        with ctx.opened("enrichq-audit") as engine, engine.connect() as conn:
            entries = recent(conn, limit=limit, command=command)
    except AuditInputError as exc:
        refuse(f"audit: {exc}")
    if as_json:
        render.json_lines(entries, ctx.out)
    else:
        render_audit(entries, ctx.out)
    return Exit.OK


def describe_filter(stored: Mapping[str, Any]) -> str:
    """A stored filter as `name=value` pairs (lists joined by commas), scope and options
    not given (None, False, empty) left out."""
    parts = []
    for name, value in stored.items():
        if name == "scope" or value is None or value is False or value == []:
            continue
        if value is True:
            parts.append(name)
        elif isinstance(value, list):
            parts.append(f"{name}={','.join(str(v) for v in value)}")
        else:
            parts.append(f"{name}={value}")
    return " ".join(parts) or "-"


def render_audit(entries: Sequence[AuditEntry], out: TextIO) -> None:
    """The actions as a rich table; actors, filters and notes escaped."""
    table = render.newest_first(
        "operator actions", len(entries), none="no operator actions recorded", out=out
    )
    if table is None:
        return
    for column in ("id", "at (UTC)", "command", "actor", "rows", "filter", "finished", "note"):
        table.add_column(column, justify="right" if column in {"id", "rows"} else "left")
    for e in entries:
        finished = "no (interrupted or running)" if e.finished_at is None else "yes"
        table.add_row(
            str(e.id),
            utc_time(e.at, seconds=True),
            e.command,
            shown(e.actor),
            str(e.rows_affected),
            shown(describe_filter(e.filter)),
            finished,
            shown(e.note or ""),
        )
    render.console(out).print(table)
