"""Operator controls: cancel, dlq discard and dlq redrive of the rows one filter matches,
read once, then worked in batches of their own transactions, audited."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from enrichq_schema import audit
from enrichq_schema.queries import Queries, load
from enrichq_schema.states import NOTIFY_CHANNEL, AuditCommand
from enrichq_service.controls.errors import ControlError, FilterError
from enrichq_service.controls.filters import Filter, Scope
from enrichq_sweeper.common import (
    DEFAULT_BATCH_SIZE,
    STATEMENT_TIMEOUT_SECONDS_DEFAULT,
    retry_races,
    set_statement_timeout,
)

SAMPLE_SIZE = 10
MISSING_IDS_SHOWN = 20
# Rows per page of a selection: each page is one statement reading about this many rows.
SELECT_PAGE_SIZE = 10_000
# Dead letters per statement when a dry run counts what a redrive would queue again.
PREVIEW_CHUNK = 10_000
QUERY_CANCELED = "57014"  # SQLSTATE of a statement stopped by statement_timeout

SCOPE_OF = {
    AuditCommand.CANCEL: Scope.OPEN,
    AuditCommand.DLQ_DISCARD: Scope.DEAD,
    AuditCommand.DLQ_REDRIVE: Scope.DEAD,
}
# What each action's rows counts are called, in the order they are printed.
COUNTS = {
    AuditCommand.CANCEL: ("queued", "leased", "kept"),
    AuditCommand.DLQ_DISCARD: ("discarded",),
    AuditCommand.DLQ_REDRIVE: ("redriven", "merged"),
}
# The counts that are rows changed (a merged dead letter stays as it is, and so does a
# queued row a cancel kept because new work merged into it after the cancel began).
CHANGED = {"queued", "leased", "discarded", "redriven"}


def sql() -> Queries:
    """The controls' named statements (sql/controls.sql), loaded once per process."""
    return load("enrichq_service", "sql/controls.sql")


@dataclass(frozen=True, slots=True)
class Selection:
    """What a filter matched when the action started: ids in page order (open scope: the
    queued rows, then the leased ones; dead scope: a ticket's dead letters together)."""

    ids: Sequence[int]
    # dead scope: for each id, the newest matching id of its (kind, key)
    winners: Sequence[int] = ()
    # open scope: how many were queued and how many leased
    states: Mapping[str, int] = field(default_factory=dict)
    # the database clock when the selection was read: work merged in since survives
    started: datetime | None = None


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
        """Rows the action changed (in a dry run: would change)."""
        return sum(n for name, n in self.counts.items() if name in CHANGED)


