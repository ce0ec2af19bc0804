"""The run log: every worker, sweeper and parity invocation writes one `enrichq.runs` row."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime

import sqlalchemy as sa

from enrichq_schema.queries import load
from enrichq_schema.states import Component, StopReason

SQL = load("enrichq_schema", "sql/runs.sql")


def start(
    conn: sa.Connection,
    component: Component,
    owner: str,
    *,
    counts: Mapping[str, object] | None = None,
    now: datetime | None = None,
) -> int:
    """Open a run row (with the `counts` it starts with, if any); its id."""
    run_id = conn.execute(
        SQL("runs_start"),
        {
            "component": component.value,
            "owner": owner,
            "counts": json.dumps(dict(counts or {}), default=str),
            "now": now,
        },
    ).scalar_one()
    return int(run_id)


def finish(
    conn: sa.Connection,
    run_id: int,
    stop_reason: StopReason,
    counts: Mapping[str, object],
    error: str | None = None,
    *,
    now: datetime | None = None,
) -> None:
    """Close a run row with why it stopped and what it did."""
    conn.execute(
        SQL("runs_finish"),
        {
            "id": run_id,
            "stop_reason": stop_reason.value,
            "counts": json.dumps(dict(counts), default=str),
            "error": error,
            "now": now,
        },
    )


# The error text of a run the sweeper closed as lost.
LOST_ERROR = "no sign of life from its process (killed, frozen or cut off); closed by the sweeper"


def seen(conn: sa.Connection, run_id: int, *, now: datetime | None = None) -> None:
    """Stamp an open run with a sign of life (a no-op once it is closed)."""
    conn.execute(SQL("runs_seen"), {"id": run_id, "now": now})


def close_silent(
    conn: sa.Connection,
    *,
    worker_silent_seconds: float,
    other_silent_seconds: float,
    limit: int,
    now: datetime | None = None,
) -> dict[str, int]:
    """Close (stop reason `lost`) up to `limit` open runs silent for longer than their
    component's bound; how many per component."""
    rows = conn.execute(
        SQL("runs_close_silent"),
        {
            "worker_silent_seconds": worker_silent_seconds,
            "other_silent_seconds": other_silent_seconds,
            "limit": limit,
            "error": LOST_ERROR,
            "now": now,
        },
    ).all()
    return {str(r.component): int(r.n) for r in rows}
