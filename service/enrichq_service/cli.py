"""The ``enrichq`` command line. Heavy imports happen inside the commands that need them."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypedDict, Unpack

import click

from enrichq_schema.errors import SettingsError
from enrichq_schema.process import Exit
from enrichq_schema.states import AuditCommand, DeadReason, Kind, Reason
from enrichq_service.commands import backfill as backfill_commands
from enrichq_service.commands import controls as control_commands
from enrichq_service.commands import cutover as cutover_commands
from enrichq_service.commands import demo as demo_commands
from enrichq_service.commands import migrate as migrate_commands
from enrichq_service.commands import parity as parity_commands
from enrichq_service.commands import queue as queue_commands
from enrichq_service.commands.base import CommandError, Context
from enrichq_service.commands.options import ROW_ID
from enrichq_service.terminal import say

# A file that `enrichq parity` writes (or, for --accept, reads).
REPORT_FILE = click.Path(dir_okay=False, path_type=Path)
pass_context = click.make_pass_decorator(Context)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="ENRICHQ_CONFIG",
    help="TOML file of settings (environment variables win over it).",
)
@click.version_option(package_name="enrichq")
@click.pass_context
def cli(ctx: click.Context, config_file: Path | None) -> None:
    """enrichq: ticket enrichment on a leased Postgres queue, with shadow run and cutover."""
    ctx.obj = Context(config_file)


@cli.command()
@click.option(
    "--check",
    is_flag=True,
    help="Change nothing: exit 0 when the schema is at head, 1 while it is behind.",
)
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="With --check: keep checking (every 2 s) until head, for up to SECONDS.",
)
@pass_context
def migrate(ctx: Context, check: bool, wait: float | None) -> int:
    """Create or upgrade enrichq's tables (a no-op when already at the newest revision).

    With --check, only say whether the schema is at head: the gate of a worker's or a
    sweeper's init container, so they start after the migration of their release.
    """
    return migrate_commands.migrate(ctx, check=check, wait=wait)


@cli.command()
@click.argument("keys", nargs=-1, required=True)
@click.option(
    "--reason",
    type=click.Choice(["created", "updated", "refresh", "manual"]),
    default="manual",
    show_default=True,
    help="Why; created/updated pick the visibility delay, manual is visible now.",
)
@click.option("--tenant", default=None, help="Brand or account the ticket belongs to.")
@click.option(
    "--kind", type=click.Choice(["enrich", "refresh"]), default="enrich", show_default=True
)
@pass_context
def enqueue(ctx: Context, keys: tuple[str, ...], reason: str, tenant: str | None, kind: str) -> int:
    """Enqueue tickets KEYS for enrichment; a ticket already queued is merged."""
    return queue_commands.enqueue(ctx, keys=keys, reason=reason, tenant=tenant, kind=kind)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@pass_context
def status(ctx: Context, as_json: bool) -> int:
    """Queue counts by state and kind, oldest visible age, live leases, dead letters."""
    return queue_commands.status(ctx, as_json=as_json)


@cli.command()
@click.option("--drain", is_flag=True, help="Exit when no visible work is left.")
@click.option(
    "--time-budget",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop claiming after this many seconds, finish in-flight work, exit.",
)
@click.option(
    "--no-wait",
    is_flag=True,
    help="Before `enrichq migrate` has run: exit 2 instead of waiting for the schema.",
)
@pass_context
def worker(ctx: Context, drain: bool, time_budget: float | None, no_wait: bool) -> int:
    """Claim and enrich tickets until stopped (SIGTERM/SIGINT finish in-flight work)."""
    return queue_commands.worker(ctx, drain=drain, time_budget=time_budget, no_wait=no_wait)


@cli.command()
@click.option(
    "--no-wait",
    is_flag=True,
    help="Before `enrichq migrate` has run: exit 2 instead of waiting for the schema.",
)
@pass_context
def serve(ctx: Context, no_wait: bool) -> int:
    """HTTP ingest (POST /v1/events), health, /metrics and a worker in one process."""
    return queue_commands.serve(ctx, no_wait=no_wait)


@cli.command()
@click.option("--once", is_flag=True, help="Run every task once and exit.")
@click.option(
    "--no-wait",
    is_flag=True,
    help="Before `enrichq migrate` has run: exit 2 instead of waiting for the schema.",
)
@pass_context
def sweep(ctx: Context, once: bool, no_wait: bool) -> int:
    """Recover expired leases, dead-letter spent rows, prune old rows, enqueue refreshes."""
    return queue_commands.sweep(ctx, once=once, no_wait=no_wait)


@cli.group()
def dlq() -> None:
    """Inspect, redrive and discard dead letters."""


@dlq.command("list")
@click.option("--reason", type=click.Choice([r.value for r in DeadReason]))
@click.option("--limit", type=click.IntRange(min=1, max=10_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@pass_context
def dlq_list(ctx: Context, reason: str | None, limit: int, as_json: bool) -> int:
    """List dead letters, newest first."""
    return control_commands.dlq_list(ctx, reason=reason, limit=limit, as_json=as_json)


# -- operator controls: one filter language for cancel, dlq discard and dlq redrive

FILTER_HELP = """
FILTER is any combination of --id (repeatable), --key (repeatable), --tenant, --kind,
--reason and --older-than, all of which must hold (repeated values: any of them), or --all
alone. A dry run prints how many rows match and a sample, and changes nothing. The rows
that match when the command starts are worked in batches, each its own transaction, and
the action is recorded in the audit log (`enrichq audit`).
"""


ACTOR_OPTION = click.option("--actor", default=None, help="Who does this (default: the OS user).")
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def stacked(options: Sequence[Decorator]) -> Decorator:
    """One decorator applying `options` as if stacked in that order above a command."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def filter_options(reasons: list[str], reason_help: str, older_help: str) -> Decorator:
    """The options every filtered action takes (enrichq_service.controls.filters reads them)."""
    options = [
        click.option("--id", "ids", type=ROW_ID, multiple=True, help="Row id (repeat)."),
        click.option("--key", "keys", multiple=True, help="Ticket id (repeat)."),
        click.option("--tenant", default=None, help="Brand or account."),
        click.option("--kind", type=click.Choice([k.value for k in Kind]), default=None),
        click.option("--reason", type=click.Choice(reasons), default=None, help=reason_help),
        click.option("--older-than", metavar="DURATION", default=None, help=older_help),
        click.option("--all", "all_rows", is_flag=True, help="Every row (alone)."),
        click.option("--dry-run", is_flag=True, help="Count and show a sample; change nothing."),
        ACTOR_OPTION,
        JSON_OPTION,
    ]
    return stacked(options)


