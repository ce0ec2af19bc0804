"""The parity report as JSON and as one self-contained HTML page (CSS and SVG inline); the
figures come from `enrichq_parity.model`, this module lays them out."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import resources
from typing import Any

from enrichq_parity.model import (
    ACCEPTABLE,
    CLASS_LABELS,
    CLASS_MEANINGS,
    EXCLUSION_LABELS,
    FAULT_LABELS,
    FAULT_MEANINGS,
    Approval,
    DayResult,
    Exclusion,
    Fault,
    Mismatch,
    ParityReport,
    RuleResult,
    Tally,
    TicketClass,
    classes_of,
    decide,
    pct,
    plural,
)
from enrichq_schema.text import utc_time

BAR_SHARE = 0.35
"""The share of the chart's height the tallest ticket bar may take (the right axis's top)."""
MAX_CHIPS = 24
"""Order ids shown per diff cell; the JSON and CSV reports have them all."""
MAX_RULE_CHIPS = 30
"""Ticket ids shown per accept rule."""

STATE_BADGES = {
    "pass": "PASS",
    "review": "PASS · LEGACY FAULTS TO ACCEPT",
    "fail": "FAIL",
    "empty": "NOTHING TO JUDGE",
}
CANNOT_APPROVE = (
    "a run that did not pass cannot be approved: fix the shadow faults, run parity again and "
    "approve that run"
)
STATE_WORDS = {"pass": "pass", "review": "to accept", "fail": "fail", "empty": "no data"}
"""A tenant's or a day's state in the breakdown tables."""


def to_json(report: ParityReport, approvals: Sequence[Approval] = ()) -> str:
    """The JSON report: the document stored in enrichq.parity_runs.report, plus approvals."""
    document = {**report.as_dict(), "approvals": [a.as_dict() for a in approvals]}
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def to_html(report: ParityReport, approvals: Sequence[Approval] = ()) -> str:
    """The HTML report a reviewer reads before cutover; the template escapes every datum."""
    from markupsafe import Markup

    t = report.total
    verdict = report.verdict
    page: str = _template().render(
        title=f"enrichq parity run #{report.run_id}" if report.run_id else "enrichq parity",
        report=report,
        t=t,
        verdict=verdict,
        badge=STATE_BADGES[verdict.state],
        state_words=STATE_WORDS,
        approvals=list(approvals),
        cannot_approve=CANNOT_APPROVE,
        checklist=_checklist(report, approvals),
        cards=_cards(report),
        chart=_chart(report),
        groups=_groups(report),
        rules=report.rules,
        orders=_orders(t),
        exclusions=[(EXCLUSION_LABELS[e], t.count(e)) for e in Exclusion],
        tenants=[
            _breakdown_row(tr.tenant or "(no tenant)", tr.tally, report) for tr in report.tenants
        ],
        days=[_breakdown_row(d.day.isoformat(), d.tally, report) for d in report.days],
        footer=_footer(report),
        css=Markup(_css()),  # noqa: S704 -- our own stylesheet, shipped in the package
        fmt=_Format(),
        chips=chips,
        rule_tickets=rule_tickets,
    )
    return page


@cache
def _template() -> Any:
    from jinja2 import Environment, PackageLoader, StrictUndefined

    env = Environment(
        loader=PackageLoader("enrichq_parity", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    return env.get_template("report.html.j2")


@cache
def _css() -> str:
    return resources.files("enrichq_parity").joinpath("templates/report.css").read_text("utf-8")


class _Format:
    """Formatting helpers the template calls (plain text out; the template escapes it)."""

    @staticmethod
    def num(value: int) -> str:
        return f"{value:,}"

    @staticmethod
    def pct(value: float | None) -> str:
        return pct(value)

    @staticmethod
    def when(value: datetime | None) -> str:
        return utc_time(value)

    @staticmethod
    def class_label(value: TicketClass) -> str:
        return CLASS_LABELS[value]

    @staticmethod
    def plural(n: int, noun: str) -> str:
        return plural(n, noun)


@dataclass(frozen=True, slots=True)
class _Card:
    label: str
    value: str
    sub: str
    tone: str


@dataclass(frozen=True, slots=True)
class _Check:
    tone: str  # ok, bad (enrichq's own faults) or todo (a step of the review left)
    label: str
    detail: str


@dataclass(frozen=True, slots=True)
class _GroupRow:
    ticket_class: TicketClass
    label: str
    tickets: int
    share: str
    accepted: int | None
    meaning: str


@dataclass(frozen=True, slots=True)
class _Group:
    fault: Fault
    label: str
    meaning: str
    tickets: int
    rows: tuple[_GroupRow, ...]
    sample: tuple[Mismatch, ...]  # the kept mismatches, the most differing orders first


@dataclass(frozen=True, slots=True)
class _Chips:
    missing: tuple[str, ...]
    extra: tuple[str, ...]
    drift: tuple[str, ...]
    unverified: tuple[str, ...]
    more: int


@dataclass(frozen=True, slots=True)
class _BreakdownRow:
    name: str
    tally: Tally
    state: str
    coverage_tone: str
    fault_tone: str


def _checklist(report: ParityReport, approvals: Sequence[Approval]) -> list[_Check]:
    """What cutover needs of this run, item by item (freshness is judged at cutover time)."""
    t, verdict = report.total, report.verdict
    if t.legacy_faults == 0:
        accepted_detail = "no legacy faults to accept"
    elif t.unaccepted_legacy_faults == 0:
        accepted_detail = f"all {plural(t.legacy_faults, 'legacy-fault ticket')} accepted"
    else:
        accepted_detail = (
            f"{plural(t.unaccepted_legacy_faults, 'legacy-fault ticket')} without an accepted "
            "rule: add rules to the accept file and run parity again"
        )
    if approvals:
        approved_detail = ", ".join(
            f"{a.approved_by} ({utc_time(a.approved_at)} UTC)" for a in approvals
        )
    elif verdict.passed:
        approved_detail = f"not yet: enrichq parity approve {report.run_id} --by NAME"
    else:
        approved_detail = CANNOT_APPROVE
    shadow_detail = verdict.reason.split("; ")[0] if verdict.passed else verdict.reason
    legacy_ok = verdict.passed and t.unaccepted_legacy_faults == 0
    return [
        _Check("ok" if verdict.passed else "bad", "Shadow faults within the bars", shadow_detail),
        _Check("ok" if legacy_ok else "todo", "Legacy faults accepted", accepted_detail),
        _Check("ok" if approvals else "todo", "Approved by a reviewer", approved_detail),
    ]


def _tone(value: float | None, ok: Callable[[float], bool]) -> str:
    if value is None:
        return "na"
    return "good" if ok(value) else "bad"


def _cards(report: ParityReport) -> list[_Card]:
    t, bars = report.total, report.thresholds
    legacy_tone = "plain" if t.legacy_faults == 0 else (
        "good" if t.unaccepted_legacy_faults == 0 else "warn"
    )  # fmt: skip
    return [
        _Card(
            "Order coverage",
            pct(t.order_coverage),
            f"bar ≥ {pct(bars.min_order_coverage)} · {t.matched_orders:,} of "
            f"{t.legacy_orders:,} legacy orders",
            _tone(t.order_coverage, lambda v: v >= bars.min_order_coverage),
        ),
        _Card(
            "Shadow fault rate",
            pct(t.shadow_fault_rate),
            f"bar ≤ {pct(bars.max_shadow_fault_rate)} · {plural(t.shadow_faults, 'ticket')} "
            "enrichq got wrong",
            _tone(t.shadow_fault_rate, lambda v: v <= bars.max_shadow_fault_rate),
        ),
        _Card(
            "Legacy faults",
            f"{t.legacy_faults:,}",
            f"{t.accepted_legacy_faults:,} accepted · {t.unaccepted_legacy_faults:,} to accept",
            legacy_tone,
        ),
        _Card(
            "Ticket match rate",
            pct(t.ticket_match_rate),
            f"both flows agree · not a bar (flagged under {pct(bars.min_ticket_match_rate)})",
            "plain"
            if t.ticket_match_rate is None or t.ticket_match_rate >= bars.min_ticket_match_rate
            else "warn",
        ),
        _Card(
            "Tickets compared",
            f"{t.compared:,}",
            f"{t.excluded:,} excluded · {t.drift_only:,} drift only",
            "plain",
        ),
    ]


def _groups(report: ParityReport) -> list[_Group]:
    """Per fault group: its counts by class, and the sample of its mismatches."""
    t = report.total
    out = []
    for fault in Fault:
        rows = tuple(
            _GroupRow(
                c,
                CLASS_LABELS[c],
                t.count(c),
                pct(t.count(c) / t.compared if t.compared else None),
                t.accepted(c) if c in ACCEPTABLE else None,
                CLASS_MEANINGS[c],
            )
            for c in classes_of(fault)
        )
        out.append(
            _Group(
                fault,
                FAULT_LABELS[fault],
                FAULT_MEANINGS[fault],
                t.in_group(fault),
                rows,
                report.sample(fault),
            )
        )
    return out


def rule_tickets(r: RuleResult) -> tuple[tuple[str, ...], int]:
    """The ticket ids of an accept rule's cell, at most MAX_RULE_CHIPS, and how many more."""
    shown = r.tickets[:MAX_RULE_CHIPS]
    return shown, r.matched - len(shown)


