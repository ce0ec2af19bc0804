"""Parity's records (frozen) and the pure decisions over them: tallies, faults, the verdict.

Every figure that a report (JSON, HTML, CSV), the command line or the cutover gate shows is
derived here, from the counts the day query returns, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from enum import StrEnum
from typing import Any, overload

SAMPLE_LIMIT = 50
"""Mismatched tickets kept per class (the most differing orders first); the CSV has all."""
RULE_SAMPLE_LIMIT = 100
"""Ticket ids kept per accept rule in the report; the CSV names the rules of every ticket."""


class TicketClass(StrEnum):
    """How one compared ticket's shadow order set relates to its legacy order set."""

    EXACT = "exact"
    DRIFT_ONLY = "drift_only"
    PARTIAL = "partial"
    SHADOW_MISSING = "shadow_missing"
    UNVERIFIED = "unverified"
    LEGACY_MISSING = "legacy_missing"
    EXTRA_ONLY = "extra_only"


class Fault(StrEnum):
    """Whose fault a difference is: what the verdict and the review hinge on."""

    SHADOW = "shadow"
    LEGACY = "legacy"
    EXPLAINED = "explained"


FAULT_OF: Mapping[TicketClass, Fault | None] = {
    TicketClass.EXACT: None,
    TicketClass.DRIFT_ONLY: Fault.EXPLAINED,
    TicketClass.PARTIAL: Fault.SHADOW,
    TicketClass.SHADOW_MISSING: Fault.SHADOW,
    TicketClass.UNVERIFIED: Fault.SHADOW,
    TicketClass.LEGACY_MISSING: Fault.LEGACY,
    TicketClass.EXTRA_ONLY: Fault.LEGACY,
}


def classes_of(fault: Fault) -> tuple[TicketClass, ...]:
    """The ticket classes of one fault group, in report order."""
    return tuple(c for c in TicketClass if FAULT_OF[c] is fault)


SHADOW_FAULTS = classes_of(Fault.SHADOW)
LEGACY_FAULTS = classes_of(Fault.LEGACY)
MATCHING = (TicketClass.EXACT, TicketClass.DRIFT_ONLY)
MISMATCHED = SHADOW_FAULTS + LEGACY_FAULTS
DIFFERING = tuple(c for c in TicketClass if c is not TicketClass.EXACT)
"""Every class whose order sets differ (drift included): what the samples and the CSV hold."""
ACCEPTABLE = LEGACY_FAULTS
"""What an accept rule may cover: the legacy flow's faults. A shadow fault is fixed, not
accepted, and drift is explained already."""

CLASS_LABELS: Mapping[TicketClass, str] = {
    TicketClass.EXACT: "Exact match",
    TicketClass.DRIFT_ONLY: "Drift only",
    TicketClass.PARTIAL: "Partial",
    TicketClass.SHADOW_MISSING: "Shadow missing",
    TicketClass.UNVERIFIED: "Unverified extras",
    TicketClass.LEGACY_MISSING: "Legacy missing",
    TicketClass.EXTRA_ONLY: "Extra orders only",
}

CLASS_MEANINGS: Mapping[TicketClass, str] = {
    TicketClass.EXACT: "Same order set on both sides (both empty included).",
    TicketClass.DRIFT_ONLY: (
        "Same set except orders placed after the legacy lookup (confirmed by the warehouse): "
        "explained by time."
    ),
    TicketClass.PARTIAL: "Some legacy orders are not in the shadow output.",
    TicketClass.SHADOW_MISSING: "Legacy has orders; enrichq never enriched the ticket.",
    TicketClass.UNVERIFIED: (
        "Enrichq has orders legacy lacks that the warehouse does not confirm: not the "
        "customer's, or placed after enrichq's lookup."
    ),
    TicketClass.LEGACY_MISSING: (
        "Enrichq found orders the warehouse confirms, placed before the legacy lookup; "
        "legacy wrote none for the ticket."
    ),
    TicketClass.EXTRA_ONLY: (
        "Every legacy order is there, plus orders legacy lacks that the warehouse confirms."
    ),
}

FAULT_LABELS: Mapping[Fault, str] = {
    Fault.SHADOW: "Shadow worse",
    Fault.LEGACY: "Legacy worse",
    Fault.EXPLAINED: "Explained",
}

