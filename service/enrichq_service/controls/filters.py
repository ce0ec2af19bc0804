"""One filter language for `enrichq cancel`, `enrichq dlq discard` and `enrichq dlq
redrive`: parsed and checked once, bound into ``sql/controls.sql``, recorded in the audit
log."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from enrichq_schema.states import KEY_MAX_LENGTH, DeadReason, Kind, Reason
from enrichq_service.controls.errors import FilterError

IDS_MAX = 100_000
OLDER_THAN_MAX_SECONDS = 10 * 365 * 86_400.0
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_DURATION = re.compile(r"(?:\d+[smhdw])+")
_DURATION_PART = re.compile(r"(\d+)([smhdw])")


class Scope(StrEnum):
    """Which rows a filter can match."""

    OPEN = "open"  # queued and leased rows: what `cancel` acts on
    DEAD = "dead"  # dead letters: what the `dlq` verbs act on


def parse_duration(text: str) -> float:
    """Seconds in a duration like ``90m``, ``2h``, ``7d`` or ``1h30m``; FilterError if not one."""
    compact = text.strip().lower()
    if not _DURATION.fullmatch(compact):
        raise FilterError(f"--older-than: {text!r} is not a duration (like 90m, 2h or 7d)")
    seconds = float(
        sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(compact))
    )
    if not 0 < seconds <= OLDER_THAN_MAX_SECONDS:
        raise FilterError("--older-than: must be more than 0 and at most ten years")
    return seconds


def _text_value(option: str, value: str) -> str:
    # Stored rows may hold any text (even control characters, before ingest refused them),
    # so a filter matches what it is given; only NUL, which no text column can hold, is out.
    if not value or len(value) > KEY_MAX_LENGTH or "\x00" in value:
        raise FilterError(f"{option}: must be 1 to {KEY_MAX_LENGTH} characters, without NUL")
    return value


@dataclass(frozen=True, slots=True)
class Filter:
    """A validated selection of queue rows in one scope; build it with `build`."""

    scope: Scope
    ids: tuple[int, ...] = ()
    keys: tuple[str, ...] = ()
    tenant: str | None = None
    kind: str | None = None
    reason: str | None = None
    older_than: str | None = None  # as given ("2h"), for the audit log and messages
    older_than_seconds: float | None = None
    all_rows: bool = False

    @classmethod
    def build(
        cls,
        scope: Scope,
        *,
        ids: tuple[int, ...] | list[int] = (),
        keys: tuple[str, ...] | list[str] = (),
        tenant: str | None = None,
        kind: str | None = None,
        reason: str | None = None,
        older_than: str | None = None,
        all_rows: bool = False,
    ) -> Filter:
        """The filter of these options; FilterError (one line) when they make no selection."""
        criteria = bool(ids or keys) or any(
            v is not None for v in (tenant, kind, reason, older_than)
        )
        if all_rows and criteria:
            raise FilterError("--all selects every row: give it alone, or filters without it")
        if not all_rows and not criteria:
            raise FilterError(
                "give a filter (--id, --key, --tenant, --kind, --reason, --older-than) or --all"
            )
        if len(ids) > IDS_MAX or len(keys) > IDS_MAX:
            raise FilterError(f"at most {IDS_MAX:,} --id or --key values")
        if any(i < 1 for i in ids):
            raise FilterError("--id: ids are positive integers")
        if kind is not None and kind not in {k.value for k in Kind}:
            raise FilterError(f"--kind: {kind!r} is not one of {', '.join(Kind)}")
        if reason is not None:
            known = [r.value for r in (Reason if scope is Scope.OPEN else DeadReason)]
            if reason not in known:
                what = "an enqueue reason" if scope is Scope.OPEN else "a dead reason"
                raise FilterError(
                    f"--reason: {reason!r} is not {what} (expected one of: {', '.join(known)})"
                )
        seconds = parse_duration(older_than) if older_than is not None else None
        return cls(
            scope=scope,
            ids=tuple(sorted(set(ids))),
            keys=tuple(sorted({_text_value("--key", k) for k in keys})),
            tenant=None if tenant is None else _text_value("--tenant", tenant),
            kind=kind,
            reason=reason,
            older_than=None if older_than is None else older_than.strip().lower(),
            older_than_seconds=seconds,
            all_rows=all_rows,
        )

    def params(self) -> dict[str, Any]:
        """The bound parameters of the filter in controls.sql (its fragments, and the `--id`
        criterion its selects apply)."""
        return {
            "ids": list(self.ids) or None,
            "keys": list(self.keys) or None,
            "tenant": self.tenant,
            "kind": self.kind,
            "reason": self.reason,
            "older_than_seconds": self.older_than_seconds,
        }

    def as_json(self) -> dict[str, Any]:
        """The criteria that are set, as the audit log stores them."""
        out: dict[str, Any] = {"scope": self.scope.value}
        if self.all_rows:
            out["all"] = True
        if self.ids:
            out["ids"] = list(self.ids)
        if self.keys:
            out["keys"] = list(self.keys)
        for name in ("tenant", "kind", "reason", "older_than"):
            if (value := getattr(self, name)) is not None:
                out[name] = value
        return out

    def describe(self) -> str:
        """The filter as command-line options (for messages; values may need escaping)."""
        if self.all_rows:
            return "--all"
        parts = [f"--id {i}" for i in self.ids[:5]]
        if len(self.ids) > 5:
            parts.append(f"(+{len(self.ids) - 5} more ids)")
        parts += [f"--key {k}" for k in self.keys[:5]]
        if len(self.keys) > 5:
            parts.append(f"(+{len(self.keys) - 5} more keys)")
        for name in ("tenant", "kind", "reason", "older_than"):
            if (value := getattr(self, name)) is not None:
                parts.append(f"--{name.replace('_', '-')} {value}")
        return " ".join(parts)