YES_OPTION = click.option(
    "--yes", is_flag=True, help="With --all on a terminal: do not ask for confirmation."
)

# The filter of cancel (queued and leased rows), and of dlq redrive and discard.
open_row_filter = filter_options(
    [r.value for r in Reason],
    "Why it was enqueued.",
    "Enqueued more than DURATION ago (90m, 2h, 7d).",
)
dead_letter_filter = filter_options(
    [r.value for r in DeadReason],
    "Why it died.",
    "Dead-lettered more than DURATION ago (90m, 2h, 7d).",
)


@dlq.command("redrive", epilog=FILTER_HELP)
@dead_letter_filter
@pass_context
def dlq_redrive(ctx: Context, /, **options: Any) -> int:
    """Put dead letters matching FILTER back in the queue with fresh attempts.

    Per ticket the newest matching dead letter is queued again (visible now, reason
    redrive); the others stay dead, merged into it or into the ticket's queued row.
    """
    return control_commands.act(ctx, "dlq redrive", options)


@dlq.command("discard", epilog=FILTER_HELP)
@dead_letter_filter
@YES_OPTION
@pass_context
def dlq_discard(ctx: Context, /, **options: Any) -> int:
    """Delete dead letters matching FILTER (for good: there is no undo)."""
    return control_commands.act(ctx, "dlq discard", options)