class ActionStopped(ControlError):
    """The action stopped before its last batch; the batches committed before stay done."""

    def __init__(self, done: ActionResult, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.done = done
        self.cause = cause

    @property
    def timed_out(self) -> bool:
        """Whether a statement ran past the statement timeout (not a lost database)."""
        return getattr(getattr(self.cause, "orig", None), "sqlstate", None) == QUERY_CANCELED


def select(
    conn: sa.Connection,
    flt: Filter,
    *,
    now: datetime | None = None,
    page_size: int = SELECT_PAGE_SIZE,
) -> Selection:
    """The rows `flt` matches now, read in pages of `page_size` (the caller's transaction:
    `run` reads every page in one REPEATABLE READ snapshot). FilterError when a `--id` is
    not in the filter's scope at all (a typo guard: a wrong id is named, nothing is done)."""
    if page_size < 1:
        raise ValueError("page_size must be at least 1")
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
    started = conn.execute(sql()("controls_clock"), {"now": now}).scalar_one()
    params = {**flt.params(), "now": now, "page_size": page_size}
    if flt.scope is Scope.OPEN:
        ids = array("q")
        for page in _pages(conn, "controls_page_queued", params, ("kind", "key")):
            ids.extend(page.ids)
        queued = len(ids)
        for page in _pages(conn, "controls_page_leased", params, ("key",)):
            ids.extend(page.ids)
        states = {"queued": queued, "leased": len(ids) - queued}
        return Selection(ids, states=states, started=started)
    ids, winners = array("q"), array("q")
    ticket: tuple[str, str] | None = None  # the last ticket of the page before, and
    carried = 0  # its newest id
    for page in _pages(conn, "controls_page_dead", params, ("key", "kind", "id")):
        newest = list(page.winners)
        if (page.first_kind, page.first_key) == ticket:
            # the page starts inside that ticket: its newest dead letter came before
            cut = newest[0]
            newest = [carried if w == cut else w for w in newest]
        ids.extend(page.ids)
        winners.extend(newest)
        ticket, carried = (page.last_kind, page.last_key), newest[-1]
    return Selection(ids, winners=winners, started=started)


def _pages(
    conn: sa.Connection, name: str, params: Mapping[str, Any], cursor: tuple[str, ...]
) -> Iterator[sa.Row[Any]]:
    """The pages of statement `name` (each one row: `ids`, `n` and the last row's columns
    as last_<column>), each after the last row of the one before (its `cursor` columns
    bound as after_<column>), until a short page."""
    after: dict[str, Any] = dict.fromkeys(("after_kind", "after_key", "after_id"))
    while True:
        page = conn.execute(sql()(name), {**params, **after}).one()
        if page.n:
            yield page
        if page.n < int(params["page_size"]):
            return
        after.update({f"after_{column}": getattr(page, f"last_{column}") for column in cursor})


def preview(conn: sa.Connection, command: AuditCommand, selection: Selection) -> dict[str, int]:
    """What `command` would do to `selection` now, in the counts its run reports."""
    if command is AuditCommand.CANCEL:
        return {**dict.fromkeys(COUNTS[command], 0), **selection.states}
    if command is AuditCommand.DLQ_DISCARD:
        return {"discarded": len(selection.ids)}
    winners = sorted(set(selection.winners))
    redriven = 0
    for start in range(0, len(winners), PREVIEW_CHUNK):
        chunk = winners[start : start + PREVIEW_CHUNK]
        redriven += int(
            conn.execute(sql()("controls_redrive_preview"), {"winners": chunk}).scalar_one()
        )
    return {"redriven": redriven, "merged": len(selection.ids) - redriven}


def sample(conn: sa.Connection, ids: Sequence[int], limit: int = SAMPLE_SIZE) -> list[Sampled]:
    """The first `limit` of `ids` as rows, in that order."""
    if not ids or limit < 1:
        return []
    rows = conn.execute(sql()("controls_sample"), {"ids": list(ids[:limit])}).all()
    return [Sampled(**r._asdict()) for r in rows]


def cancel_batch(
    conn: sa.Connection,
    flt: Filter,
    ids: Sequence[int],
    *,
    now: datetime | None = None,
    started: datetime | None = None,
) -> dict[str, int]:
    """Cancel the rows of `ids` that still match `flt` (caller's transaction), except the
    queued rows an event merged into at or after `started` (kept: new work survives)."""
    params = _batch_params(flt, Scope.OPEN, ids, now, started=started)
    row = conn.execute(sql()("controls_cancel_batch"), params).one()
    return {"queued": int(row.queued), "leased": int(row.leased), "kept": int(row.kept)}


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
    page_size: int = SELECT_PAGE_SIZE,
    confirm: Callable[[ActionResult], bool] | None = None,
    on_batch: Callable[[int, Mapping[str, int]], None] | None = None,
) -> ActionResult:
    """Run `command` on the rows `flt` matches, batch by batch, and audit it.

    A dry run selects, says what the run would do and samples, then changes and records
    nothing. `confirm(preview)` is asked before anything changes (the preview is what a dry
    run returns); when it says no, that preview is returned and nothing changes.
    `on_batch(n, totals)` is told after each committed batch (progress; tests interleave).
    ActionStopped when a batch fails after others committed (they stay done, and audited).
    """
    if command not in SCOPE_OF:
        raise ValueError(f"{command} is not a batched control")
    if flt.scope is not SCOPE_OF[command]:
        raise FilterError(f"{command.value} needs a filter of scope {SCOPE_OF[command].value!r}")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    actor = audit.check_actor(actor)
    with engine.connect() as conn:
        try:
            with conn.begin():
                # every page of the selection reads one snapshot, each its own statement
                conn.execute(sql()("controls_snapshot"))
                set_statement_timeout(conn, statement_timeout_seconds)
                selection = select(conn, flt, now=now, page_size=page_size)
                predicted = preview(conn, command, selection)
                shown = tuple(sample(conn, selection.ids, sample_size)) if dry_run else ()
        except sa_exc.DBAPIError as exc:
            raise ActionStopped(ActionResult(command, flt, 0, {}, 0, dry_run), exc) from exc
        would = ActionResult(
            command,
            flt,
            len(selection.ids),
            predicted,
            0,
            True,
            sample=shown,
            states=selection.states,
        )
        if dry_run or (confirm is not None and not confirm(would)):
            return would
        totals = dict.fromkeys(COUNTS[command], 0)
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
        done = ActionResult(
            command,
            flt,
            len(selection.ids),
            totals,
            0,
            False,
            audit_id=audit_id,
            states=selection.states,
        )
        batches = 0
        try:
            for start in range(0, len(selection.ids), batch_size):
                _run_batch(
                    conn,
                    command,
                    flt,
                    selection,
                    start=start,
                    batch_size=batch_size,
                    totals=totals,
                    audit_id=audit_id,
                    statement_timeout_seconds=statement_timeout_seconds,
                    now=now,
                )
                batches += 1
                if on_batch is not None:
                    on_batch(batches, dict(totals))
            with conn.begin():
                audit.finish(conn, audit_id, now=now)
        except sa_exc.DBAPIError as exc:
            raise ActionStopped(replace(done, counts=dict(totals), batches=batches), exc) from exc
    return replace(done, counts=totals, batches=batches)


def _run_batch(
    conn: sa.Connection,
    command: AuditCommand,
    flt: Filter,
    selection: Selection,
    *,
    start: int,
    batch_size: int,
    totals: dict[str, int],
    audit_id: int,
    statement_timeout_seconds: float,
    now: datetime | None,
) -> None:
    """Act on the batch of `selection` at `start` in its own transaction, adding what it
    did to `totals` and to the audit row (in that transaction)."""
    ids = selection.ids[start : start + batch_size]
    with conn.begin():
        set_statement_timeout(conn, statement_timeout_seconds)
        if command is AuditCommand.CANCEL:
            done = cancel_batch(conn, flt, ids, now=now, started=selection.started)
        elif command is AuditCommand.DLQ_DISCARD:
            done = discard_batch(conn, flt, ids, now=now)
        else:
            winners = selection.winners[start : start + batch_size]
            done = redrive_batch(conn, flt, ids, winners, now=now)
        for name, n in done.items():
            totals[name] += n
        changed = sum(n for name, n in done.items() if name in CHANGED)
        audit.add_rows(conn, audit_id, changed, detail={"matched": len(selection.ids), **totals})
