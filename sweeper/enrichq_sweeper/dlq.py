"""Dead letters: list them, and redrive them back into the queue (DESIGN §3, redrive).

Redrive resets attempts and merges like enqueue: per key the newest chosen dead letter
becomes queued (reason `redrive`, visible now) unless the key has a queued row already;
the other chosen rows stay dead and are reported as merged into the queued row. A redrive
is one transaction; a dry run is the same transaction rolled back, so it reports exactly
what would happen and changes nothing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import NoReturn

import sqlalchemy as sa

from enrichq_schema.states import DeadReason
from enrichq_service.settings import Settings
from enrichq_sweeper.common import (
    DEFAULT_BATCH_SIZE,
    retry_races,
    set_statement_timeout,
    sql,
)
from enrichq_sweeper.errors import DlqInputError

EXIT_USAGE = 2
LIST_LIMIT_MAX = 10_000
ERROR_COLUMN_WIDTH = 60


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One dead-letter row as an operator sees it."""

    id: int
    kind: str
    key: str
    tenant: str | None
    reason: str
    dead_reason: str
    superseded_by: int | None
    # The superseding row's state now; None when retention has pruned it (done rows are
    # kept 30 days, dead letters 90), so `superseded_by` names a row that no longer exists.
    superseded_by_state: str | None
    attempts: int
    max_attempts: int
    last_error: str | None
    finished_at: datetime
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Redriven:
    """One chosen dead letter: redriven (it is `into_id`) or merged into queued `into_id`."""

    id: int
    kind: str
    key: str
    redriven: bool
    into_id: int


@dataclass(frozen=True, slots=True)
class RedriveResult:
    """What a redrive did (or, in a dry run, would do)."""

    rows: tuple[Redriven, ...]
    dry_run: bool = False

    @property
    def redriven(self) -> tuple[Redriven, ...]:
        """Rows put back in the queue."""
        return tuple(r for r in self.rows if r.redriven)

    @property
    def merged(self) -> tuple[Redriven, ...]:
        """Rows left dead because their key has a queued row."""
        return tuple(r for r in self.rows if not r.redriven)


def _check_reason(reason: str | None) -> None:
    if reason is not None and reason not in {r.value for r in DeadReason}:
        known = ", ".join(r.value for r in DeadReason)
        raise DlqInputError(f"unknown dead reason {reason!r} (expected one of: {known})")


def list_dead(
    conn: sa.Connection, *, reason: str | None = None, limit: int = 50
) -> list[DeadLetter]:
    """Dead letters, newest first, optionally only those with `reason`."""
    _check_reason(reason)
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise DlqInputError(f"limit must be between 1 and {LIST_LIMIT_MAX}")
    if reason is None:
        rows = conn.execute(sql()("dlq_list"), {"limit": limit}).all()
    else:
        rows = conn.execute(sql()("dlq_list_by_reason"), {"limit": limit, "reason": reason}).all()
    return [DeadLetter(**r._asdict()) for r in rows]


def redrive(
    conn: sa.Connection,
    *,
    ids: Sequence[int] = (),
    reason: str | None = None,
    all_rows: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    now: datetime | None = None,
) -> RedriveResult:
    """Redrive the dead letters chosen by exactly one of `ids`, `reason` or `all_rows`.

    The caller owns the transaction (commit to redrive, roll back for a dry run). Ids that
    are not dead letters are a DlqInputError before anything changes. Pages go newest id
    first, so the newest dead letter of a key is the one that becomes queued.
    """
    if sum([bool(ids), reason is not None, all_rows]) != 1:
        raise DlqInputError("give exactly one of ids, reason or all")
    _check_reason(reason)
    if batch_size < 1:
        raise DlqInputError("batch_size must be at least 1")
    done: list[Redriven] = []
    if ids:
        wanted = sorted(set(ids))
        found = conn.execute(sql()("dlq_select_ids"), {"ids": wanted}).all()
        found_ids = {r.id for r in found}
        missing = [i for i in wanted if i not in found_ids]
        if missing:
            listed = ", ".join(str(i) for i in missing[:20])
            more = f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""
            raise DlqInputError(f"not dead letters: {listed}{more}")
        rows = [_Chosen(r.id, r.kind, r.key) for r in reversed(found)]
        for start in range(0, len(rows), batch_size):
            done.extend(_redrive_batch(conn, rows[start : start + batch_size], now))
    else:
        before = sys.maxsize
        while True:
            if reason is not None:
                page = conn.execute(
                    sql()("dlq_page_by_reason"),
                    {"reason": reason, "before_id": before, "batch_size": batch_size},
                ).all()
            else:
                page = conn.execute(
                    sql()("dlq_page_all"), {"before_id": before, "batch_size": batch_size}
                ).all()
            if not page:
                break
            done.extend(_redrive_batch(conn, [_Chosen(r.id, r.kind, r.key) for r in page], now))
            before = page[-1].id
            if len(page) < batch_size:
                break
    redriven_kinds = sorted({r.kind for r in done if r.redriven})
    for kind in redriven_kinds:
        conn.execute(sql()("queue_notify"), {"kind": kind})
    return RedriveResult(tuple(done))