FAULT_MEANINGS: Mapping[Fault, str] = {
    Fault.SHADOW: (
        "enrichq lost or invented orders. These are held to the pass bars; fix them, they "
        "cannot be accepted."
    ),
    Fault.LEGACY: (
        "The legacy flow lost work that enrichq found and the warehouse confirms. They never "
        "fail a run, but each needs an accepted rule before cutover."
    ),
    Fault.EXPLAINED: "Orders placed after the legacy lookup. Nothing to do; shown to check.",
}


class Exclusion(StrEnum):
    """Why a ticket in the window was left out of the comparison."""

    TOO_YOUNG = "too_young"
    OPEN_QUEUE_ROWS = "open_queue_rows"
    NOT_ENRICHED = "not_enriched"
    """Enrichq never looked it up and legacy has no orders for it: nothing was compared (not
    an exact match); `enrichq backfill` enriches it."""


EXCLUSION_LABELS: Mapping[Exclusion, str] = {
    Exclusion.TOO_YOUNG: "Too young (created after the visibility delay plus grace)",
    Exclusion.OPEN_QUEUE_ROWS: "Open queue rows (queued or leased: still being processed)",
    Exclusion.NOT_ENRICHED: "Never enriched, no legacy orders (never looked up: `backfill`)",
}

ORDER_FIELDS = ("legacy", "matched", "missing", "extra", "drift", "unverified")
"""The order counts of one aggregate row of the day query, in this order."""


class _Tickets:
    """A read-only Tally attribute: its tickets of some classes or exclusion reasons, summed."""

    def __init__(self, kinds: Iterable[TicketClass | Exclusion]) -> None:
        self.kinds = tuple(kinds)

    @overload
    def __get__(self, tally: None, owner: object) -> _Tickets: ...
    @overload
    def __get__(self, tally: Tally, owner: object) -> int: ...
    def __get__(self, tally: Tally | None, owner: object) -> _Tickets | int:
        return self if tally is None else sum(tally.count(k) for k in self.kinds)