def chips(m: Mismatch) -> _Chips:
    """The order ids of a mismatch's diff cell, at most MAX_CHIPS of them."""
    left = MAX_CHIPS
    shown: list[tuple[str, ...]] = []
    for ids in (m.missing, m.unverified, m.extra, m.drift):
        shown.append(ids[:left])
        left -= len(shown[-1])
    return _Chips(shown[0], shown[2], shown[3], shown[1], m.differing_orders - MAX_CHIPS + left)


def _orders(t: Tally) -> list[tuple[str, int, str]]:
    return [
        ("Legacy orders", t.legacy_orders, "the denominator of order coverage"),
        ("Matched (in both)", t.matched_orders, "the numerator of order coverage"),
        ("Missing from shadow", t.missing_orders, "legacy has them, enrichq does not"),
        (
            "Unverified in shadow",
            t.unverified_orders,
            "enrichq only; the warehouse does not confirm",
        ),
        ("Extra in shadow", t.extra_orders, "enrichq only, confirmed; legacy should have had them"),
        ("Drift", t.drift_orders, "enrichq only, confirmed, placed after the legacy lookup"),
    ]


def _breakdown_row(name: str, tally: Tally, report: ParityReport) -> _BreakdownRow:
    bars = report.thresholds
    return _BreakdownRow(
        name=name,
        tally=tally,
        state=decide(tally, bars).state,
        coverage_tone=_tone(tally.order_coverage, lambda v: v >= bars.min_order_coverage),
        fault_tone=_tone(tally.shadow_fault_rate, lambda v: v <= bars.max_shadow_fault_rate),
    )


