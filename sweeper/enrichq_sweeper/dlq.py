"""Dead letters: list them (`enrichq dlq list`).

Discard and redrive are operator controls over a filter, with cancel: see
`enrichq_sweeper.controls`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from enrichq_schema.process import fail
from enrichq_schema.settings import Settings
from enrichq_schema.states import DeadReason
from enrichq_schema.text import print_json_lines
from enrichq_sweeper.common import set_statement_timeout, sql
from enrichq_sweeper.errors import DlqInputError

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
        reasons = [r.value for r in DeadReason]
        rows = conn.execute(sql()("dlq_list"), {"limit": limit, "reasons": reasons}).all()
    else:
        rows = conn.execute(sql()("dlq_list_by_reason"), {"limit": limit, "reason": reason}).all()
    return [DeadLetter(**r._asdict()) for r in rows]


# -- the CLI's entry point (enrichq dlq list)


def list_cli(
    settings: Settings, url: str, *, reason: str | None, limit: int, as_json: bool
) -> None:
    """Print dead letters newest first: a table, or one JSON object per line."""
    from enrichq_schema.connections import create_engine

    engine = create_engine(settings, url, application_name="enrichq-dlq", pool_size=1)
    try:
        with engine.connect() as conn:
            set_statement_timeout(conn, settings.statement_timeout_seconds)
            rows = list_dead(conn, reason=reason, limit=limit)
    except DlqInputError as exc:
        fail(str(exc))
    finally:
        engine.dispose()
    if as_json:
        print_json_lines(rows)
    else:
        _print_table(rows)


def _print_table(rows: Sequence[DeadLetter]) -> None:
    from rich.console import Console

    from enrichq_schema.text import newest_first, shown

    table = newest_first("dead letters", len(rows), none="no dead letters")
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
    Console().print(table)


def _superseder(row: DeadLetter) -> str:
    """The 'by' column: the superseding row and its state, or that it was pruned."""
    if row.superseded_by is None:
        return ""
    return f"{row.superseded_by} ({row.superseded_by_state or 'pruned'})"