@cli.command(epilog=FILTER_HELP)
@open_row_filter
@YES_OPTION
@pass_context
def cancel(ctx: Context, /, **options: Any) -> int:
    """Cancel queued and leased rows matching FILTER: they become dead letters (cancelled).

    A cancelled row that a worker holds is fenced: the worker's heartbeat and result are
    refused, so nothing it computes is written. Redrive brings cancelled rows back.
    """
    return control_commands.act(ctx, "cancel", options)


PAUSE_HELP = """
A pause stops claims, not ingest: events still enqueue and merge, and leases already held
finish normally. Running workers obey it at their next claim (within
ENRICHQ_POLL_SECONDS), with no restart. `enrichq status` lists the pauses in place.
"""


class ScopeOptions(TypedDict):
    """What pause and resume both take: the scope, who acts, and how to print."""

    kind: str | None
    tenant: str | None
    actor: str | None
    as_json: bool


def scope_options(whose: str, *own: Decorator) -> Decorator:
    """The options of `ScopeOptions` (`whose` says whose kind and tenant they name), with a
    command's `own` options after the scope in --help."""
    kinds = click.Choice([k.value for k in Kind])
    options: list[Decorator] = [
        click.option("--kind", type=kinds, help=f"{whose.capitalize()} kind."),
        click.option("--tenant", default=None, help=f"{whose.capitalize()} brand or account."),
        *own,
        ACTOR_OPTION,
        JSON_OPTION,
    ]
    return stacked(options)


@cli.command(epilog=PAUSE_HELP)
@scope_options(
    "only this",
    click.option("--reason", default=None, help="Why (shown by status and the audit log)."),
)
@pass_context
def pause(ctx: Context, /, *, reason: str | None, **scope: Unpack[ScopeOptions]) -> int:
    """Stop workers claiming work of a kind, a tenant, both, or (neither given) all work."""
    return control_commands.pause(ctx, reason=reason, **scope)


@cli.command(epilog=PAUSE_HELP)
@scope_options(
    "the paused",
    click.option("--all", "all_pauses", is_flag=True, help="Every pause in place (alone)."),
)
@pass_context
def resume(ctx: Context, /, *, all_pauses: bool, **scope: Unpack[ScopeOptions]) -> int:
    """Resume the pause of exactly this scope (as it was paused), or --all of them."""
    return control_commands.resume(ctx, all_pauses=all_pauses, **scope)


@cli.command()
@click.option("--limit", type=click.IntRange(min=1, max=10_000), default=50, show_default=True)
@click.option("--command", "command", type=click.Choice([c.value for c in AuditCommand]))
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@pass_context
def audit(ctx: Context, limit: int, command: str | None, as_json: bool) -> int:
    """Operator actions (cancel, dlq discard/redrive, pause, resume), newest first."""
    return control_commands.audit(ctx, limit=limit, command=command, as_json=as_json)


@cli.group(invoke_without_command=True)
@click.option(
    "--since",
    help="Start of the window (YYYY-MM-DD or ISO time, UTC); default ENRICHQ_PARITY_WINDOW_DAYS.",
)
@click.option("--until", help="End of the window (exclusive); default now.")
@click.option("--json", "json_path", type=REPORT_FILE, help="Write the JSON report.")
@click.option(
    "--html", "html_path", type=REPORT_FILE, help="Write the HTML report (one self-contained file)."
)
@click.option(
    "--csv",
    "csv_path",
    type=REPORT_FILE,
    help="Export every differing ticket (class, fault, accepting rules, order ids).",
)
@click.option(
    "--accept",
    "accept_path",
    type=REPORT_FILE,
    help="TOML file of reviewed differences to accept (docs/cutover.md).",
)
@click.pass_context
def parity(
    click_ctx: click.Context, /, *, since: str | None, until: str | None, **files: Path | None
) -> int:
    """Compare shadow output with legacy output (exit 1 below the bars); review the runs.

    Without a command, runs a comparison. The commands sign and list recorded runs.
    """
    ctx = click_ctx.find_object(Context)
    assert ctx is not None  # the root command always sets it
    return parity_commands.compare(
        ctx,
        subcommand=click_ctx.invoked_subcommand,
        since=since,
        until=until,
        **files,
    )


