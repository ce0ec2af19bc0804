"""Operator controls: cancel, dlq discard and dlq redrive by one filter (DESIGN §3).

An action reads the ids its `Filter` matches once (in the queue's lock order), then works
them in batches of `batch_size`, each in a transaction of its own, so a large action never
holds thousands of row locks for long nor keeps one transaction open for minutes. Each
batch checks its rows against the filter again under the lock: a row that changed since
(a worker settled it, someone else redrove it) is acted on only if it still matches. Rows
that start to match after the action began are not included: run it again (or pause
first) to catch work that keeps arriving.

The action is recorded in the audit log: its row is opened before the first batch and each
batch adds its rows in its own transaction, so the audit row always says what was
committed; an interrupted action keeps no finish time. A dry run reads the same selection,
prints its count and a sample, and records and changes nothing.

- cancel: queued and leased rows → dead_letter (dead reason `cancelled`). A cancelled
  leased row leaves `leased`, so its worker's heartbeat reports it lost and its settle is
  refused: its result is never written.
- dlq discard: dead letters are deleted.
- dlq redrive: dead letters → queued with fresh attempts; per ticket (kind, key) the newest
  matching dead letter is redriven and the others stay dead, merged into it, or into the
  ticket's queued row when it has one (like enqueue).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from enrichq_schema import audit
from enrichq_schema.process import Exit, fail
from enrichq_schema.queries import Queries, load
from enrichq_schema.settings import Settings
from enrichq_schema.states import NOTIFY_CHANNEL, AuditCommand
from enrichq_sweeper.common import (
    DEFAULT_BATCH_SIZE,
    STATEMENT_TIMEOUT_SECONDS_DEFAULT,
    retry_races,
    set_statement_timeout,
)
from enrichq_sweeper.errors import FilterError
from enrichq_sweeper.filters import Filter, Scope

SAMPLE_SIZE = 10
TIME_FORMAT = "%Y-%m-%d %H:%M:%SZ"
MISSING_IDS_SHOWN = 20

SCOPE_OF = {
    AuditCommand.CANCEL: Scope.OPEN,
    AuditCommand.DLQ_DISCARD: Scope.DEAD,
    AuditCommand.DLQ_REDRIVE: Scope.DEAD,
}
# What each action's rows counts are called, in the order they are printed.
COUNTS = {
    AuditCommand.CANCEL: ("queued", "leased"),
    AuditCommand.DLQ_DISCARD: ("discarded",),
    AuditCommand.DLQ_REDRIVE: ("redriven", "merged"),
}
# The counts that are rows changed (a merged dead letter stays as it is).
CHANGED = {"queued", "leased", "discarded", "redriven"}


def sql() -> Queries:
    """The controls' named statements (sql/controls.sql), loaded once per process."""
    return load("enrichq_sweeper", "sql/controls.sql")


@dataclass(frozen=True, slots=True)
class Selection:
    """What a filter matched when the action started: ids in lock order."""

    ids: tuple[int, ...]
    # dead scope: for each id, the newest matching id of its (kind, key)
    winners: tuple[int, ...] = ()
    # open scope: how many were queued and how many leased
    states: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Sampled:
    """One selected row as a dry run shows it."""

    id: int
    kind: str
    key: str
    tenant: str | None
    state: str
    reason: str
    dead_reason: str | None
    attempts: int
    max_attempts: int
    lease_owner: str | None
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class ActionResult:
    """What an action did (or, in a dry run, would act on)."""

    command: AuditCommand
    filter: Filter
    matched: int
    counts: Mapping[str, int]
    batches: int
    dry_run: bool
    audit_id: int | None = None
    sample: tuple[Sampled, ...] = ()
    states: Mapping[str, int] = field(default_factory=dict)

    @property
    def affected(self) -> int:
        """Rows the action changed."""
        return sum(n for name, n in self.counts.items() if name in CHANGED)


