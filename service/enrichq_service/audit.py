"""`enrichq audit`: the operator actions recorded in `enrichq.audit_log`, newest first."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from enrichq_schema.audit import AuditEntry, AuditInputError, recent
from enrichq_schema.process import Exit, say
from enrichq_schema.settings import Settings
from enrichq_schema.text import print_json_lines, utc_time


def list_cli(
    settings: Settings, url: str, *, limit: int, command: str | None, as_json: bool
) -> None:
    """Print the newest `limit` actions: a table, or one JSON object per line."""
    from enrichq_schema.connections import create_engine

    engine = create_engine(
        settings,
        url,
        application_name="enrichq-audit",
        pool_size=1,
        statement_timeout_seconds=settings.statement_timeout_seconds,
    )
    try:
        with engine.connect() as conn:
            entries = recent(conn, limit=limit, command=command)
    except AuditInputError as exc:
        say(f"audit: {exc}")
        sys.exit(Exit.USAGE)
    finally:
        engine.dispose()
    if as_json:
        print_json_lines(entries)
    else:
        print_table(entries)


def describe_filter(stored: Mapping[str, Any]) -> str:
    """A stored filter as `name=value` pairs (lists joined by commas), scope and options
    not given (None, False, empty) left out."""
    parts = []
    for name, value in stored.items():
        if name == "scope" or value is None or value is False or value == []:
            continue
        if value is True:
            parts.append(name)
        elif isinstance(value, list):
            parts.append(f"{name}={','.join(str(v) for v in value)}")
        else:
            parts.append(f"{name}={value}")
    return " ".join(parts) or "-"


def print_table(entries: Sequence[AuditEntry]) -> None:
    """The actions as a rich table; actors, filters and notes escaped."""
    from rich.console import Console

    from enrichq_schema.text import newest_first, shown

    table = newest_first("operator actions", len(entries), none="no operator actions recorded")
    if table is None:
        return
    for column in ("id", "at (UTC)", "command", "actor", "rows", "filter", "finished", "note"):
        table.add_column(column, justify="right" if column in {"id", "rows"} else "left")
    for e in entries:
        finished = "no (interrupted or running)" if e.finished_at is None else "yes"
        table.add_row(
            str(e.id),
            utc_time(e.at, seconds=True),
            e.command,
            shown(e.actor),
            str(e.rows_affected),
            shown(describe_filter(e.filter)),
            finished,
            shown(e.note or ""),
        )
    Console().print(table)
