"""Parity's records (frozen) and the pure decisions over them: tallies, the verdict, samples."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from enum import StrEnum
from typing import Any

SAMPLE_LIMIT = 50
DRIFT_SAMPLE_LIMIT = 10


class TicketClass(StrEnum):
    """How one compared ticket's shadow order set relates to its legacy order set."""

    EXACT = "exact"
    DRIFT_ONLY = "drift_only"
    PARTIAL = "partial"
    SHADOW_MISSING = "shadow_missing"
    LEGACY_MISSING = "legacy_missing"
    EXTRA_ONLY = "extra_only"


MATCHING = (TicketClass.EXACT, TicketClass.DRIFT_ONLY)
MISMATCHED = (
    TicketClass.PARTIAL,
    TicketClass.SHADOW_MISSING,
    TicketClass.LEGACY_MISSING,
    TicketClass.EXTRA_ONLY,
)

CLASS_LABELS: Mapping[TicketClass, str] = {
    TicketClass.EXACT: "Exact match",
    TicketClass.DRIFT_ONLY: "Drift only",
    TicketClass.PARTIAL: "Partial",
    TicketClass.SHADOW_MISSING: "Shadow missing",
    TicketClass.LEGACY_MISSING: "Legacy missing",
    TicketClass.EXTRA_ONLY: "Extra orders only",
}

CLASS_MEANINGS: Mapping[TicketClass, str] = {
    TicketClass.EXACT: "Same order set on both sides (both empty included).",
    TicketClass.DRIFT_ONLY: (
        "Same set except orders placed after the legacy lookup: explained by time, a match."
    ),
    TicketClass.PARTIAL: "Some legacy orders are not in the shadow output.",
    TicketClass.SHADOW_MISSING: "Legacy has orders; enrichq never enriched the ticket.",
    TicketClass.LEGACY_MISSING: "Enrichq found orders; legacy wrote none.",
    TicketClass.EXTRA_ONLY: "Every legacy order is there, plus orders legacy does not have.",
}


class Exclusion(StrEnum):
    """Why a ticket in the window was left out of the comparison."""

    TOO_YOUNG = "too_young"
    OPEN_QUEUE_ROWS = "open_queue_rows"


EXCLUSION_LABELS: Mapping[Exclusion, str] = {
    Exclusion.TOO_YOUNG: "Too young (created after the visibility delay plus grace)",
    Exclusion.OPEN_QUEUE_ROWS: "Open queue rows (queued or leased: still being processed)",
}


@dataclass(frozen=True, slots=True)
class Tally:
    """Ticket counts per class and per exclusion reason, and order counts, over some tickets."""

    exact: int = 0
    drift_only: int = 0
    partial: int = 0
    shadow_missing: int = 0
    legacy_missing: int = 0
    extra_only: int = 0
    too_young: int = 0
    open_queue_rows: int = 0
    legacy_orders: int = 0
    matched_orders: int = 0
    missing_orders: int = 0
    extra_orders: int = 0
    drift_orders: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(Tally))
        )

    def count(self, ticket_class: TicketClass | Exclusion) -> int:
        """Tickets of one class or exclusion reason."""
        value: int = getattr(self, ticket_class.value)
        return value

    @property
    def compared(self) -> int:
        """Tickets compared (every class)."""
        return sum(self.count(c) for c in TicketClass)

    @property
    def excluded(self) -> int:
        """Tickets in the window left out of the comparison."""
        return sum(self.count(e) for e in Exclusion)

    @property
    def matching(self) -> int:
        """Tickets that count as matches: exact plus drift only."""
        return sum(self.count(c) for c in MATCHING)

    @property
    def mismatched(self) -> int:
        """Tickets of a mismatch class."""
        return sum(self.count(c) for c in MISMATCHED)

    @property
    def order_coverage(self) -> float | None:
        """|shadow ∩ legacy| / |legacy| over the orders; None when legacy has none."""
        return self.matched_orders / self.legacy_orders if self.legacy_orders else None

    @property
    def ticket_match_rate(self) -> float | None:
        """(exact + drift only) / compared; None when nothing was compared."""
        return self.matching / self.compared if self.compared else None

    def as_dict(self) -> dict[str, Any]:
        """JSON shape: derived rates beside the raw counts."""
        return {
            "compared": self.compared,
            "excluded": self.excluded,
            "order_coverage": self.order_coverage,
            "ticket_match_rate": self.ticket_match_rate,
            "classes": {c.value: self.count(c) for c in TicketClass},
            "exclusions": {e.value: self.count(e) for e in Exclusion},
            "orders": {
                "legacy": self.legacy_orders,
                "matched": self.matched_orders,
                "missing": self.missing_orders,
                "extra": self.extra_orders,
                "drift": self.drift_orders,
            },
        }


def tally_of(kind: str, name: str, tickets: int, orders: Sequence[int] = ()) -> Tally:
    """The tally of one aggregate row of the day query ('class' or 'excluded')."""
    if kind == "class":
        legacy, matched, missing, extra, drift = orders
        return Tally(
            **{TicketClass(name).value: tickets},
            legacy_orders=legacy,
            matched_orders=matched,
            missing_orders=missing,
            extra_orders=extra,
            drift_orders=drift,
        )
    if kind == "excluded":
        return Tally(**{Exclusion(name).value: tickets})
    raise ValueError(f"unknown aggregate row kind {kind!r}")