def select(conn: sa.Connection, flt: Filter, *, now: datetime | None = None) -> Selection:
    """The rows `flt` matches now, in lock order. FilterError when a `--id` is not in the
    filter's scope at all (a typo guard: a wrong id is named, nothing is done)."""
    params = {**flt.params(), "now": now}
    if flt.ids:
        in_scope = "controls_open_ids" if flt.scope is Scope.OPEN else "controls_dead_ids"
        found = {r.id for r in conn.execute(sql()(in_scope), {"ids": list(flt.ids)})}
        missing = [i for i in flt.ids if i not in found]
        if missing:
            listed = ", ".join(str(i) for i in missing[:MISSING_IDS_SHOWN])
            extra = len(missing) - MISSING_IDS_SHOWN
            more = f" (+{extra} more)" if extra > 0 else ""
            what = "queued or leased" if flt.scope is Scope.OPEN else "dead letters"
            raise FilterError(f"not {what}: {listed}{more}")
    if flt.scope is Scope.OPEN:
        row = conn.execute(sql()("controls_select_open"), params).one()
        return Selection(tuple(row.ids), states={"queued": row.queued, "leased": row.leased})
    row = conn.execute(sql()("controls_select_dead"), params).one()
    return Selection(tuple(row.ids), winners=tuple(row.winners))


def sample(conn: sa.Connection, ids: Sequence[int], limit: int = SAMPLE_SIZE) -> list[Sampled]:
    """The first `limit` of `ids` as rows, in that order."""
    if not ids or limit < 1:
        return []
    rows = conn.execute(sql()("controls_sample"), {"ids": list(ids[:limit])}).all()
    return [Sampled(**r._asdict()) for r in rows]


def cancel_batch(
    conn: sa.Connection, flt: Filter, ids: Sequence[int], *, now: datetime | None = None
) -> dict[str, int]:
    """Cancel the rows of `ids` that still match `flt` (caller's transaction)."""
    params = _batch_params(flt, Scope.OPEN, ids, now)
    row = conn.execute(sql()("controls_cancel_batch"), params).one()
    return {"queued": int(row.queued), "leased": int(row.leased)}


def discard_batch(
    conn: sa.Connection, flt: Filter, ids: Sequence[int], *, now: datetime | None = None
) -> dict[str, int]:
    """Delete the dead letters of `ids` that still match `flt` (caller's transaction)."""
    row = conn.execute(sql()("controls_discard_batch"), _batch_params(flt, Scope.DEAD, ids, now))
    return {"discarded": int(row.one().discarded)}


def redrive_batch(
    conn: sa.Connection,
    flt: Filter,
    ids: Sequence[int],
    winners: Sequence[int],
    *,
    now: datetime | None = None,
) -> dict[str, int]:
    """Redrive the dead letters of `ids` that still match `flt`; `winners[i]` is the newest
    matching id of `ids[i]`'s ticket, the one that is redriven (caller's transaction)."""
    if len(ids) != len(winners):
        raise ValueError("ids and winners must be parallel")
    params = _batch_params(flt, Scope.DEAD, ids, now, winners=list(winners), channel=NOTIFY_CHANNEL)
    row = retry_races(conn, lambda: conn.execute(sql()("controls_redrive_batch"), params).one())
    return {"redriven": int(row.redriven), "merged": int(row.merged)}


def _batch_params(
    flt: Filter, scope: Scope, ids: Sequence[int], now: datetime | None, **extra: object
) -> dict[str, object]:
    """The binds of a batch statement over `ids`; FilterError when `flt` is not of `scope`."""
    if flt.scope is not scope:
        raise FilterError(f"this action needs a filter of scope {scope.value!r}")
    return {**flt.params(), "batch_ids": list(ids), "now": now, **extra}


def run(
    engine: sa.Engine,
    command: AuditCommand,
    flt: Filter,
    *,
    actor: str,
    dry_run: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    sample_size: int = SAMPLE_SIZE,
    statement_timeout_seconds: float = STATEMENT_TIMEOUT_SECONDS_DEFAULT,
    now: datetime | None = None,
    on_batch: Callable[[int, Mapping[str, int]], None] | None = None,
) -> ActionResult:
    """Run `command` on the rows `flt` matches, batch by batch, and audit it.

    A dry run selects and samples, then changes and records nothing. `on_batch(n, totals)`
    is told after each committed batch (tests use it to interleave).
    """
    if command not in SCOPE_OF:
        raise ValueError(f"{command} is not a batched control")
    if flt.scope is not SCOPE_OF[command]:
        raise FilterError(f"{command.value} needs a filter of scope {SCOPE_OF[command].value!r}")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    actor = audit.check_actor(actor)
    with engine.connect() as conn:
        with conn.begin():
            set_statement_timeout(conn, statement_timeout_seconds)
            selection = select(conn, flt, now=now)
            shown = tuple(sample(conn, selection.ids, sample_size)) if dry_run else ()
        totals = dict.fromkeys(COUNTS[command], 0)
        if dry_run:
            return ActionResult(
                command,
                flt,
                len(selection.ids),
                totals,
                0,
                True,
                sample=shown,
                states=selection.states,
            )
        with conn.begin():
            audit_id = audit.record(
                conn,
                command=command,
                actor=actor,
                filter=flt.as_json(),
                detail={"matched": len(selection.ids), **totals},
                finished=False,
                now=now,
            )
        batches = 0
        for start in range(0, len(selection.ids), batch_size):
            ids = selection.ids[start : start + batch_size]
            with conn.begin():
                set_statement_timeout(conn, statement_timeout_seconds)
                if command is AuditCommand.CANCEL:
                    done = cancel_batch(conn, flt, ids, now=now)
                elif command is AuditCommand.DLQ_DISCARD:
                    done = discard_batch(conn, flt, ids, now=now)
                else:
                    winners = selection.winners[start : start + batch_size]
                    done = redrive_batch(conn, flt, ids, winners, now=now)
                for name, n in done.items():
                    totals[name] += n
                changed = sum(n for name, n in done.items() if name in CHANGED)
                audit.add_rows(
                    conn, audit_id, changed, detail={"matched": len(selection.ids), **totals}
                )
            batches += 1
            if on_batch is not None:
                on_batch(batches, dict(totals))
        with conn.begin():
            audit.finish(conn, audit_id, now=now)
    return ActionResult(
        command,
        flt,
        len(selection.ids),
        totals,
        batches,
        False,
        audit_id=audit_id,
        states=selection.states,
    )


