"""Pause and resume: claims stopped by an operator, per kind and tenant, obeyed by running
workers at their next claim, and recorded in the audit log."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from enrichq_schema import audit
from enrichq_schema.states import NOTIFY_CHANNEL, TENANT_MAX_LENGTH, AuditCommand, Kind
from enrichq_schema.text import checked_text, printable, text_problem
from enrichq_service.controls.actions import sql
from enrichq_service.controls.errors import PauseError
from enrichq_sweeper import common

REASON_MAX_LENGTH = 500


@dataclass(frozen=True, slots=True)
class PauseScope:
    """What a pause covers: a kind and a tenant, None for every one."""

    kind: str | None = None
    tenant: str | None = None

    @classmethod
    def build(cls, *, kind: str | None, tenant: str | None) -> PauseScope:
        """A validated scope; PauseError naming the option otherwise."""
        if kind is not None and kind not in {k.value for k in Kind}:
            known = ", ".join(k.value for k in Kind)
            raise PauseError(f"--kind: {kind!r} is not a kind (expected one of: {known})")
        if tenant is not None and (problem := text_problem(tenant, TENANT_MAX_LENGTH)):
            raise PauseError(f"--tenant: {problem}")
        return cls(kind, tenant)

    def describe(self) -> str:
        kind = f"kind {self.kind}" if self.kind is not None else "every kind"
        tenant = f"tenant {printable(self.tenant)}" if self.tenant is not None else "every tenant"
        return f"{kind}, {tenant}"

    def as_json(self) -> dict[str, str | None]:
        return {"kind": self.kind, "tenant": self.tenant}


@dataclass(frozen=True, slots=True)
class Pause:
    """A pause in place."""

    scope: PauseScope
    reason: str | None
    paused_by: str
    paused_at: datetime
    age_seconds: float = 0.0

    @classmethod
    def of(cls, row: sa.Row[Any]) -> Pause:
        return cls(
            PauseScope(row.kind, row.tenant),
            row.reason,
            row.paused_by,
            row.paused_at,
            float(getattr(row, "age_seconds", 0.0) or 0.0),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            **self.scope.as_json(),
            "reason": self.reason,
            "paused_by": self.paused_by,
            "paused_at": self.paused_at.isoformat(),
            "age_seconds": round(self.age_seconds, 1),
        }


def check_reason(reason: str | None) -> str | None:
    """`reason`, stripped (None when empty); PauseError when too long or unprintable."""
    if reason is None or not reason.strip():
        return None
    return checked_text(reason, REASON_MAX_LENGTH, "--reason", PauseError)


def pause(
    conn: sa.Connection,
    scope: PauseScope,
    *,
    actor: str,
    reason: str | None = None,
    now: datetime | None = None,
) -> tuple[Pause, bool]:
    """Pause `scope` in the caller's transaction and audit it; the pause and whether it is
    new (pausing a paused scope keeps its start and takes the new reason, if any)."""
    actor = audit.check_actor(actor)
    row = conn.execute(
        sql()("controls_pause"),
        {
            "kind": scope.kind,
            "tenant": scope.tenant,
            "reason": check_reason(reason),
            "actor": actor,
            "now": now,
        },
    ).one()
    audit.record(
        conn,
        command=AuditCommand.PAUSE,
        actor=actor,
        filter=scope.as_json(),
        rows_affected=1 if row.created else 0,
        detail={"already_paused": not row.created},
        note=row.reason,
        now=now,
    )
    return Pause.of(row), bool(row.created)


def resume(
    conn: sa.Connection,
    scope: PauseScope | None,
    *,
    actor: str,
    now: datetime | None = None,
) -> list[Pause]:
    """Resume the pause of exactly `scope` (None: every pause) in the caller's transaction,
    audit it and wake the workers; the pauses resumed (none: nothing changed)."""
    actor = audit.check_actor(actor)
    if scope is None:
        rows = conn.execute(sql()("controls_resume_all")).all()
    else:
        rows = conn.execute(
            sql()("controls_resume"), {"kind": scope.kind, "tenant": scope.tenant}
        ).all()
    resumed = [Pause.of(r) for r in rows]
    if not resumed:
        return []
    audit.record(
        conn,
        command=AuditCommand.RESUME,
        actor=actor,
        filter={"all": True} if scope is None else scope.as_json(),
        rows_affected=len(resumed),
        detail={"resumed": [p.scope.as_json() for p in resumed]},
        now=now,
    )
    # a resumed scope of every kind wakes the workers of every kind
    every = [k.value for k in Kind]
    kinds = sorted({k for p in resumed for k in ([p.scope.kind] if p.scope.kind else every)})
    for kind in kinds:
        conn.execute(common.sql()("queue_notify"), {"kind": kind, "channel": NOTIFY_CHANNEL})
    return resumed


def seen(conn: sa.Connection, scope: PauseScope) -> bool:
    """Whether work of `scope` was ever seen (a tenant with a plan, claims counted for it,
    open rows): a pause of a scope never seen may stop nothing at all (a misspelt tenant)."""
    kinds = [scope.kind] if scope.kind is not None else [k.value for k in Kind]
    params = {"kinds": kinds, "tenant": scope.tenant}
    return bool(conn.execute(sql()("controls_scope_seen"), params).scalar_one())


def in_place(conn: sa.Connection, *, now: datetime | None = None) -> list[Pause]:
    """Every pause in place, oldest first."""
    return [Pause.of(r) for r in conn.execute(sql()("controls_pauses"), {"now": now})]