def _footer(report: ParityReport) -> list[tuple[str, str]]:
    accept = report.accept_file
    return [
        ("Legacy table", report.sources.get("legacy", "")),
        ("Shadow table", report.sources.get("shadow", "")),
        ("Tickets table", report.sources.get("tickets", "")),
        ("Shadow-only orders verified against", report.sources.get("verified_against", "")),
        ("Read", report.sources.get("read_side", "")),
        (
            "Not yet enriched (all time)",
            "—"
            if report.coverage is None
            else f"{report.coverage.not_enriched:,} tickets consumers can read"
            f" ({report.coverage.legacy_only:,} legacy tickets the mirror lacks)",
        ),
        ("Accept file", "none" if accept is None else f"{accept.path} (sha256 {accept.sha256})"),
        ("Measured at", _plain(report.now)),
        ("Too young after", _plain(report.young_after)),
        ("Run id", str(report.run_id)),
    ]


def _plain(value: datetime | None) -> str:
    return "—" if value is None else f"{utc_time(value, seconds=True)} UTC"


# -- the chart -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Point:
    """A place on the chart and its words: a label written there, or a dot's tooltip."""

    x: float
    y: float
    text: str
    anchor: str = "middle"


@dataclass(frozen=True, slots=True)
class _Line:
    y: float
    css: str
    title: str


@dataclass(frozen=True, slots=True)
class _Bar:
    x: float
    y: float
    width: float
    height: float
    title: str


@dataclass(frozen=True, slots=True)
class _Series:
    css: str
    polylines: tuple[str, ...]
    dots: tuple[_Point, ...]


@dataclass(frozen=True, slots=True)
class _Chart:
    width: int
    height: int
    left: int
    right: int
    baseline: float
    grid: tuple[_Line, ...]
    ticks: tuple[_Point, ...]
    bars: tuple[_Bar, ...]
    labels: tuple[_Point, ...]
    nodata: tuple[_Point, ...]
    thresholds: tuple[_Line, ...]
    series: tuple[_Series, ...]


def _fault_free(d: DayResult) -> float | None:
    """The share of a day's compared tickets without a shadow fault (1 - the fault rate)."""
    rate = d.tally.shadow_fault_rate
    return None if rate is None else 1.0 - rate


