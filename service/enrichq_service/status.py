"""`enrichq status`: what is in the queue right now, as a table or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime

import sqlalchemy as sa

from enrichq_schema.queries import load
from enrichq_schema.states import State
from enrichq_service.controls import pauses as pause_controls

SQL = load("enrichq_service", "sql/observe.sql")


@dataclass(frozen=True, slots=True)
class StatusReport:
    """Queue counts by kind and state, the oldest visible age, leases and dead letters."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    oldest_visible_seconds: dict[str, float] = field(default_factory=dict)
    # per kind, queued rows not visible yet: {"waiting": rows, "in_seconds": until the first}
    next_visible: dict[str, dict[str, float]] = field(default_factory=dict)
    live_leases: int = 0
    expired_leases: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    # each pause in place: kind and tenant (None = every one), reason, by, since, age
    pauses: list[dict[str, object]] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def collect(conn: sa.Connection, *, now: datetime | None = None) -> StatusReport:
    """Read the status from the database."""
    counts: dict[str, dict[str, int]] = {}
    for stmt in ("observe_open_counts", "observe_terminal_counts"):
        for kind, state, n in conn.execute(SQL(stmt)):
            counts.setdefault(kind, {s.value: 0 for s in State})[state] = int(n)
    oldest = {
        kind: round(float(age), 3)
        for kind, age in conn.execute(SQL("observe_oldest_visible"), {"now": now})
    }
    upcoming = {
        row.kind: {"waiting": int(row.waiting), "in_seconds": round(float(row.in_seconds), 3)}
        for row in conn.execute(SQL("observe_next_visible"), {"now": now})
    }
    leases = conn.execute(SQL("observe_leases"), {"now": now}).one()
    dead: dict[str, int] = {}
    for _kind, reason, n in conn.execute(SQL("observe_dead_letters_by_reason")):
        dead[reason] = dead.get(reason, 0) + int(n)
    pauses = [p.as_json() for p in pause_controls.in_place(conn, now=now)]
    return StatusReport(
        counts=counts,
        oldest_visible_seconds=oldest,
        next_visible=upcoming,
        live_leases=int(leases.live),
        expired_leases=int(leases.expired),
        dead_letters=dead,
        pauses=pauses,
    )
