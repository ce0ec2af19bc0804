"""The review of parity runs: a reviewer's approval, the list of runs, a stored run's
report."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from enrichq_parity.errors import ParityError
from enrichq_parity.model import (
    Approval,
    ParityReport,
    Tally,
    Thresholds,
    Verdict,
    decide,
    failing_tenants,
)
from enrichq_schema.db import as_record
from enrichq_schema.queries import Queries, load
from enrichq_schema.tables import APPROVAL_NOTE_MAX_LENGTH, APPROVER_MAX_LENGTH

if TYPE_CHECKING:
    pass

RUNS_LIMIT_DEFAULT = 20


class ReviewInputError(ParityError):
    """The review command's input is wrong (an unknown run, a bad name)."""


class ParityRefused(ParityError):
    """A review or cutover command refused (exit 1); its other errors are bad input (exit 2)."""


class ApprovalRefused(ParityRefused):
    """This run cannot be approved."""


def _queries() -> Queries:
    return load("enrichq_parity", "sql/review.sql")


def verdict_of(
    total: Mapping[str, Any] | None,
    *,
    min_order_coverage: float,
    max_shadow_fault_rate: float | None,
    min_ticket_match_rate: float,
) -> Verdict | None:
    """A stored run's verdict, decided again from its counts; None for a run recorded before
    verdicts by fault (it has no shadow fault bar)."""
    if max_shadow_fault_rate is None or total is None:
        return None
    thresholds = Thresholds(min_order_coverage, max_shadow_fault_rate, min_ticket_match_rate)
    return decide(Tally.from_dict(total), thresholds)


def check_name(value: str, option: str) -> str:
    """A reviewer's or actor's name: 1 to APPROVER_MAX_LENGTH printable characters."""
    name = value.strip()
    if not name or len(name) > APPROVER_MAX_LENGTH or not name.isprintable():
        raise ReviewInputError(f"{option} must be 1 to {APPROVER_MAX_LENGTH} printable characters")
    return name


@dataclass(frozen=True, slots=True)
class Approved:
    """What an approval did (changed=False: this reviewer had approved the run already)."""

    approval: Approval
    changed: bool
    notes: tuple[str, ...]
    failing: tuple[str, ...] = ()
    """The tenants that fail on their own figures, each with why: a whole cutover refuses
    them (shown before the signature)."""


def approve(
    conn: sa.Connection,
    run_id: int,
    *,
    by: str,
    note: str | None,
    now: datetime | None = None,
) -> Approved:
    """Record `by`'s approval of run `run_id`; the caller commits.

    ReviewInputError: no such run. ApprovalRefused: it did not finish, or did not pass.
    """
    q = _queries()
    who = check_name(by, "--by")
    text = None if note is None else note.strip() or None
    if text is not None and (len(text) > APPROVAL_NOTE_MAX_LENGTH or not _printable(text)):
        raise ReviewInputError(
            f"--note must be at most {APPROVAL_NOTE_MAX_LENGTH} printable characters"
        )
    run = conn.execute(q("review_run_for_approval"), {"id": run_id}).first()
    if run is None:
        raise ReviewInputError(f"there is no parity run #{run_id}")
    if run.finished_at is None:
        why = f" (it failed: {run.error})" if run.error else " (it is still running)"
        raise ApprovalRefused(f"parity run #{run_id} did not finish{why}: nothing to approve")
    verdict = verdict_of(
        run.total,
        min_order_coverage=run.min_order_coverage,
        max_shadow_fault_rate=run.max_shadow_fault_rate,
        min_ticket_match_rate=run.min_ticket_match_rate,
    )
    if verdict is None:
        raise ApprovalRefused(
            f"parity run #{run_id} was recorded before verdicts by fault: run `enrichq parity` "
            "again and approve that run"
        )
    if not verdict.passed:
        raise ApprovalRefused(
            f"parity run #{run_id} did not pass ({verdict.reason}): a failing run cannot be "
            "approved"
        )
    inserted = conn.execute(
        q("review_approve"),
        {
            "run_id": run_id,
            "approved_by": who,
            "reviewer_key": who.casefold(),
            "note": text,
            "now": now,
        },
    ).first()
    notes: list[str] = []
    if not verdict.ready:
        unaccepted = Tally.from_dict(run.total).unaccepted_legacy_faults
        notes.append(
            f"{unaccepted:,} legacy-fault tickets of this run have no accepted rule: cutover "
            "refuses the tenants they belong to"
        )
    failing = tuple(
        f"tenant {tenant or '(no tenant)'} fails on its own figures ({v.reason}): a whole "
        f"cutover refuses it; move the others with `enrichq cutover --exclude-tenant "
        f"{tenant or chr(39) * 2}` or `--tenant T`"
        for tenant, v in failing_tenants(
            {t["tenant"]: Tally.from_dict(t) for t in run.tenants or ()},
            Thresholds(
                run.min_order_coverage, run.max_shadow_fault_rate, run.min_ticket_match_rate
            ),
        ).items()
        if not v.passed
    )
    latest = conn.execute(q("review_latest_finished")).scalar_one_or_none()
    if latest is not None and latest != run_id:
        notes.append(f"cutover judges the latest finished run, #{latest}, not this one")
    if inserted is None:
        row = conn.execute(
            q("review_approval_by"), {"run_id": run_id, "reviewer_key": who.casefold()}
        ).one()
        existing = Approval(run_id, row.approved_by, row.approved_at, row.note)
        return Approved(existing, False, tuple(notes), failing)
    return Approved(Approval(run_id, who, inserted.approved_at, text), True, tuple(notes), failing)