@dataclass(frozen=True, slots=True)
class _Chosen:
    id: int
    kind: str
    key: str


def _redrive_batch(
    conn: sa.Connection, chosen: Sequence[_Chosen], now: datetime | None
) -> list[Redriven]:
    pairs = sorted({(c.kind, c.key) for c in chosen})
    params = {
        "ids": [c.id for c in chosen],
        "kinds": [k for k, _ in pairs],
        "keys": [k for _, k in pairs],
        "now": now,
    }
    rows = retry_races(conn, lambda: conn.execute(sql()("dlq_redrive_batch"), params).all())
    return [Redriven(r.id, r.kind, r.key, bool(r.redriven), int(r.into_id)) for r in rows]


# -- the CLI's entry points (enrichq dlq list / redrive)


def _fail(message: str) -> NoReturn:
    """One line on stderr, exit 2 (the CLI's usage error)."""
    print(f"enrichq: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def list_cli(
    settings: Settings, url: str, *, reason: str | None, limit: int, as_json: bool
) -> None:
    """Print dead letters newest first: a table, or one JSON object per line."""
    from enrichq_schema.db import create_engine

    engine = create_engine(url, application_name="enrichq-dlq", pool_size=1)
    try:
        with engine.connect() as conn:
            set_statement_timeout(conn, settings.statement_timeout_seconds)
            rows = list_dead(conn, reason=reason, limit=limit)
    except DlqInputError as exc:
        _fail(str(exc))
    finally:
        engine.dispose()
    if as_json:
        for row in rows:
            print(json.dumps(asdict(row), default=str))
        return
    _print_table(rows)


def _print_table(rows: Sequence[DeadLetter]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not rows:
        console.print("no dead letters")
        return
    table = Table(title=f"dead letters (newest first, {len(rows)} shown)")
    for column in ("id", "kind", "key", "tenant", "dead reason", "by", "attempts", "finished"):
        table.add_column(column, justify="right" if column in {"id", "by"} else "left")
    table.add_column("last error", overflow="ellipsis", max_width=ERROR_COLUMN_WIDTH)
    for r in rows:
        table.add_row(
            str(r.id),
            r.kind,
            r.key,
            r.tenant or "",
            r.dead_reason,
            _superseder(r),
            f"{r.attempts}/{r.max_attempts}",
            r.finished_at.isoformat(timespec="seconds"),
            (r.last_error or "").splitlines()[0] if r.last_error else "",
        )
    console.print(table)


def _superseder(row: DeadLetter) -> str:
    """The 'by' column: the superseding row and its state, or that it was pruned."""
    if row.superseded_by is None:
        return ""
    return f"{row.superseded_by} ({row.superseded_by_state or 'pruned'})"


def redrive_cli(
    settings: Settings,
    url: str,
    *,
    ids: list[int],
    reason: str | None,
    all_rows: bool,
    dry_run: bool,
) -> None:
    """Redrive dead letters and print each one's fate; --dry-run prints it and rolls back."""
    from enrichq_schema.db import create_engine

    engine = create_engine(url, application_name="enrichq-dlq", pool_size=1)
    try:
        with engine.connect() as conn:
            tx = conn.begin()
            try:
                set_statement_timeout(conn, settings.statement_timeout_seconds)
                result = redrive(conn, ids=ids, reason=reason, all_rows=all_rows)
            except BaseException:
                tx.rollback()
                raise
            if dry_run:
                tx.rollback()
            else:
                tx.commit()
    except DlqInputError as exc:
        _fail(f"dlq redrive: {exc}; nothing changed")
    finally:
        engine.dispose()
    _print_redrive(RedriveResult(result.rows, dry_run=dry_run))


def _print_redrive(result: RedriveResult) -> None:
    would = "would be " if result.dry_run else ""
    for r in sorted(result.rows, key=lambda r: r.id):
        if r.redriven:
            print(f"{r.id}\t{r.kind}\t{r.key}\t{would}redriven")
        else:
            print(f"{r.id}\t{r.kind}\t{r.key}\t{would}merged into queued row {r.into_id}")
    summary = f"{len(result.redriven)} {would}redriven, {len(result.merged)} {would}merged"
    if not result.rows:
        summary = "no dead letters matched; nothing to redrive"
    print(summary + (" (dry run: nothing changed)" if result.dry_run else ""))
