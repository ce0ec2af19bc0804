"""The backfill: enqueue every ticket consumers can read that enrichq never enriched, as
low-priority `backfill` rows, a page of the mirror per transaction, audited."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import cache

import sqlalchemy as sa

from enrichq_schema import audit
from enrichq_schema.identifiers import qualified, relation_exists, render
from enrichq_schema.queries import Queries, load
from enrichq_schema.settings import Settings
from enrichq_schema.states import (
    BACKFILL_PRIORITY,
    KEY_MAX_LENGTH,
    NOTIFY_CHANNEL,
    AuditCommand,
)
from enrichq_sweeper.errors import BackfillInputError

PAGE_SIZE_DEFAULT = 1000

Progress = Callable[[int], None]
"""Called after each page with the tickets it read (of the total `count` gives)."""


@cache
def _queries() -> Queries:
    return load("enrichq_sweeper", "sql/backfill.sql")


@dataclass(frozen=True, slots=True)
class BackfillScope:
    """Which tickets a backfill walks: a tenant ('' = none; None: every tenant, and the
    tickets the mirror lacks) and those created since a time (None: ever)."""

    tenant: str | None = None
    since: datetime | None = None


@dataclass(frozen=True, slots=True)
class BackfillResult:
    """What a backfill did (dry run: would do)."""

    scope: BackfillScope
    dry_run: bool
    scanned: int
    never_enriched: int
    enqueued: int
    legacy_only: int
    pages: int
    audit_id: int | None

    @property
    def in_queue(self) -> int:
        """Never-enriched tickets left alone: an open queue row enriches them anyway."""
        return self.never_enriched - self.enqueued


def _statements(conn: sa.Connection, settings: Settings) -> dict[str, sa.TextClause]:
    q = _queries()
    tables = {}
    for name, table, setting in (
        ("tickets", settings.tickets_table, "ENRICHQ_TICKETS_TABLE"),
        ("legacy", settings.legacy_table, "ENRICHQ_LEGACY_TABLE"),
    ):
        tables[name] = qualified(conn.dialect, table)
        if not relation_exists(conn, tables[name]):
            raise BackfillInputError(f"table {table} does not exist ({setting})")
    return {
        "backfill_count": render(q["backfill_count"], **tables),
        "backfill_mirror_page": render(q["backfill_mirror_page"], tickets=tables["tickets"]),
        "backfill_legacy_page": render(q["backfill_legacy_page"], **tables),
    }


def count(engine: sa.Engine, settings: Settings, scope: BackfillScope) -> int:
    """How many tickets the backfill of `scope` walks (for a progress bar)."""
    with engine.connect() as conn:
        statements = _statements(conn, settings)
        n: int = conn.execute(
            statements["backfill_count"], {"tenant": scope.tenant, "since": scope.since}
        ).scalar_one()
        conn.rollback()
    return n


def run(
    engine: sa.Engine,
    settings: Settings,
    scope: BackfillScope,
    *,
    actor: str,
    dry_run: bool = False,
    page_size: int = PAGE_SIZE_DEFAULT,
    progress: Progress | None = None,
    now: datetime | None = None,
) -> BackfillResult:
    """Backfill `scope`, a page per transaction (each page's rows and its part of the audit
    row commit together); a dry run counts and writes nothing."""
    if page_size < 1:
        raise BackfillInputError("page size must be at least 1")
    audit_id = None
    totals = {"scanned": 0, "never_enriched": 0, "enqueued": 0, "legacy_only": 0, "pages": 0}
    with engine.begin() as conn:
        statements = _statements(conn, settings)
        if not dry_run:
            audit_id = audit.record(
                conn,
                command=AuditCommand.BACKFILL,
                actor=actor,
                filter={"tenant": scope.tenant, "since": scope.since},
                finished=False,
                now=now,
            )
    phases = ["backfill_mirror_page"] + (["backfill_legacy_page"] if scope.tenant is None else [])
    for phase in phases:
        after = ""
        while True:
            with engine.begin() as conn:
                row = conn.execute(
                    statements[phase],
                    {
                        "after": after,
                        "tenant": scope.tenant,
                        "since": scope.since,
                        "page_size": page_size,
                        "priority": BACKFILL_PRIORITY,
                        "max_attempts": settings.max_attempts,
                        "key_max_length": KEY_MAX_LENGTH,
                        "dry_run": dry_run,
                        "now": now,
                    },
                ).one()
                if audit_id is not None:
                    if row.enqueued:
                        conn.execute(_queries()("backfill_notify"), {"channel": NOTIFY_CHANNEL})
                    audit.add_rows(conn, audit_id, int(row.enqueued))
            totals["pages"] += 1
            totals["scanned"] += int(row.scanned)
            totals["never_enriched"] += int(row.never_enriched)
            totals["enqueued"] += int(row.enqueued)
            if phase == "backfill_legacy_page":
                totals["legacy_only"] += int(row.scanned)
            if progress is not None:
                progress(int(row.walked))
            if row.walked < page_size or row.last_key is None:
                break
            after = row.last_key
    if audit_id is not None:
        with engine.begin() as conn:
            audit.finish(conn, audit_id, now=now)
    return BackfillResult(scope, dry_run, audit_id=audit_id, **totals)
