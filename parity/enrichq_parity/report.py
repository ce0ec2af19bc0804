"""The parity report as JSON and as one self-contained HTML page (inline CSS and SVG, offline)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from html import escape

from enrichq_parity.model import (
    CLASS_LABELS,
    CLASS_MEANINGS,
    EXCLUSION_LABELS,
    MATCHING,
    DayResult,
    Exclusion,
    Mismatch,
    ParityReport,
    Tally,
    TicketClass,
    pct,
)

MAX_CHIPS = 24  # order ids shown per diff cell; the JSON report has them all


def to_json(report: ParityReport) -> str:
    """The JSON report (the same document as enrichq.parity_runs.report)."""
    return json.dumps(report.as_dict(), indent=2, ensure_ascii=False) + "\n"


def to_html(report: ParityReport) -> str:
    """The HTML report a reviewer reads before cutover; every datum is escaped."""
    t = report.total
    title = f"enrichq parity run #{report.run_id}" if report.run_id else "enrichq parity"
    state = "pass" if report.passed else ("empty" if t.compared == 0 else "fail")
    badge = {"pass": "PASS", "fail": "FAIL", "empty": "NOTHING TO JUDGE"}[state]
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title>",
        f"<style>{_CSS}</style></head><body><main>",
        '<header class="top">',
        f"<div><h1>{escape(title)}</h1>",
        f'<p class="muted">Tickets created {_when(report.since)} → {_when(report.until)} '
        f"(UTC, end exclusive) · finished {_when(report.finished_at)} · "
        f"{report.duration_seconds:.1f} s</p></div>",
        f'<div class="badge {state}">{badge}</div>',
        "</header>",
        f'<p class="verdict {state}">{escape(report.verdict.reason)}</p>',
        _cards(report),
        "<section><h2>Coverage per day</h2>",
        _chart(report),
        "</section>",
        "<section><h2>Tickets by class</h2>",
        _class_table(t),
        "</section>",
        "<section><h2>Orders</h2>",
        _orders_table(t),
        "</section>",
        "<section><h2>Excluded tickets</h2>",
        _excluded_table(report),
        "</section>",
        "<section><h2>Per day</h2>",
        _breakdown(
            "Day", [(d.day.isoformat(), d.tally) for d in report.days], report, empty="no days"
        ),
        "</section>",
        "<section><h2>Per tenant</h2>",
        _breakdown(
            "Tenant",
            [(tr.tenant or "(no tenant)", tr.tally) for tr in report.tenants],
            report,
            empty="no tickets in the window",
        ),
        "</section>",
        f"<section><h2>Mismatch sample <small>{len(report.sample)} of "
        f"{t.mismatched:,} mismatched tickets</small></h2>",
        _legend(),
        _sample_table(report.sample, empty="No mismatched tickets."),
        "</section>",
        f"<section><h2>Drift sample <small>{len(report.drift_sample)} of "
        f"{t.drift_only:,} drift-only tickets (counted as matches)</small></h2>",
        _sample_table(report.drift_sample, empty="No drift."),
        "</section>",
        _footer(report),
        "</main></body></html>",
    ]
    return "\n".join(parts) + "\n"


def _when(value: datetime | None) -> str:
    return "—" if value is None else escape(f"{value:%Y-%m-%d %H:%M}")


def _num(value: int) -> str:
    return f"{value:,}"


def _rate_class(value: float | None, bar: float) -> str:
    if value is None:
        return "na"
    return "good" if value >= bar else "bad"


def _cards(report: ParityReport) -> str:
    t = report.total
    cov, rate = t.order_coverage, t.ticket_match_rate
    cards = [
        (
            "Order coverage",
            pct(cov),
            f"min {pct(report.min_order_coverage)} · "
            f"{_num(t.matched_orders)} of {_num(t.legacy_orders)} legacy orders",
            _rate_class(cov, report.min_order_coverage),
        ),
        (
            "Ticket match rate",
            pct(rate),
            f"min {pct(report.min_ticket_match_rate)} · "
            f"{_num(t.matching)} of {_num(t.compared)} tickets",
            _rate_class(rate, report.min_ticket_match_rate),
        ),
        ("Tickets compared", _num(t.compared), f"{_num(t.mismatched)} mismatched", "plain"),
        (
            "Excluded",
            _num(t.excluded),
            " · ".join(f"{e.value.replace('_', ' ')} {_num(t.count(e))}" for e in Exclusion),
            "plain",
        ),
        (
            "Drift only",
            _num(t.drift_only),
            f"{_num(t.drift_orders)} orders placed after the legacy lookup",
            "plain",
        ),
    ]
    out = ['<div class="cards">']
    for label, value, sub, tone in cards:
        out.append(
            f'<div class="card {tone}"><div class="label">{escape(label)}</div>'
            f'<div class="value">{escape(value)}</div><div class="sub">{escape(sub)}</div></div>'
        )
    out.append("</div>")
    return "".join(out)


def _chart(report: ParityReport) -> str:
    """Inline SVG: coverage and match rate per day as lines, tickets compared as bars."""
    days = report.days
    if not any(d.tally.compared for d in days):
        return '<p class="muted">No day of the window had a ticket to compare.</p>'
    width, height = 960, 300
    left, right, top, bottom = 56, 16, 16, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [
        v
        for d in days
        for v in (d.tally.order_coverage, d.tally.ticket_match_rate)
        if v is not None
    ]
    floor = min([*values, report.min_order_coverage, report.min_ticket_match_rate])
    low, step = _axis(floor)
    span = 1.0 - low
    slot = plot_w / len(days)
    most = max((d.tally.compared for d in days), default=0) or 1

    def x(i: int) -> float:
        return left + slot * (i + 0.5)

    def y(v: float) -> float:
        return top + plot_h * (1.0 - (v - low) / span)

    svg = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="Order coverage and ticket match rate per day">'
    ]
    ticks = round(span / step)
    for k in range(ticks + 1):
        v = low + k * step
        svg.append(
            f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y(v):.1f}" '
            f'y2="{y(v):.1f}"/><text class="axis" x="{left - 6}" y="{y(v) + 4:.1f}" '
            f'text-anchor="end">{v * 100:.{_decimals(step)}f}%</text>'
        )
    for i, d in enumerate(days):
        h = plot_h * 0.35 * d.tally.compared / most
        svg.append(
            f'<rect class="bar" x="{x(i) - slot * 0.3:.1f}" y="{top + plot_h - h:.1f}" '
            f'width="{slot * 0.6:.1f}" height="{h:.1f}"><title>{escape(d.day.isoformat())}: '
            f"{_num(d.tally.compared)} tickets compared, {_num(d.tally.excluded)} excluded"
            "</title></rect>"
        )
    label_every = max(1, math.ceil(len(days) / 14))
    for i, d in enumerate(days):
        if i % label_every == 0 or i == len(days) - 1:
            svg.append(
                f'<text class="axis" x="{x(i):.1f}" y="{height - bottom + 18}" '
                f'text-anchor="middle">{escape(d.day.strftime("%m-%d"))}</text>'
            )
        if d.tally.compared == 0:
            svg.append(
                f'<text class="nodata" x="{x(i):.1f}" y="{top + plot_h - 6}" '
                f'text-anchor="middle">no data</text>'
            )
    for bar, css, name in (
        (report.min_order_coverage, "cov", "coverage bar"),
        (report.min_ticket_match_rate, "rate", "match-rate bar"),
    ):
        svg.append(
            f'<line class="threshold {css}" x1="{left}" x2="{width - right}" '
            f'y1="{y(bar):.1f}" y2="{y(bar):.1f}"><title>{escape(name)} {pct(bar)}</title></line>'
        )
    svg.extend(
        _series(
            days, get=lambda d: d.tally.order_coverage, x=x, y=y, css="cov", name="order coverage"
        )
    )
    svg.extend(
        _series(
            days,
            get=lambda d: d.tally.ticket_match_rate,
            x=x,
            y=y,
            css="rate",
            name="ticket match rate",
        )
    )
    svg.append(
        f'<line class="axisline" x1="{left}" x2="{width - right}" y1="{top + plot_h}" '
        f'y2="{top + plot_h}"/>'
    )
    svg.append("</svg>")
    legend = (
        '<div class="chart-legend"><span class="key cov"></span>order coverage'
        '<span class="key rate"></span>ticket match rate'
        '<span class="key dash"></span>pass bars'
        '<span class="key barkey"></span>tickets compared (relative)</div>'
    )
    return "".join(svg) + legend


def _series(
    days: Sequence[DayResult],
    *,
    get: Callable[[DayResult], float | None],
    x: Callable[[int], float],
    y: Callable[[float], float],
    css: str,
    name: str,
) -> Iterable[str]:
    """A polyline per run of days with data, and a dot per day with a tooltip."""
    runs: list[list[tuple[float, float]]] = [[]]
    dots: list[str] = []
    for i, d in enumerate(days):
        v = get(d)
        if v is None:
            runs.append([])
            continue
        px, py = x(i), y(v)
        runs[-1].append((px, py))
        dots.append(
            f'<circle class="dot {css}" cx="{px:.1f}" cy="{py:.1f}" r="3.5">'
            f"<title>{escape(d.day.isoformat())}: {escape(name)} {pct(v)}</title></circle>"
        )
    for points in runs:
        if len(points) > 1:
            coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            yield f'<polyline class="line {css}" points="{coords}"/>'
    yield from dots


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


def _class_table(t: Tally) -> str:
    rows = []
    for c in TicketClass:
        n = t.count(c)
        share = n / t.compared if t.compared else None
        kind = "match" if c in MATCHING else "mismatch"
        rows.append(
            f'<tr><td><span class="pill {c.value}">{escape(CLASS_LABELS[c])}</span></td>'
            f'<td class="num">{_num(n)}</td><td class="num">{pct(share)}</td>'
            f'<td class="muted">{kind}</td><td>{escape(CLASS_MEANINGS[c])}</td></tr>'
        )
    rows.append(
        f'<tr class="total"><td>Compared</td><td class="num">{_num(t.compared)}</td>'
        f'<td class="num">{pct(1.0 if t.compared else None)}</td><td></td><td></td></tr>'
    )
    return (
        "<table><thead><tr><th>Class</th><th>Tickets</th><th>Share</th><th>Counts as</th>"
        "<th>Meaning</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
    )


def _orders_table(t: Tally) -> str:
    rows = [
        ("Legacy orders", t.legacy_orders, "the denominator of order coverage"),
        ("Matched (in both)", t.matched_orders, "the numerator of order coverage"),
        ("Missing from shadow", t.missing_orders, "legacy has them, enrichq does not"),
        ("Extra in shadow", t.extra_orders, "enrichq has them, legacy does not"),
        ("Drift", t.drift_orders, "enrichq-only orders placed after the legacy lookup"),
    ]
    body = "".join(
        f'<tr><td>{escape(a)}</td><td class="num">{_num(n)}</td>'
        f'<td class="muted">{escape(b)}</td></tr>'
        for a, n, b in rows
    )
    return f"<table><tbody>{body}</tbody></table>"


def _excluded_table(report: ParityReport) -> str:
    t = report.total
    body = "".join(
        f'<tr><td>{escape(EXCLUSION_LABELS[e])}</td><td class="num">{_num(t.count(e))}</td></tr>'
        for e in Exclusion
    )
    note = (
        f'<p class="muted">Tickets created after {_when(report.young_after)} UTC are too young: '
        "the shadow worker may not have processed them yet. Tickets with a queued or leased row "
        "are still being processed.</p>"
    )
    return f"<table><tbody>{body}</tbody></table>{note}"


def _breakdown(
    label: str, rows: Sequence[tuple[str, Tally]], report: ParityReport, *, empty: str
) -> str:
    if not rows:
        return f'<p class="muted">{escape(empty)}.</p>'
    head = "".join(f"<th>{escape(CLASS_LABELS[c])}</th>" for c in TicketClass)
    out = [
        "<div class='scroll'><table><thead><tr>"
        f"<th>{escape(label)}</th><th>Compared</th><th>Excluded</th>{head}"
        "<th>Coverage</th><th>Match rate</th></tr></thead><tbody>"
    ]
    for name, t in rows:
        cells = "".join(
            f'<td class="num{" zero" if t.count(c) == 0 else ""}">{_num(t.count(c))}</td>'
            for c in TicketClass
        )
        cov, rate = t.order_coverage, t.ticket_match_rate
        out.append(
            f"<tr><td>{escape(name)}</td><td class='num'>{_num(t.compared)}</td>"
            f"<td class='num'>{_num(t.excluded)}</td>{cells}"
            f'<td class="num {_rate_class(cov, report.min_order_coverage)}">{pct(cov)}</td>'
            f'<td class="num {_rate_class(rate, report.min_ticket_match_rate)}">{pct(rate)}</td>'
            "</tr>"
        )
    out.append("</tbody></table></div>")
    return "".join(out)


def _legend() -> str:
    return (
        '<p class="legend"><span class="chip missing">&minus; missing</span> legacy has it, '
        'enrichq does not · <span class="chip extra">+ extra</span> enrichq has it, legacy '
        'does not · <span class="chip drift">~ drift</span> placed after the legacy lookup</p>'
    )


def _chips(ids: Sequence[str], css: str, sign: str) -> str:
    shown = "".join(f'<span class="chip {css}">{sign} {escape(i)}</span>' for i in ids[:MAX_CHIPS])
    more = f'<span class="more">+{len(ids) - MAX_CHIPS} more</span>' if len(ids) > MAX_CHIPS else ""
    return shown + more


def _sample_table(sample: Sequence[Mismatch], *, empty: str) -> str:
    if not sample:
        return f'<p class="muted">{escape(empty)}</p>'
    out = [
        "<div class='scroll'><table class='sample'><thead><tr>"
        "<th>Ticket</th><th>Tenant</th><th>Class</th>"
        "<th>Created</th><th>Legacy looked up</th><th>Enrichq enriched</th>"
        "<th>Matched / legacy</th><th>Diff</th></tr></thead><tbody>"
    ]
    for m in sample:
        diff = (
            _chips(m.missing, "missing", "&minus;")
            + _chips(m.extra, "extra", "+")
            + _chips(m.drift, "drift", "~")
        )
        out.append(
            f'<tr><td class="mono">{escape(m.ticket_id)}</td>'
            f"<td>{escape(m.tenant or '(no tenant)')}</td>"
            f'<td><span class="pill {m.ticket_class.value}">'
            f"{escape(CLASS_LABELS[m.ticket_class])}</span></td>"
            f'<td class="when">{_when(m.created_at)}</td>'
            f'<td class="when">{_when(m.legacy_looked_up_at)}</td>'
            f'<td class="when">{_when(m.enriched_at)}</td>'
            f'<td class="num">{_num(m.matched_orders)} / {_num(m.legacy_orders)}</td>'
            f'<td class="diff">{diff or "<span class=muted>—</span>"}</td></tr>'
        )
    out.append("</tbody></table></div>")
    return "".join(out)


def _footer(report: ParityReport) -> str:
    items = [
        ("Legacy table", report.sources.get("legacy", "")),
        ("Shadow table", report.sources.get("shadow", "")),
        ("Tickets table", report.sources.get("tickets", "")),
        ("Drift uses placed_at from", report.sources.get("drift_placed_at", "")),
        ("Measured at", _plain(report.now)),
        ("Too young after", _plain(report.young_after)),
        ("Run id", str(report.run_id)),
    ]
    rows = "".join(f"<dt>{escape(a)}</dt><dd>{escape(b)}</dd>" for a, b in items)
    return (
        f'<footer><h2>How this was computed</h2><dl>{rows}</dl><p class="muted">Each ticket '
        "created in the window is compared by its set of order ids. Order coverage is "
        "|shadow ∩ legacy| / |legacy| over all compared tickets; the ticket match rate is "
        "(exact + drift only) / compared. The run passes when both meet their bars; a window "
        "with nothing to compare never passes.</p></footer>"
    )


def _plain(value: datetime | None) -> str:
    return "—" if value is None else f"{value:%Y-%m-%d %H:%M:%S %Z}"


_CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d0d7de;--bg:#f6f8fa;--good:#1a7f37;
--bad:#cf222e;--warn:#9a6700;--cov:#0969da;--rate:#8250df;--na:#8c959f}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:14px/1.5 -apple-system,BlinkMacSystemFont,"Segoe UI",Helvetica,Arial,sans-serif}
main{max-width:1180px;margin:0 auto;padding:28px 24px 48px}
h1{font-size:24px;margin:0 0 2px}h2{font-size:17px;margin:0 0 12px}
h2 small{font-weight:400;color:var(--muted);font-size:13px;margin-left:8px}
section,footer{background:#fff;border:1px solid var(--line);border-radius:10px;
padding:18px 20px;margin:16px 0}
.top{display:flex;justify-content:space-between;align-items:center;gap:16px}
.muted{color:var(--muted)}
.badge{font-weight:700;letter-spacing:.04em;padding:8px 18px;border-radius:999px;
color:#fff;font-size:15px;white-space:nowrap}
.badge.pass{background:var(--good)}.badge.fail{background:var(--bad)}
.badge.empty{background:var(--na)}
.verdict{margin:14px 0 0;padding:10px 14px;border-radius:8px;border-left:4px solid}
.verdict.pass{background:#dafbe1;border-color:var(--good)}
.verdict.fail{background:#ffebe9;border-color:var(--bad)}
.verdict.empty{background:#eaeef2;border-color:var(--na)}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(200px,1fr));gap:12px;
margin:16px 0}
.card{background:#fff;border:1px solid var(--line);border-radius:10px;padding:14px 16px;
border-top:4px solid var(--line)}
.card.good{border-top-color:var(--good)}.card.bad{border-top-color:var(--bad)}
.card.na{border-top-color:var(--na)}
.card .label{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.05em}
.card .value{font-size:28px;font-weight:600;font-variant-numeric:tabular-nums}
.card.good .value{color:var(--good)}.card.bad .value{color:var(--bad)}
.card .sub{color:var(--muted);font-size:12px}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{padding:6px 10px;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
th{font-size:12px;color:var(--muted);font-weight:600;background:var(--bg)}
tbody tr:nth-child(even){background:#fbfcfd}
td.num{text-align:right;white-space:nowrap}td.zero{color:#afb8c1}
td.good{color:var(--good);font-weight:600}td.bad{color:var(--bad);font-weight:600}
td.na{color:var(--na)}tr.total td{font-weight:600;border-top:2px solid var(--line)}
.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px;
white-space:nowrap}td.when{white-space:nowrap}.scroll{overflow-x:auto}
.pill{display:inline-block;padding:1px 9px;border-radius:999px;font-size:12px;
font-weight:600;white-space:nowrap}
.pill.exact{background:#dafbe1;color:#116329}.pill.drift_only{background:#ddf4ff;color:#0550ae}
.pill.partial{background:#ffebe9;color:#a40e26}
.pill.shadow_missing{background:#ffd8d3;color:#82071e}
.pill.legacy_missing{background:#fff8c5;color:#7d4e00}
.pill.extra_only{background:#fbefff;color:#6e40c9}
.chip{display:inline-block;margin:1px 4px 1px 0;padding:0 6px;border-radius:4px;
font:12px/1.7 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:nowrap}
.chip.missing{background:#ffebe9;color:#a40e26}.chip.extra{background:#fff8c5;color:#7d4e00}
.chip.drift{background:#eaeef2;color:#57606a}.more{color:var(--muted);font-size:12px}
td.diff{max-width:420px}.legend{font-size:12px;color:var(--muted);margin:0 0 10px}
.chart{width:100%;height:auto;display:block}
.chart .grid{stroke:#eaeef2}.chart .axisline{stroke:var(--line)}
.chart .axis{fill:var(--muted);font-size:11px}
.chart .nodata{fill:var(--na);font-size:10px}
.chart .bar{fill:#eaeef2}
.chart .line{fill:none;stroke-width:2}.chart .line.cov{stroke:var(--cov)}
.chart .line.rate{stroke:var(--rate)}
.chart .dot.cov{fill:var(--cov)}.chart .dot.rate{fill:var(--rate)}
.chart .threshold{stroke-width:1.5;stroke-dasharray:6 4}
.chart .threshold.cov{stroke:var(--cov);opacity:.55}
.chart .threshold.rate{stroke:var(--rate);opacity:.55}
.chart-legend{font-size:12px;color:var(--muted);margin-top:6px}
.chart-legend .key{display:inline-block;width:18px;height:3px;margin:0 6px 3px 14px;
vertical-align:middle}
.chart-legend .key.cov{background:var(--cov)}.chart-legend .key.rate{background:var(--rate)}
.chart-legend .key.dash{background:repeating-linear-gradient(90deg,#8c959f 0 5px,
transparent 5px 8px)}
.chart-legend .key.barkey{background:#eaeef2;height:10px}
footer dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:0 0 10px}
footer dt{color:var(--muted)}footer dd{margin:0}
"""