def total(tallies: Iterable[Tally]) -> Tally:
    """The sum of some tallies."""
    out = Tally()
    for t in tallies:
        out += t
    return out


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One sampled ticket and how its order sets differ (ids sorted)."""

    ticket_id: str
    tenant: str
    ticket_class: TicketClass
    created_at: datetime
    enriched_at: datetime | None
    legacy_looked_up_at: datetime | None
    legacy_orders: int
    matched_orders: int
    missing: tuple[str, ...]
    extra: tuple[str, ...]
    drift: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return {
            "ticket_id": self.ticket_id,
            "tenant": self.tenant,
            "class": self.ticket_class.value,
            "created_at": _iso(self.created_at),
            "enriched_at": _iso(self.enriched_at),
            "legacy_looked_up_at": _iso(self.legacy_looked_up_at),
            "legacy_orders": self.legacy_orders,
            "matched_orders": self.matched_orders,
            "missing": list(self.missing),
            "extra": list(self.extra),
            "drift": list(self.drift),
        }


@dataclass(frozen=True, slots=True)
class DayResult:
    """The tally of the tickets created in one UTC day (clipped to the window)."""

    day: date
    since: datetime
    until: datetime
    tally: Tally


@dataclass(frozen=True, slots=True)
class TenantResult:
    """The tally of one tenant's tickets over the whole window ('' = no tenant)."""

    tenant: str
    tally: Tally


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the run passed, and one line saying why."""

    passed: bool
    reason: str


@dataclass(frozen=True, slots=True)
class ParityReport:
    """Everything one parity run found; what the JSON and HTML reports are made from."""

    run_id: int | None
    since: datetime
    until: datetime
    now: datetime
    young_after: datetime
    started_at: datetime
    finished_at: datetime | None
    duration_seconds: float
    min_order_coverage: float
    min_ticket_match_rate: float
    total: Tally
    days: tuple[DayResult, ...]
    tenants: tuple[TenantResult, ...]
    sample: tuple[Mismatch, ...]
    drift_sample: tuple[Mismatch, ...]
    verdict: Verdict
    sources: Mapping[str, str]

    @property
    def passed(self) -> bool:
        """Coverage and match rate both met their bars."""
        return self.verdict.passed

    def as_dict(self) -> dict[str, Any]:
        """The JSON report (also stored in enrichq.parity_runs.report)."""
        return {
            "run_id": self.run_id,
            "passed": self.passed,
            "verdict": self.verdict.reason,
            "window": {
                "since": _iso(self.since),
                "until": _iso(self.until),
                "now": _iso(self.now),
                "young_after": _iso(self.young_after),
            },
            "thresholds": {
                "min_order_coverage": self.min_order_coverage,
                "min_ticket_match_rate": self.min_ticket_match_rate,
            },
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "duration_seconds": round(self.duration_seconds, 3),
            "sources": dict(self.sources),
            "total": self.total.as_dict(),
            "days": [
                {
                    "day": d.day.isoformat(),
                    "since": _iso(d.since),
                    "until": _iso(d.until),
                    **d.tally.as_dict(),
                }
                for d in self.days
            ],
            "tenants": [{"tenant": t.tenant, **t.tally.as_dict()} for t in self.tenants],
            "sample": [m.as_dict() for m in self.sample],
            "drift_sample": [m.as_dict() for m in self.drift_sample],
        }


def decide(tally: Tally, min_order_coverage: float, min_ticket_match_rate: float) -> Verdict:
    """Pass when both rates meet their bars; an empty window (nothing to judge) never passes."""
    if tally.compared == 0:
        why = f" ({tally.excluded} excluded: {_exclusions(tally)})" if tally.excluded else ""
        return Verdict(False, f"no tickets compared in the window{why}: nothing to judge")
    coverage = tally.order_coverage
    rate = tally.ticket_match_rate
    if coverage is None or rate is None:
        return Verdict(
            False,
            f"legacy has no orders for the {tally.compared} compared tickets: "
            "order coverage is undefined",
        )
    short: list[str] = []
    if coverage < min_order_coverage:
        short.append(f"order coverage {pct(coverage)} is below {pct(min_order_coverage)}")
    if rate < min_ticket_match_rate:
        short.append(f"ticket match rate {pct(rate)} is below {pct(min_ticket_match_rate)}")
    if short:
        return Verdict(False, "; ".join(short))
    return Verdict(
        True,
        f"order coverage {pct(coverage)} ≥ {pct(min_order_coverage)} and "
        f"ticket match rate {pct(rate)} ≥ {pct(min_ticket_match_rate)}",
    )


def pick_sample(
    by_class: Mapping[TicketClass, Sequence[Mismatch]], limit: int = SAMPLE_LIMIT
) -> tuple[Mismatch, ...]:
    """Up to `limit` mismatches, taken in turn from each class so every class is shown."""
    queues = [list(by_class.get(c, ())) for c in MISMATCHED]
    out: list[Mismatch] = []
    position = 0
    while len(out) < limit and any(position < len(q) for q in queues):
        for q in queues:
            if position < len(q) and len(out) < limit:
                out.append(q[position])
        position += 1
    return tuple(out)


def pct(value: float | None) -> str:
    """A rate as a percentage with two decimals, or 'n/a'."""
    return "n/a" if value is None else f"{value * 100:.2f}%"


def _exclusions(tally: Tally) -> str:
    return ", ".join(f"{e.value.replace('_', ' ')} {tally.count(e)}" for e in Exclusion)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
