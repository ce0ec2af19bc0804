"""Cutover: repoint the consumer view from the legacy table to the shadow table, and back.

Consumers read ``enrichq_public.ticket_orders`` (ticket_id, order_id, looked_up_at). A
cutover swaps what it reads in one transaction with CREATE OR REPLACE VIEW, only after a
fresh passing parity run; a rollback swaps it back. Both are recorded in
``enrichq.cutover_events``. This is the one module that touches consumer-facing objects:
service and sweeper code never import it (an import-linter contract).
"""

from __future__ import annotations

import getpass
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import sqlalchemy as sa

from enrichq_parity import names
from enrichq_parity.model import pct
from enrichq_schema.errors import EnrichqError
from enrichq_schema.queries import Queries, load
from enrichq_schema.tables import PUBLIC_SCHEMA

if TYPE_CHECKING:
    from enrichq_service.settings import Settings

VIEW = f"{PUBLIC_SCHEMA}.ticket_orders"
SHADOW_TABLE = "enrichq.ticket_orders"
LOCK_TIMEOUT = "5s"
ACTOR_MAX_LENGTH = 200
LOCK_NOT_AVAILABLE = "55P03"

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_BAD_INPUT = 2


class CutoverError(EnrichqError):
    """Cutover cannot run on this database."""


class CutoverRefused(EnrichqError):
    """The parity gate refused the cutover."""


@dataclass(frozen=True, slots=True)
class LatestRun:
    """The latest finished parity run, as the gate sees it."""

    id: int
    finished_at: datetime
    passed: bool | None
    order_coverage: float | None
    ticket_match_rate: float | None


@dataclass(frozen=True, slots=True)
class CutoverResult:
    """What a cutover or rollback did (changed=False: the view already read the target)."""

    action: str
    target: str
    previous: str
    changed: bool
    event_id: int | None
    parity_run_id: int | None
    message: str


def _queries() -> Queries:
    return load("enrichq_parity", "sql/cutover.sql")


def gate(latest: LatestRun | None, now: datetime, max_age_hours: float) -> str | None:
    """Why a cutover must not happen now, or None when the latest run allows it."""
    if latest is None:
        return "no finished parity run: run `enrichq parity` first"
    if not latest.passed:
        return (
            f"the latest parity run #{latest.id} did not pass (order coverage "
            f"{pct(latest.order_coverage)}, ticket match rate {pct(latest.ticket_match_rate)})"
        )
    age = now - latest.finished_at
    if age >= timedelta(hours=max_age_hours):
        return (
            f"the latest parity run #{latest.id} finished {age.total_seconds() / 3600:.1f} h "
            f"ago, older than ENRICHQ_PARITY_MAX_AGE_HOURS ({max_age_hours:g}): "
            "run `enrichq parity` again"
        )
    return None


def ensure_view(conn: sa.Connection, settings: Settings) -> str:
    """Create the consumer view on the legacy table if it is missing; what it reads now."""
    q = _queries()
    conn.execute(q("cutover_lock"))
    if not _exists(conn, PUBLIC_SCHEMA + ".ticket_orders"):
        if not conn.execute(
            sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :name"), {"name": PUBLIC_SCHEMA}
        ).first():
            raise CutoverError(f"schema {PUBLIC_SCHEMA} does not exist (run `enrichq migrate`)")
        _point(conn, settings.legacy_table, settings)
    return _source(conn)


def cutover(
    conn: sa.Connection, settings: Settings, *, actor: str, now: datetime | None = None
) -> CutoverResult:
    """Point the view at the shadow table if the latest parity run passed and is fresh."""
    q = _queries()
    conn.execute(q("cutover_lock"))
    conn.execute(q("cutover_lock_timeout"), {"timeout": LOCK_TIMEOUT})
    previous = ensure_view(conn, settings)
    if previous == SHADOW_TABLE:
        return CutoverResult(
            "cutover", SHADOW_TABLE, previous, False, None, None,
            f"{VIEW} already reads {SHADOW_TABLE}; nothing changed",
        )  # fmt: skip
    at: datetime = conn.execute(q("cutover_now"), {"now": now}).scalar_one()
    latest = _latest(conn)
    refusal = gate(latest, at, settings.parity_max_age_hours)
    if refusal is not None:
        raise CutoverRefused(refusal)
    assert latest is not None  # the gate refuses when there is no run
    _point(conn, SHADOW_TABLE, settings)
    event = _record(
        conn,
        action="cutover",
        target=SHADOW_TABLE,
        parity_run_id=latest.id,
        actor=actor,
        now=now,
        note=f"was {previous}",
    )
    age_hours = (at - latest.finished_at).total_seconds() / 3600
    return CutoverResult(
        "cutover", SHADOW_TABLE, previous, True, event, latest.id,
        f"{VIEW} now reads {SHADOW_TABLE} (was {previous}); parity run #{latest.id} passed "
        f"{age_hours:.1f} h ago; event #{event} by {actor}",
    )  # fmt: skip