# -- the CLI's entry point (enrichq cancel / dlq discard / dlq redrive)


def run_cli(
    settings: Settings,
    url: str,
    command: AuditCommand,
    flt: Filter,
    *,
    actor: str,
    dry_run: bool,
    as_json: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> None:
    """Run an action from the command line and print what it did (or would do)."""
    from enrichq_schema.connections import create_engine

    engine = create_engine(settings, url, application_name=f"enrichq-{command.value}", pool_size=1)
    try:
        result = run(
            engine,
            command,
            flt,
            actor=actor,
            dry_run=dry_run,
            batch_size=batch_size,
            statement_timeout_seconds=settings.statement_timeout_seconds,
        )
    except (FilterError, audit.AuditInputError) as exc:
        fail(f"{command.value}: {exc}; nothing changed")
    except KeyboardInterrupt:
        fail(
            f"{command.value}: interrupted; the batches committed so far stay done "
            "(`enrichq audit` shows how many rows)",
            Exit.INTERRUPTED,
        )
    finally:
        engine.dispose()
    if as_json:
        print(json.dumps(result_json(result), default=str))
    else:
        print_result(result)


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


def print_result(result: ActionResult) -> None:
    """One summary line; a dry run adds the sample as a table."""
    from enrichq_schema.text import printable

    verb, done = VERB[result.command]
    what = "row" if result.filter.scope is Scope.OPEN else "dead letter"
    one = result.matched == 1
    states = ""
    if result.states:
        states = " (" + ", ".join(f"{n} {s}" for s, n in result.states.items()) + ")"
    where = printable(result.filter.describe())
    if result.dry_run:
        print(
            f"{result.matched} {what}{'' if one else 's'}{states} "
            f"{'matches' if one else 'match'} {where}; would {verb} "
            f"{'it' if one else 'them'} (dry run: nothing changed)"
        )
        _print_sample(result)
        return
    if result.command is AuditCommand.DLQ_REDRIVE:
        counts = (
            f"{result.counts['redriven']} redriven, {result.counts['merged']} merged "
            "(left dead: their ticket has a newer match or a queued row)"
        )
    else:
        counts = f"{result.affected} {done}"
        if result.command is AuditCommand.CANCEL and result.affected:
            counts += f" ({result.counts['queued']} queued, {result.counts['leased']} leased)"
    print(
        f"{result.matched} {what}{'' if one else 's'} matched {where}: {counts}; "
        f"{result.batches} batch{'' if result.batches == 1 else 'es'}, "
        f"audit id {result.audit_id}"
    )


def _print_sample(result: ActionResult) -> None:
    from rich.console import Console
    from rich.table import Table

    from enrichq_schema.text import shown

    if not result.sample:
        return
    table = Table(title=f"first {len(result.sample)} of {result.matched} (in lock order)")
    open_scope = result.filter.scope is Scope.OPEN
    columns = ["id", "kind", "key", "tenant", "state" if open_scope else "dead reason"]
    columns += ["reason", "attempts", "created" if open_scope else "dead since"]
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
            when.astimezone(UTC).strftime(TIME_FORMAT),
        )
    Console().print(table)