@parity.command("approve", short_help="Sign a reviewed run (cutover needs one).")
@click.argument("run_id", type=click.IntRange(min=1))
@click.option("--by", "by", required=True, help="Who approves: the reviewer's name.")
@click.option("--note", default=None, help="What was checked, or why it is fine.")
@pass_context
def parity_approve(ctx: Context, run_id: int, by: str, note: str | None) -> int:
    """Sign parity run RUN_ID after reviewing its report (cutover needs a signed run)."""
    return parity_commands.approve(ctx, run_id=run_id, by=by, note=note)


@parity.command("runs", short_help="Recent runs: verdict, rules, approvals.")
@click.option("--limit", type=click.IntRange(min=1, max=1000), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@pass_context
def parity_runs(ctx: Context, limit: int, as_json: bool) -> int:
    """Recent parity runs, newest first: verdict, accepted rules, approvals."""
    return parity_commands.runs(ctx, limit=limit, as_json=as_json)


@parity.command("show", short_help="A recorded run's summary and reports, again.")
@click.argument("run_id", type=click.IntRange(min=1))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path))
@pass_context
def parity_show(ctx: Context, run_id: int, json_path: Path | None, html_path: Path | None) -> int:
    """A recorded run's summary; its reports again, with the approvals it has now."""
    return parity_commands.show(ctx, run_id=run_id, json_path=json_path, html_path=html_path)


@cli.command()
@click.option("--rollback", is_flag=True, help="Point consumers back at the legacy table.")
@click.option(
    "--tenant",
    "tenants",
    multiple=True,
    help="Move only this tenant (repeat): a staged cutover. Default: every tenant.",
)
@click.option(
    "--exclude-tenant",
    "exclude",
    multiple=True,
    help="Move every tenant but this one (repeat); it stays on the legacy rows.",
)
@click.option(
    "--status", "show_status", is_flag=True, help="Per tenant: what consumers read, since when."
)
@click.option("--json", "as_json", is_flag=True, help="With --status: print JSON.")
@click.option("--actor", default=None, help="Who does this (default: the OS user).")
@click.option(
    "--wait",
    "wait_seconds",
    type=click.FloatRange(min=0, max=3600),
    default=60.0,
    show_default=True,
    help="Seconds to keep trying while readers hold the view (each try holds readers up "
    "at most 200 ms).",
)
@pass_context
def cutover(
    ctx: Context,
    *,
    rollback: bool,
    tenants: tuple[str, ...],
    exclude: tuple[str, ...],
    show_status: bool,
    as_json: bool,
    actor: str | None,
    wait_seconds: float,
) -> int:
    """Point consumers at the shadow table, after a passing, fresh and approved parity run
    that every tenant moved passes on its own, once no ticket consumers can read is still
    never enriched (`enrichq backfill`)."""
    return cutover_commands.cutover(
        ctx,
        rollback=rollback,
        tenants=tenants,
        exclude=exclude,
        show_status=show_status,
        as_json=as_json,
        actor=actor,
        wait_seconds=wait_seconds,
    )