def rollback(conn: sa.Connection, settings: Settings, *, actor: str) -> CutoverResult:
    """Point the view back at the legacy table (no gate: going back is always allowed)."""
    q = _queries()
    conn.execute(q("cutover_lock"))
    conn.execute(q("cutover_lock_timeout"), {"timeout": LOCK_TIMEOUT})
    previous = ensure_view(conn, settings)
    # Names are quoted only when they need it, so the catalog spells them as configured.
    legacy = settings.legacy_table
    if previous == legacy:
        return CutoverResult(
            "rollback", legacy, previous, False, None, None,
            f"{VIEW} already reads {legacy}; nothing changed",
        )  # fmt: skip
    latest = _latest(conn)
    run_id = latest.id if latest else None
    _point(conn, settings.legacy_table, settings)
    event = _record(
        conn,
        action="rollback",
        target=legacy,
        parity_run_id=run_id,
        actor=actor,
        now=None,
        note=f"was {previous}",
    )
    return CutoverResult(
        "rollback", legacy, previous, True, event, run_id,
        f"{VIEW} now reads {legacy} again (was {previous}); event #{event} by {actor}",
    )  # fmt: skip


_roll_back = rollback  # run_cli's `rollback` flag shadows the function's name


def _point(conn: sa.Connection, table: str, settings: Settings) -> None:
    """CREATE OR REPLACE the view over `table`; a missing table is a one-line error."""
    quoted = names.qualified(conn.dialect, table)
    if not _exists(conn, quoted):
        which = "ENRICHQ_LEGACY_TABLE" if table == settings.legacy_table else "enrichq migrate"
        raise CutoverError(f"table {table} does not exist ({which})")
    conn.execute(names.render(_queries()["cutover_point_view"], source=quoted))


def _source(conn: sa.Connection) -> str:
    """What the view reads, as schema.table ('a, b' if someone made it read several)."""
    rows = conn.execute(_queries()("cutover_view_sources"), {"view": VIEW}).all()
    return ", ".join(f"{r.schema_name}.{r.table_name}" for r in rows) or "(nothing)"


def _exists(conn: sa.Connection, name: str) -> bool:
    present: bool = conn.execute(_queries()("cutover_relation_exists"), {"name": name}).scalar_one()
    return present


def _latest(conn: sa.Connection) -> LatestRun | None:
    row = conn.execute(_queries()("cutover_latest_run")).first()
    if row is None:
        return None
    return LatestRun(
        id=row.id,
        finished_at=row.finished_at,
        passed=row.passed,
        order_coverage=row.order_coverage,
        ticket_match_rate=row.ticket_match_rate,
    )


def _record(
    conn: sa.Connection,
    *,
    action: str,
    target: str,
    parity_run_id: int | None,
    actor: str,
    now: datetime | None,
    note: str,
) -> int:
    row = conn.execute(
        _queries()("cutover_record"),
        {
            "action": action,
            "target": target,
            "parity_run_id": parity_run_id,
            "actor": actor,
            "now": now,
            "note": note,
        },
    ).one()
    event_id: int = row.id
    return event_id


def default_actor() -> str:
    """The OS user running the command, for the record."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def run_cli(settings: Settings, url: str, *, rollback: bool, actor: str | None) -> int:
    """`enrichq cutover [--rollback]`: 0 done (or nothing to do), 1 refused, 2 bad input."""
    from enrichq_schema.db import create_engine

    who = default_actor() if actor is None else actor.strip()
    if not who or len(who) > ACTOR_MAX_LENGTH or not who.isprintable():
        print(
            f"enrichq: cutover: --actor must be 1 to {ACTOR_MAX_LENGTH} printable characters",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    action = "rollback" if rollback else "cutover"
    engine = create_engine(
        url,
        application_name="enrichq-cutover",
        pool_size=1,
        statement_timeout_seconds=settings.statement_timeout_seconds,
    )
    try:
        with engine.begin() as conn:
            result = (
                _roll_back(conn, settings, actor=who)
                if rollback
                else cutover(conn, settings, actor=who)
            )
    except CutoverRefused as exc:
        print(f"enrichq: cutover refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except CutoverError as exc:
        print(f"enrichq: {action}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except sa.exc.OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        print(
            f"enrichq: {action}: {VIEW} is held by a long-running reader (waited "
            f"{LOCK_TIMEOUT}); nothing changed, try again",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    finally:
        engine.dispose()
    print(f"{action}: {result.message}")
    return EXIT_OK