@dataclass(frozen=True, slots=True)
class Tally:
    """Ticket counts per class and per exclusion reason, and order counts, over some tickets.

    Orders on the shadow side only are split three ways: drift and extra (both confirmed
    by the warehouse) and unverified. ``accepted_*``: tickets of that legacy-fault class
    that an accept rule covers.
    """

    exact: int = 0
    drift_only: int = 0
    partial: int = 0
    shadow_missing: int = 0
    unverified: int = 0
    legacy_missing: int = 0
    extra_only: int = 0
    too_young: int = 0
    open_queue_rows: int = 0
    not_enriched: int = 0
    legacy_orders: int = 0
    matched_orders: int = 0
    missing_orders: int = 0
    extra_orders: int = 0
    drift_orders: int = 0
    unverified_orders: int = 0
    accepted_legacy_missing: int = 0
    accepted_extra_only: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(Tally))
        )

    def count(self, ticket_class: TicketClass | Exclusion) -> int:
        """Tickets of one class or exclusion reason."""
        value: int = getattr(self, ticket_class.value)
        return value

    def accepted(self, ticket_class: TicketClass) -> int:
        """Tickets of one class that an accept rule covers (0 for a class no rule may cover)."""
        if ticket_class not in ACCEPTABLE:
            return 0
        value: int = getattr(self, f"accepted_{ticket_class.value}")
        return value

    def in_group(self, fault: Fault) -> int:
        """Tickets of one fault group."""
        return sum(self.count(c) for c in classes_of(fault))

    compared = _Tickets(TicketClass)
    """Tickets compared (every class)."""
    excluded = _Tickets(Exclusion)
    """Tickets in the window left out of the comparison."""
    matching = _Tickets(MATCHING)
    """Tickets on which both flows agree: exact plus drift only."""
    mismatched = _Tickets(MISMATCHED)
    """Tickets whose difference is someone's fault (shadow or legacy)."""
    shadow_faults = _Tickets(SHADOW_FAULTS)
    """Tickets on which enrichq is worse than legacy."""
    legacy_faults = _Tickets(LEGACY_FAULTS)
    """Tickets on which legacy is worse than enrichq."""

    @property
    def accepted_legacy_faults(self) -> int:
        """Legacy-fault tickets an accept rule covers."""
        return sum(self.accepted(c) for c in ACCEPTABLE)

    @property
    def unaccepted_legacy_faults(self) -> int:
        """Legacy-fault tickets no accept rule covers: what keeps a passing run from cutover."""
        return self.legacy_faults - self.accepted_legacy_faults

    @property
    def order_coverage(self) -> float | None:
        """|shadow ∩ legacy| / |legacy| over the orders; None when legacy has none."""
        return self.matched_orders / self.legacy_orders if self.legacy_orders else None

    @property
    def shadow_fault_rate(self) -> float | None:
        """Shadow-fault tickets / compared; None when nothing was compared."""
        return self.shadow_faults / self.compared if self.compared else None

    @property
    def ticket_match_rate(self) -> float | None:
        """(exact + drift only) / compared: how often both flows agree; None if none compared."""
        return self.matching / self.compared if self.compared else None

    def as_dict(self) -> dict[str, Any]:
        """JSON shape: derived rates beside the raw counts."""
        return {
            "compared": self.compared,
            "excluded": self.excluded,
            "order_coverage": self.order_coverage,
            "shadow_fault_rate": self.shadow_fault_rate,
            "ticket_match_rate": self.ticket_match_rate,
            "faults": {
                Fault.SHADOW.value: self.shadow_faults,
                Fault.LEGACY.value: self.legacy_faults,
                Fault.EXPLAINED.value: self.in_group(Fault.EXPLAINED),
            },
            "classes": {c.value: self.count(c) for c in TicketClass},
            "accepted": {c.value: self.accepted(c) for c in ACCEPTABLE},
            "exclusions": {e.value: self.count(e) for e in Exclusion},
            "orders": {name: getattr(self, f"{name}_orders") for name in ORDER_FIELDS},
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Tally:
        """The tally of a stored JSON report (counts a report predates read as 0)."""
        classes, accepted = doc.get("classes", {}), doc.get("accepted", {})
        exclusions, orders = doc.get("exclusions", {}), doc.get("orders", {})
        return cls(
            **{c.value: int(classes.get(c.value, 0)) for c in TicketClass},
            **{e.value: int(exclusions.get(e.value, 0)) for e in Exclusion},
            **{f"{n}_orders": int(orders.get(n, 0)) for n in ORDER_FIELDS},
            **{f"accepted_{c.value}": int(accepted.get(c.value, 0)) for c in ACCEPTABLE},
        )


def tally_of(
    kind: str, name: str, tickets: int, orders: Sequence[int] = (), accepted: int = 0
) -> Tally:
    """The tally of one aggregate row of the day query ('class' or 'excluded')."""
    if kind == "class":
        ticket_class = TicketClass(name)
        extra = {f"accepted_{name}": accepted} if ticket_class in ACCEPTABLE else {}
        return Tally(
            **{ticket_class.value: tickets},
            **{f"{n}_orders": v for n, v in zip(ORDER_FIELDS, orders, strict=True)},
            **extra,
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
    """One differing ticket and how its order sets differ (ids sorted)."""

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
    unverified: tuple[str, ...] = ()
    accepted_by: tuple[int, ...] = ()

    @property
    def fault(self) -> Fault | None:
        """Whose fault the difference is."""
        return FAULT_OF[self.ticket_class]

    @property
    def differing_orders(self) -> int:
        """Orders on one side only: what the report ranks mismatches by."""
        return len(self.missing) + len(self.extra) + len(self.drift) + len(self.unverified)

    def as_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return {
            "ticket_id": self.ticket_id,
            "tenant": self.tenant,
            "class": self.ticket_class.value,
            "fault": None if self.fault is None else self.fault.value,
            "created_at": _iso(self.created_at),
            "enriched_at": _iso(self.enriched_at),
            "legacy_looked_up_at": _iso(self.legacy_looked_up_at),
            "legacy_orders": self.legacy_orders,
            "matched_orders": self.matched_orders,
            "missing": list(self.missing),
            "extra": list(self.extra),
            "drift": list(self.drift),
            "unverified": list(self.unverified),
            "accepted_by": list(self.accepted_by),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Mismatch:
        """A mismatch of a stored JSON report."""
        return cls(
            ticket_id=doc["ticket_id"],
            tenant=doc["tenant"],
            ticket_class=TicketClass(doc["class"]),
            created_at=_required(doc["created_at"]),
            enriched_at=_parse(doc.get("enriched_at")),
            legacy_looked_up_at=_parse(doc.get("legacy_looked_up_at")),
            legacy_orders=int(doc["legacy_orders"]),
            matched_orders=int(doc["matched_orders"]),
            missing=tuple(doc.get("missing", ())),
            extra=tuple(doc.get("extra", ())),
            drift=tuple(doc.get("drift", ())),
            unverified=tuple(doc.get("unverified", ())),
            accepted_by=tuple(int(r) for r in doc.get("accepted_by", ())),
        )


def rank_key(m: Mismatch) -> tuple[int, str]:
    """The report's order of mismatches: the most differing orders first, then by ticket id."""
    return (-m.differing_orders, m.ticket_id)


def keep_top(
    kept: Sequence[Mismatch], more: Iterable[Mismatch], limit: int = SAMPLE_LIMIT
) -> tuple[Mismatch, ...]:
    """The `limit` first mismatches of both, in rank order (whatever order they came in)."""
    return tuple(sorted([*kept, *more], key=rank_key)[:limit])


def by_fault(
    mismatches: Mapping[TicketClass, Sequence[Mismatch]], fault: Fault, limit: int = SAMPLE_LIMIT
) -> tuple[Mismatch, ...]:
    """The kept mismatches of one fault group, the most differing orders first."""
    every = [m for c in classes_of(fault) for m in mismatches.get(c, ())]
    return tuple(sorted(every, key=rank_key)[:limit])


@dataclass(frozen=True, slots=True)
class AcceptRule:
    """One reviewed rule of an accept file: which legacy-fault tickets it covers, and why.

    `number` is its position in the file (from 1) and `line` the line its table starts on.
    A rule has a scope of ticket ids or of creation days (UTC, both ends included).
    """

    number: int
    line: int
    ticket_class: TicketClass
    reason: str
    author: str
    tenant: str | None = None
    tickets: tuple[str, ...] | None = None
    first_day: date | None = None
    last_day: date | None = None

    def scope(self) -> str:
        """The rule's scope in words, for a reader."""
        parts = [] if self.tenant is None else [f"tenant {self.tenant or '(no tenant)'}"]
        if self.tickets is not None:
            shown = ", ".join(self.tickets[:5])
            more = f" (+{len(self.tickets) - 5} more)" if len(self.tickets) > 5 else ""
            parts.append(f"tickets {shown}{more}")
        if self.first_day is not None and self.last_day is not None:
            parts.append(
                f"created {self.first_day.isoformat()}"
                if self.first_day == self.last_day
                else f"created {self.first_day.isoformat()} … {self.last_day.isoformat()}"
            )
        return ", ".join(parts)

    def as_sql(self) -> dict[str, Any]:
        """The shape the day query reads its rules in (jsonb_to_recordset)."""
        return {
            "rule": self.number,
            "ticket_class": self.ticket_class.value,
            "tenant": self.tenant,
            "tickets": None if self.tickets is None else list(self.tickets),
            "first_day": _iso_day(self.first_day),
            "last_day": _iso_day(self.last_day),
        }

    def as_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return {
            "number": self.number,
            "line": self.line,
            "class": self.ticket_class.value,
            "tenant": self.tenant,
            "tickets": None if self.tickets is None else list(self.tickets),
            "first_day": _iso_day(self.first_day),
            "last_day": _iso_day(self.last_day),
            "reason": self.reason,
            "author": self.author,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> AcceptRule:
        """A rule of a stored JSON report."""
        tickets = doc.get("tickets")
        return cls(
            number=int(doc["number"]),
            line=int(doc["line"]),
            ticket_class=TicketClass(doc["class"]),
            reason=doc["reason"],
            author=doc["author"],
            tenant=doc.get("tenant"),
            tickets=None if tickets is None else tuple(tickets),
            first_day=_parse_day(doc.get("first_day")),
            last_day=_parse_day(doc.get("last_day")),
        )


@dataclass(frozen=True, slots=True)
class AcceptFile:
    """A parsed accept file: where it was read from, its bytes' SHA-256, its rules."""

    path: str
    sha256: str
    rules: tuple[AcceptRule, ...]


@dataclass(frozen=True, slots=True)
class RuleResult:
    """What one rule matched in a run: how many tickets, and the first few by id."""

    rule: AcceptRule
    matched: int
    tickets: tuple[str, ...]

    @property
    def unused(self) -> bool:
        """The rule matched nothing: its scope is wrong, or the difference is gone."""
        return self.matched == 0

    def as_dict(self) -> dict[str, Any]:
        """JSON shape: the rule, then what it matched."""
        return {
            **self.rule.as_dict(),
            "matched": self.matched,
            "tickets_matched": list(self.tickets),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RuleResult:
        """A rule's result of a stored JSON report."""
        return cls(
            AcceptRule.from_dict(doc), int(doc["matched"]), tuple(doc.get("tickets_matched", ()))
        )


def merge_rule_tickets(
    kept: Sequence[str], more: Iterable[str], limit: int = RULE_SAMPLE_LIMIT
) -> tuple[str, ...]:
    """The `limit` smallest ticket ids of both (the report lists a rule's first tickets)."""
    return tuple(sorted({*kept, *more})[:limit])


@dataclass(frozen=True, slots=True)
class Approval:
    """A reviewer's signature on a finished parity run."""

    run_id: int
    approved_by: str
    approved_at: datetime
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return {
            "run_id": self.run_id,
            "approved_by": self.approved_by,
            "approved_at": _iso(self.approved_at),
            "note": self.note,
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
class TenantCoverage:
    """One tenant's tickets in the mirror, all time ('' = no tenant), and the shadow table.

    `not_enriched`: tickets old enough to have been enriched (created before the run's
    "too young" line) that enrichq never enriched: consumers would lose what legacy shows
    for them at cutover. `enriched` and `shadow_orders`: what enrichq's tables hold for the
    tenant (the gate checks they are still there at cutover time).
    """

    tenant: str
    tickets: int
    not_enriched: int
    enriched: int
    shadow_orders: int

    def as_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Coverage:
    """Every ticket consumers can read through the view, all time (not just the window).

    `legacy_only`: tickets with legacy rows that the mirror lacks (they have no tenant; a
    staged cutover keeps showing their legacy rows, a whole one would hide them), of which
    `legacy_only_not_enriched` enrichq never enriched.
    """

    tenants: tuple[TenantCoverage, ...]
    legacy_only: int = 0
    legacy_only_not_enriched: int = 0

    def of(self, tenant: str) -> TenantCoverage:
        """One tenant's coverage (a tenant without tickets: all zero)."""
        for t in self.tenants:
            if t.tenant == tenant:
                return t
        return TenantCoverage(tenant, 0, 0, 0, 0)

    @property
    def not_enriched(self) -> int:
        """Tickets of every tenant that enrichq never enriched (legacy-only ones included)."""
        return sum(t.not_enriched for t in self.tenants) + self.legacy_only_not_enriched

    def as_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return {
            "not_enriched": self.not_enriched,
            "legacy_only": self.legacy_only,
            "legacy_only_not_enriched": self.legacy_only_not_enriched,
            "tenants": [t.as_dict() for t in self.tenants],
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Coverage:
        """The coverage of a stored run."""
        return cls(
            tuple(
                TenantCoverage(
                    str(t["tenant"]),
                    int(t["tickets"]),
                    int(t["not_enriched"]),
                    int(t["enriched"]),
                    int(t["shadow_orders"]),
                )
                for t in doc.get("tenants", ())
            ),
            int(doc.get("legacy_only", 0)),
            int(doc.get("legacy_only_not_enriched", 0)),
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """The decision over a tally, and one line saying why.

    `passed`: enrichq's own faults are within the bars (legacy faults never fail a run).
    `ready`: passed, and an accepted rule covers every legacy fault: what cutover needs.
    `nothing_to_judge`: no ticket, or no legacy order, was compared (never passes).
    """

    passed: bool
    reason: str
    ready: bool = False
    nothing_to_judge: bool = False

    @property
    def state(self) -> str:
        """One word for badges and listings: pass, review (passed, not ready), fail, empty."""
        if self.nothing_to_judge:
            return "empty"
        if not self.passed:
            return "fail"
        return "pass" if self.ready else "review"


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The bars a run was judged by (stored with the run, so it is re-judged the same)."""

    min_order_coverage: float
    max_shadow_fault_rate: float
    min_ticket_match_rate: float
    """Not a bar: below it the report marks how often both flows agree, for the reviewer."""


def decide(tally: Tally, thresholds: Thresholds) -> Verdict:
    """Judge a tally: shadow faults against the bars, then whether legacy faults are accepted.

    Passes when order coverage ≥ its minimum and the shadow fault rate ≤ its maximum; an
    empty window (nothing to judge) never passes. Legacy faults never fail a run; a passing
    run is ready for cutover when an accepted rule covers each of them.
    """
    if tally.compared == 0:
        why = f" ({tally.excluded} excluded: {_exclusions(tally)})" if tally.excluded else ""
        return Verdict(
            False, f"no tickets compared in the window{why}: nothing to judge", False, True
        )
    coverage, rate = tally.order_coverage, tally.shadow_faults / tally.compared
    short: list[str] = []
    # No legacy order among the compared tickets (the legacy flow lost them all, or the
    # customers have none): coverage of an empty set is no failure, the fault rate judges.
    if coverage is not None and coverage < thresholds.min_order_coverage:
        short.append(
            f"order coverage {pct(coverage)} is below {pct(thresholds.min_order_coverage)}"
        )
    if rate > thresholds.max_shadow_fault_rate:
        short.append(
            f"shadow fault rate {pct(rate)} is above {pct(thresholds.max_shadow_fault_rate)} "
            f"({_faults(tally, SHADOW_FAULTS)})"
        )
    if short:
        return Verdict(False, "; ".join(short))
    bars = (
        f"order coverage {pct(coverage)} ≥ {pct(thresholds.min_order_coverage)}"
        if coverage is not None
        else "order coverage n/a (legacy has no orders for these tickets)"
    ) + f" and shadow fault rate {pct(rate)} ≤ {pct(thresholds.max_shadow_fault_rate)}"
    unaccepted = tally.unaccepted_legacy_faults
    if unaccepted:
        return Verdict(
            True,
            f"{bars}; {plural(unaccepted, 'legacy-fault ticket')} not accepted yet "
            f"({_faults(tally, LEGACY_FAULTS, unaccepted_only=True)}): cutover needs an "
            "accepted rule for each",
            ready=False,
        )
    if tally.legacy_faults:
        return Verdict(
            True,
            f"{bars}; all {plural(tally.legacy_faults, 'legacy-fault ticket')} accepted",
            ready=True,
        )
    return Verdict(True, f"{bars}; no legacy faults", ready=True)


def failing_tenants(tenants: Mapping[str, Tally], thresholds: Thresholds) -> dict[str, Verdict]:
    """The tenants whose own figures are not ready for cutover (failing, or with legacy
    faults not accepted), by name: what a whole cutover refuses."""
    verdicts = {t: decide(tenants[t], thresholds) for t in sorted(tenants)}
    return {t: v for t, v in verdicts.items() if not v.ready}


@dataclass(frozen=True, slots=True)
class ParityReport:
    """Everything one parity run found; what the JSON, HTML and CSV reports are made from."""

    run_id: int | None
    since: datetime
    until: datetime
    now: datetime
    young_after: datetime
    started_at: datetime
    finished_at: datetime | None
    duration_seconds: float
    thresholds: Thresholds
    total: Tally
    days: tuple[DayResult, ...]
    tenants: tuple[TenantResult, ...]
    mismatches: Mapping[TicketClass, tuple[Mismatch, ...]]
    rules: tuple[RuleResult, ...]
    accept_file: AcceptFile | None
    sources: Mapping[str, str]
    coverage: Coverage | None = None
    """Every ticket consumers can read, all time (None: a run recorded before it)."""

    @property
    def verdict(self) -> Verdict:
        """The run's verdict over every compared ticket."""
        return decide(self.total, self.thresholds)

    @property
    def passed(self) -> bool:
        """Shadow faults are within the bars."""
        return self.verdict.passed

    def tenant_verdict(self, tenant: str) -> Verdict | None:
        """One tenant's verdict by the run's bars (what a staged cutover is gated on)."""
        for t in self.tenants:
            if t.tenant == tenant:
                return decide(t.tally, self.thresholds)
        return None

    def sample(self, fault: Fault, limit: int = SAMPLE_LIMIT) -> tuple[Mismatch, ...]:
        """The kept mismatches of one fault group, the most differing orders first."""
        return by_fault(self.mismatches, fault, limit)

    def as_dict(self) -> dict[str, Any]:
        """The JSON report (also stored in enrichq.parity_runs.report)."""
        verdict = self.verdict
        return {
            "run_id": self.run_id,
            "passed": verdict.passed,
            "ready": verdict.ready,
            "state": verdict.state,
            "verdict": verdict.reason,
            "window": {
                "since": _iso(self.since),
                "until": _iso(self.until),
                "now": _iso(self.now),
                "young_after": _iso(self.young_after),
            },
            "thresholds": dataclasses.asdict(self.thresholds),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "duration_seconds": round(self.duration_seconds, 3),
            "sources": dict(self.sources),
            "accept_file": (
                None
                if self.accept_file is None
                else {"path": self.accept_file.path, "sha256": self.accept_file.sha256}
            ),
            "rules": [r.as_dict() for r in self.rules],
            "coverage": None if self.coverage is None else self.coverage.as_dict(),
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
            "tenants": [
                {
                    "tenant": t.tenant,
                    **t.tally.as_dict(),
                    "state": decide(t.tally, self.thresholds).state,
                    "verdict": decide(t.tally, self.thresholds).reason,
                }
                for t in self.tenants
            ],
            "mismatches": {
                c.value: [m.as_dict() for m in self.mismatches.get(c, ())] for c in DIFFERING
            },
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ParityReport:
        """A stored JSON report, read back (its verdict is decided again, the same way)."""
        window, bars = doc["window"], doc["thresholds"]
        accept = doc.get("accept_file")
        rules = tuple(RuleResult.from_dict(r) for r in doc.get("rules", ()))
        return cls(
            run_id=doc.get("run_id"),
            since=_required(window["since"]),
            until=_required(window["until"]),
            now=_required(window["now"]),
            young_after=_required(window["young_after"]),
            started_at=_required(doc["started_at"]),
            finished_at=_parse(doc.get("finished_at")),
            duration_seconds=float(doc.get("duration_seconds", 0.0)),
            thresholds=Thresholds(
                min_order_coverage=float(bars["min_order_coverage"]),
                max_shadow_fault_rate=float(bars["max_shadow_fault_rate"]),
                min_ticket_match_rate=float(bars["min_ticket_match_rate"]),
            ),
            total=Tally.from_dict(doc["total"]),
            days=tuple(
                DayResult(
                    date.fromisoformat(d["day"]),
                    _required(d["since"]),
                    _required(d["until"]),
                    Tally.from_dict(d),
                )
                for d in doc.get("days", ())
            ),
            tenants=tuple(
                TenantResult(t["tenant"], Tally.from_dict(t)) for t in doc.get("tenants", ())
            ),
            mismatches={
                TicketClass(c): tuple(Mismatch.from_dict(m) for m in ms)
                for c, ms in doc.get("mismatches", {}).items()
            },
            rules=rules,
            accept_file=(
                None
                if accept is None
                else AcceptFile(accept["path"], accept["sha256"], tuple(r.rule for r in rules))
            ),
            sources=dict(doc.get("sources", {})),
            coverage=None if doc.get("coverage") is None else Coverage.from_dict(doc["coverage"]),
        )


def pct(value: float | None) -> str:
    """A rate as a percentage with two decimals, or 'n/a'."""
    return "n/a" if value is None else f"{value * 100:.2f}%"


def plural(n: int, noun: str) -> str:
    """'1 ticket', '2 tickets' (with thousands separators)."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _faults(tally: Tally, classes: Sequence[TicketClass], *, unaccepted_only: bool = False) -> str:
    parts = []
    for c in classes:
        n = tally.count(c) - (tally.accepted(c) if unaccepted_only else 0)
        if n:
            parts.append(f"{c.value.replace('_', ' ')} {n:,}")
    return ", ".join(parts) or "none"


def _exclusions(tally: Tally) -> str:
    return ", ".join(f"{e.value.replace('_', ' ')} {tally.count(e)}" for e in Exclusion)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _iso_day(value: date | None) -> str | None:
    return value.isoformat() if value is not None else None


def _parse(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


def _required(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _parse_day(value: str | None) -> date | None:
    return None if value is None else date.fromisoformat(value)
