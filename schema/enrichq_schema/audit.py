"""The audit log: who did what to the queue, when, with which filter, and how many rows,
recorded in the caller's transaction."""

from __future__ import annotations

import getpass
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from enrichq_schema.errors import EnrichqError
from enrichq_schema.queries import load
from enrichq_schema.states import AuditCommand
from enrichq_schema.text import checked_text

SQL = load("enrichq_schema", "sql/audit.sql")
ACTOR_MAX_LENGTH = 200
RECENT_LIMIT_MAX = 10_000


class AuditInputError(EnrichqError):
    """Bad audit input."""


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One recorded action."""

    id: int
    at: datetime
    finished_at: datetime | None
    actor: str
    origin: str
    command: str
    filter: Mapping[str, Any]
    rows_affected: int
    detail: Mapping[str, Any]
    note: str | None


def default_actor() -> str:
    """Who runs this process, as the OS names them (the default of every `--actor`)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return f"uid:{os.getuid()}"


def origin() -> str:
    """Where an action comes from: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def check_actor(actor: str) -> str:
    """`actor`, stripped; AuditInputError when it is empty, too long or unprintable."""
    return checked_text(actor, ACTOR_MAX_LENGTH, "actor", AuditInputError)


def record(
    conn: sa.Connection,
    *,
    command: AuditCommand | str,
    actor: str,
    filter: Mapping[str, Any] | None = None,
    rows_affected: int = 0,
    detail: Mapping[str, Any] | None = None,
    note: str | None = None,
    finished: bool = True,
    now: datetime | None = None,
) -> int:
    """Record an action in the caller's transaction; its audit id."""
    try:
        command = AuditCommand(command)
    except ValueError:
        known = ", ".join(c.value for c in AuditCommand)
        raise AuditInputError(f"unknown command {command!r} (expected one of: {known})") from None
    if rows_affected < 0:
        raise AuditInputError("rows_affected must not be negative")
    audit_id = conn.execute(
        SQL("audit_record"),
        {
            "actor": check_actor(actor),
            "origin": origin(),
            "command": command.value,
            "filter": json.dumps(dict(filter or {}), default=str),
            "rows_affected": rows_affected,
            "detail": json.dumps(dict(detail or {}), default=str),
            "note": note,
            "finished": finished,
            "now": now,
        },
    ).scalar_one()
    return int(audit_id)


def add_rows(
    conn: sa.Connection, audit_id: int, rows: int, *, detail: Mapping[str, Any] | None = None
) -> None:
    """Add one batch's rows to an open audit row (in that batch's transaction)."""
    conn.execute(
        SQL("audit_add_rows"),
        {"id": audit_id, "rows": rows, "detail": json.dumps(dict(detail or {}), default=str)},
    )


def finish(conn: sa.Connection, audit_id: int, *, now: datetime | None = None) -> None:
    """Close an audit row: the action ran to its end."""
    conn.execute(SQL("audit_finish"), {"id": audit_id, "now": now})


def recent(
    conn: sa.Connection, *, limit: int = 50, command: AuditCommand | str | None = None
) -> list[AuditEntry]:
    """The newest `limit` actions, newest first, optionally of one command."""
    if not 1 <= limit <= RECENT_LIMIT_MAX:
        raise AuditInputError(f"limit must be between 1 and {RECENT_LIMIT_MAX}")
    if command is not None:
        try:
            command = AuditCommand(command).value
        except ValueError:
            known = ", ".join(c.value for c in AuditCommand)
            raise AuditInputError(
                f"unknown command {command!r} (expected one of: {known})"
            ) from None
    rows = conn.execute(SQL("audit_recent"), {"limit": limit, "command": command}).all()
    return [AuditEntry(**r._asdict()) for r in rows]