def _chart(report: ParityReport) -> _Chart | None:
    """Coverage and fault-free tickets per day as lines against their bars, tickets as bars."""
    days = report.days
    if not any(d.tally.compared for d in days):
        return None
    bars = report.thresholds
    width, height = 960, 300
    left, right, top, bottom = 56, 64, 16, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for d in days for v in (d.tally.order_coverage, _fault_free(d)) if v is not None]
    low, step = _axis(min([*values, bars.min_order_coverage, 1.0 - bars.max_shadow_fault_rate]))
    span = 1.0 - low
    slot = plot_w / len(days)
    # the bars have an axis of their own, on the right, in tickets: a round top count
    most = _round_up(max((d.tally.compared for d in days), default=0) or 1)

    def x(i: int) -> float:
        return left + slot * (i + 0.5)

    def y(v: float) -> float:
        return top + plot_h * (1.0 - (v - low) / span)

    grid, ticks = [], []
    for k in range(round(span / step) + 1):
        v = low + k * step
        grid.append(_Line(y(v), "grid", ""))
        ticks.append(_Point(left - 6, y(v) + 4, f"{v * 100:.{_decimals(step)}f}%", "end"))
    for count in (0, most // 2, most) if most > 1 else (0, most):
        bar_y = top + plot_h - plot_h * BAR_SHARE * count / most
        ticks.append(_Point(width - right + 6, bar_y + 4, f"{count:,}", "start"))
    ticks.append(_Point(width - right + 6, top + plot_h * (1 - BAR_SHARE) - 10, "tickets", "start"))
    bar_items, labels, nodata = [], [], []
    label_every = max(1, math.ceil(len(days) / 14))
    for i, d in enumerate(days):
        h = plot_h * BAR_SHARE * d.tally.compared / most
        bar_items.append(
            _Bar(
                x(i) - slot * 0.3,
                top + plot_h - h,
                slot * 0.6,
                h,
                f"{d.day.isoformat()}: {d.tally.compared:,} tickets compared, "
                f"{d.tally.shadow_faults:,} shadow faults, {d.tally.legacy_faults:,} legacy "
                f"faults, {d.tally.excluded:,} excluded",
            )
        )
        if i % label_every == 0 or i == len(days) - 1:
            labels.append(_Point(x(i), height - bottom + 18, d.day.strftime("%m-%d")))
        if d.tally.compared == 0:
            nodata.append(_Point(x(i), top + plot_h - 6, "no data"))
    thresholds = (
        _Line(y(bars.min_order_coverage), "cov", f"coverage bar {pct(bars.min_order_coverage)}"),
        _Line(
            y(1.0 - bars.max_shadow_fault_rate),
            "faults",
            f"shadow fault bar {pct(bars.max_shadow_fault_rate)}",
        ),
    )
    series = (
        _series(days, lambda d: d.tally.order_coverage, x=x, y=y, css="cov", name="order coverage"),
        _series(days, _fault_free, x=x, y=y, css="faults", name="tickets without a shadow fault"),
    )
    return _Chart(
        width, height, left, right, top + plot_h, tuple(grid), tuple(ticks), tuple(bar_items),
        tuple(labels), tuple(nodata), thresholds, series,
    )  # fmt: skip


def _series(
    days: Sequence[DayResult],
    get: Callable[[DayResult], float | None],
    *,
    x: Callable[[int], float],
    y: Callable[[float], float],
    css: str,
    name: str,
) -> _Series:
    """A polyline per run of days with data, and a dot per day with a tooltip."""
    runs: list[list[tuple[float, float]]] = [[]]
    dots: list[_Point] = []
    for i, d in enumerate(days):
        v = get(d)
        if v is None:
            runs.append([])
            continue
        runs[-1].append((x(i), y(v)))
        dots.append(_Point(x(i), y(v), f"{d.day.isoformat()}: {name} {pct(v)}"))
    lines = tuple(
        " ".join(f"{px:.1f},{py:.1f}" for px, py in points) for points in runs if len(points) > 1
    )
    return _Series(css, lines, tuple(dots))


def _round_up(count: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50… that is at least `count`."""
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale >= count:
                return step * scale
        scale *= 10


def _axis(floor: float) -> tuple[float, float]:
    """A lower bound under `floor` and a tick step, so near-1 rates are not squashed."""
    gap = max(1.0 - floor, 0.0)
    for step in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2):
        if gap * 1.15 <= step * 5:
            low = max(0.0, math.floor((1.0 - max(gap * 1.15, step)) / step) * step)
            return round(low, 6), step
    return 0.0, 0.2


def _decimals(step: float) -> int:
    return max(0, -math.floor(math.log10(step * 100) + 1e-9)) if step < 0.01 else 0