def approvals_of(conn: sa.Connection, run_ids: Iterable[int]) -> dict[int, tuple[Approval, ...]]:
    """The approvals of each run, oldest first (a run without one maps to ())."""
    ids = sorted(set(run_ids))
    out: dict[int, list[Approval]] = {i: [] for i in ids}
    for row in conn.execute(_queries()("review_approvals"), {"run_ids": ids}):
        out[row.parity_run_id].append(
            Approval(row.parity_run_id, row.approved_by, row.approved_at, row.note)
        )
    return {i: tuple(a) for i, a in out.items()}


@dataclass(frozen=True, slots=True)
class RunRow:
    """One recorded run as `enrichq parity runs` lists it."""

    id: int
    started_at: datetime
    finished_at: datetime | None
    window_since: datetime
    window_until: datetime
    state: str
    reason: str
    tickets_compared: int
    order_coverage: float | None
    shadow_fault_rate: float | None
    legacy_faults: int
    accepted_legacy_faults: int
    accept_rules: int
    unused_rules: int
    accept_sha256: str | None
    approvals: tuple[Approval, ...]

    def as_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return {
            "id": self.id,
            "started_at": self.started_at.isoformat(),
            "finished_at": None if self.finished_at is None else self.finished_at.isoformat(),
            "window": {
                "since": self.window_since.isoformat(),
                "until": self.window_until.isoformat(),
            },
            "state": self.state,
            "verdict": self.reason,
            "tickets_compared": self.tickets_compared,
            "order_coverage": self.order_coverage,
            "shadow_fault_rate": self.shadow_fault_rate,
            "legacy_faults": self.legacy_faults,
            "accepted_legacy_faults": self.accepted_legacy_faults,
            "accept_rules": self.accept_rules,
            "unused_rules": self.unused_rules,
            "accept_sha256": self.accept_sha256,
            "approvals": [a.as_dict() for a in self.approvals],
        }


def list_runs(conn: sa.Connection, limit: int = RUNS_LIMIT_DEFAULT) -> list[RunRow]:
    """The `limit` most recent runs, newest first, with their verdicts and approvals."""
    rows = conn.execute(_queries()("review_runs"), {"limit": limit}).all()
    approvals = approvals_of(conn, [r.id for r in rows])
    out = []
    for r in rows:
        verdict = verdict_of(
            r.total,
            min_order_coverage=r.min_order_coverage,
            max_shadow_fault_rate=r.max_shadow_fault_rate,
            min_ticket_match_rate=r.min_ticket_match_rate,
        )
        if r.finished_at is None:
            state, reason = ("error", r.error) if r.error else ("running", "not finished")
        elif verdict is None:
            state, reason = "old", "recorded before verdicts by fault"
        else:
            state, reason = verdict.state, verdict.reason
        signed = approvals[r.id]
        unused = int(r.unused_rules)
        out.append(
            as_record(RunRow, r, state=state, reason=reason, unused_rules=unused, approvals=signed)
        )
    return out


def load_report(conn: sa.Connection, run_id: int) -> tuple[ParityReport, tuple[Approval, ...]]:
    """A finished run's stored report and its approvals (ReviewInputError: no such report)."""
    row = conn.execute(_queries()("review_report"), {"id": run_id}).first()
    if row is None:
        raise ReviewInputError(f"there is no parity run #{run_id}")
    if row.finished_at is None:
        raise ReviewInputError(f"parity run #{run_id} did not finish: it has no report")
    try:
        report = ParityReport.from_dict(row.report)
    except (KeyError, TypeError, ValueError):
        raise ReviewInputError(
            f"parity run #{run_id} was recorded before verdicts by fault: its report cannot be "
            "shown again (run `enrichq parity`)"
        ) from None
    return report, approvals_of(conn, [run_id])[run_id]


def _printable(text: str) -> bool:
    return text.replace("\n", " ").replace("\t", " ").isprintable()
