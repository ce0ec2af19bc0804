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
