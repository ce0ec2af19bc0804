"""Dead letters: list them (`enrichq dlq list`).

Discard and redrive are operator controls over a filter, with cancel: see
`enrichq_service.controls.actions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from enrichq_schema.states import DeadReason
from enrichq_service.controls.actions import sql
from enrichq_service.controls.errors import DlqInputError

LIST_LIMIT_MAX = 10_000


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


def _superseder(row: DeadLetter) -> str:
    """The 'by' column: the superseding row and its state, or that it was pruned."""
    if row.superseded_by is None:
        return ""
    return f"{row.superseded_by} ({row.superseded_by_state or 'pruned'})"