@cli.command()
@click.option("--tenant", default=None, help="Only this tenant's tickets ('' = no tenant).")
@click.option("--since", default=None, help="Only tickets created since (YYYY-MM-DD or ISO).")
@click.option("--dry-run", is_flag=True, help="Count what would be enqueued; change nothing.")
@click.option(
    "--page-size", type=click.IntRange(min=1, max=100_000), default=1000, show_default=True
)
@ACTOR_OPTION
@pass_context
def backfill(
    ctx: Context,
    *,
    tenant: str | None,
    since: str | None,
    dry_run: bool,
    page_size: int,
    actor: str | None,
) -> int:
    """Enqueue every ticket consumers can read that enrichq never enriched (before cutover).

    Walks the help desk's mirror (and, with no --tenant, the tickets with legacy rows the
    mirror lacks) a page at a time; each ticket without an enrichment or an open queue row
    gets a `backfill` row, served after all other work, within the bytes budget and the
    warehouse cap. Audited; `enrichq status` shows the backfill rows by state.
    """
    return backfill_commands.backfill(
        ctx, tenant=tenant, since=since, dry_run=dry_run, page_size=page_size, actor=actor
    )


@cli.command()
@click.option(
    "--keep",
    "--keep-running",
    "keep_running",
    is_flag=True,
    help="Leave the seeded database, serve and /metrics up afterwards, and print the URL.",
)
@click.option("--tickets", type=click.IntRange(min=10, max=100_000), default=600)
@pass_context
def demo(ctx: Context, keep_running: bool, tickets: int) -> int:
    """Seed a help desk, warehouse and legacy output, run enrichq in shadow, report parity."""
    return demo_commands.demo(ctx, keep_running=keep_running, tickets=tickets)


def _run(entry: click.Command, args: list[str] | None) -> int:
    try:
        code = entry.main(args=args, prog_name="enrichq", standalone_mode=False)
    except CommandError as exc:
        say(str(exc))
        return exc.code
    except click.exceptions.NoArgsIsHelpError as exc:
        if exc.ctx is None or exc.ctx.parent is None:
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc))  # bare `enrichq`
        else:
            group = exc.ctx.command
            names = ", ".join(group.list_commands(exc.ctx))  # type: ignore[attr-defined]  # a click Group here; ctx.command is typed Command
            where = exc.ctx.command_path.removeprefix("enrichq ")
            say(f"{where}: missing command ({names})")
        return Exit.USAGE
    except click.UsageError as exc:
        where = f"{exc.ctx.command_path.removeprefix('enrichq').strip()}: " if exc.ctx else ""
        where = "" if where == ": " else where
        say(f"{where}{exc.format_message()}")
        return Exit.USAGE
    except click.ClickException as exc:
        say(f"{exc.format_message()}")
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("enrichq: aborted", err=True)
        return Exit.FAILED
    except SettingsError as exc:
        say(f"{exc}")
        return Exit.USAGE
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else Exit.FAILED
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    return code if isinstance(code, int) else Exit.OK


def undecodable_argument(args: list[str]) -> str | None:
    """One line for the first argument holding bytes that are not UTF-8 (Python keeps them
    as lone surrogates, which no database or terminal accepts), or None."""
    for number, arg in enumerate(args, start=1):
        for index, char in enumerate(arg):
            if "\udc80" <= char <= "\udcff":
                return (
                    f"argument {number} is not valid UTF-8 (byte 0x{ord(char) - 0xDC00:02x} at "
                    f"character {index + 1}); nothing changed"
                )
    return None


def main(args: list[str] | None = None) -> int:
    """Entry point of the ``enrichq`` console script."""
    from enrichq_schema.errors import describe_database_error

    code: int
    problem = undecodable_argument(sys.argv[1:] if args is None else args)
    if problem is not None:
        say(problem)
        code = Exit.USAGE
        if args is None:
            sys.exit(code)
        return code
    try:
        code = _run(cli, args)
    except Exception as exc:
        message = describe_database_error(exc)
        if message is None:
            raise
        say(f"{message}")
        code = Exit.FAILED
    if args is None:
        sys.exit(code)
    return code
