"""The cutover's pure core: the gate's refusals, read from a parity run and the coverage
consumers can read now, and the plan of steps from one view state to the next."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from enrichq_parity.cutover import (
    Action,
    Bars,
    CutoverRefused,
    GateRun,
    ViewMode,
    ViewState,
    gate,
    plan,
)
from enrichq_parity.model import Approval, Coverage, Tally, TenantCoverage, Thresholds

BARS = Thresholds(0.995, 0.005, 0.99)
GOOD = Tally(exact=100, legacy_orders=300, matched_orders=300)
NOW = datetime(2024, 3, 10, tzinfo=UTC)


IN_FORCE = Bars(BARS, 24, 7)


def gate_run(
    *,
    tenants: Mapping[str, Tally] | None = None,
    age: timedelta = timedelta(hours=1),
    approved: bool = True,
    thresholds: Thresholds | None = BARS,
) -> GateRun:
    per_tenant = dict(tenants if tenants is not None else {"acme": GOOD, "globex": GOOD})
    return GateRun(
        id=7,
        finished_at=NOW - age,
        thresholds=thresholds,
        total=sum(per_tenant.values(), Tally()),
        tenants=per_tenant,
        approvals=(Approval(7, "alice", NOW - age / 2),) if approved else (),
        window_since=NOW - age - timedelta(days=7),
        window_until=NOW - age,
        data_at=NOW - age,
        coverage=Coverage(()),
    )


FAULTY = Tally(exact=90, partial=10, legacy_orders=300, matched_orders=290)


UNACCEPTED = Tally(exact=95, legacy_missing=3, extra_only=2, legacy_orders=300, matched_orders=300)


@pytest.mark.parametrize(
    ("run", "tenants", "refusals"),
    [
        (None, None, ["no finished parity run: run `enrichq parity` first"]),
        (
            gate_run(tenants={"acme": FAULTY}),
            None,
            ["parity run #7 did not pass for tenant acme (order coverage 96.67% is below "
             "99.50%; shadow fault rate 10.00% is above 0.50% (partial 10))"],
        ),
        (
            gate_run(tenants={"acme": GOOD, "globex": FAULTY}),
            ["globex"],
            ["parity run #7 did not pass for tenant globex (order coverage 96.67% is below "
             "99.50%; shadow fault rate 10.00% is above 0.50% (partial 10))"],
        ),
        (
            gate_run(tenants={"acme": GOOD, "globex": UNACCEPTED}),
            ["globex"],
            ["parity run #7 has 5 legacy-fault tickets for tenant globex that no accepted rule "
             "covers: accept them (`enrichq parity --accept FILE`) and run parity again"],
        ),
        (
            gate_run(),
            ["initech"],
            ["parity run #7 has no tickets of tenant initech: nothing to judge"],
        ),
        (
            gate_run(age=timedelta(hours=24)),
            ["acme"],
            ["parity run #7 judged tickets created up to 2024-03-09 00:00 UTC, 24.0 h ago, "
             "older than ENRICHQ_PARITY_MAX_AGE_HOURS (24): run `enrichq parity` again",
             "parity run #7 read data as of 2024-03-09 00:00 UTC, 24.0 h old, older than "
             "ENRICHQ_PARITY_MAX_AGE_HOURS (24): run `enrichq parity` on a replica that is "
             "replaying (or on the primary)"],
        ),
        (
            gate_run(approved=False),
            ["acme"],
            ["parity run #7 is not approved: review its report, then "
             "`enrichq parity approve 7 --by NAME`"],
        ),
        (
            gate_run(thresholds=None),
            ["acme"],
            ["parity run #7 was recorded before verdicts by fault: run `enrichq parity` again"],
        ),
    ],
    ids=[
        "no run", "failed", "tenant failed", "tenant has unaccepted legacy faults",
        "tenant not in the run", "stale", "not approved", "before verdicts by fault",
    ],
)  # fmt: skip
def test_the_gate_says_what_is_missing(
    run: GateRun | None, tenants: list[str] | None, refusals: list[str]
) -> None:
    assert gate(run, NOW, IN_FORCE, tenants) == refusals


SEEN = Coverage((TenantCoverage("acme", 10, 0, 10, 20), TenantCoverage("globex", 5, 0, 5, 5)))


@pytest.mark.parametrize(
    ("run", "tenants", "live", "refusals"),
    [
        (
            replace(gate_run(), coverage=None),
            ["acme"],
            SEEN,
            ["parity run #7 was recorded before runs counted every ticket consumers can read: "
             "run `enrichq parity` again"],
        ),
        (
            replace(gate_run(), window_since=NOW - timedelta(days=1, hours=1)),
            ["acme"],
            SEEN,
            ["parity run #7 covers 1.0 days, shorter than ENRICHQ_PARITY_WINDOW_DAYS (7): run "
             "`enrichq parity` over the default window"],
        ),
        (
            replace(gate_run(), data_at=NOW - timedelta(hours=30), replica_lag_seconds=108000),
            ["acme"],
            SEEN,
            ["parity run #7 read data as of 2024-03-08 18:00 UTC, 30.0 h old; it read a standby "
             "108,000 s behind, older than ENRICHQ_PARITY_MAX_AGE_HOURS (24): run `enrichq "
             "parity` on a replica that is replaying (or on the primary)"],
        ),
        (
            replace(gate_run(), coverage=SEEN),
            ["acme"],
            Coverage((TenantCoverage("acme", 12, 2, 10, 20),)),
            ["2 tickets of tenant acme that consumers can read were never enriched by enrichq "
             "(all time, not only the parity window): run `enrichq backfill --tenant acme` and "
             "let the workers drain it"],
        ),
        (
            replace(gate_run(), coverage=SEEN),
            None,
            Coverage(
                (TenantCoverage("acme", 12, 2, 10, 20), TenantCoverage("globex", 6, 1, 5, 5)),
                legacy_only=4,
                legacy_only_not_enriched=3,
            ),
            ["3 tickets that consumers can read were never enriched by enrichq (acme 2, globex "
             "1; all time, not only the parity window): run `enrichq backfill` and let the "
             "workers drain it",
             "3 tickets with legacy rows are missing from the tickets mirror and were never "
             "enriched: a whole cutover would hide them (add them to the mirror and run "
             "`enrichq backfill`, or cut tenants over with --tenant or --exclude-tenant, which "
             "keeps their legacy rows)"],
        ),
        (
            replace(gate_run(), coverage=SEEN),
            ["acme"],
            Coverage((TenantCoverage("acme", 10, 0, 10, 0),)),
            ["enrichq.ticket_orders holds 0 order rows of 10 enriched tickets of tenant acme, "
             "fewer than parity run #7 saw (20 order rows of 10): run `enrichq parity` again"],
        ),
        (
            gate_run(thresholds=Thresholds(0.0, 1.0, 0.0), tenants={"acme": FAULTY}),
            ["acme"],
            SEEN,
            ["parity run #7 did not pass for tenant acme (order coverage 96.67% is below "
             "99.50%; shadow fault rate 10.00% is above 0.50% (partial 10)) by the bars in "
             "force now; it ran with order coverage ≥ 0.00% and shadow fault rate ≤ 100.00%"],
        ),
    ],
    ids=[
        "before coverage", "window too short", "data too old", "never enriched",
        "never enriched, whole, and legacy tickets the mirror lacks", "shadow table emptied",
        "bars in force now",
    ],
)  # fmt: skip
def test_the_gate_checks_what_the_run_read_against_now(
    run: GateRun, tenants: list[str] | None, live: Coverage, refusals: list[str]
) -> None:
    assert gate(run, NOW, IN_FORCE, tenants, live) == refusals


def test_the_gate_names_all_three_when_all_three_are_missing() -> None:
    run = gate_run(tenants={"acme": FAULTY}, age=timedelta(hours=30), approved=False)
    refusals = gate(run, NOW, IN_FORCE, ["acme"])
    assert [r.split(" ")[3] for r in refusals] == ["did", "judged", "read", "is"]
    fresh = gate_run(age=timedelta(hours=23, minutes=59))
    assert gate(fresh, NOW, IN_FORCE, ["acme", "globex"]) == []
    # another tenant's faults do not hold this one back
    faulty = gate_run(tenants={"acme": GOOD, "globex": FAULTY})
    assert gate(faulty, NOW, IN_FORCE, ["acme"]) == []


def test_the_steps_are_a_pure_plan() -> None:
    legacy = ViewState(ViewMode.LEGACY)
    staged = plan(legacy, Action.CUTOVER, ["acme", "globex"])
    assert staged is not None
    assert (staged.target, staged.moved) == (
        ViewState(ViewMode.STAGED, frozenset({"acme", "globex"})), ("acme", "globex"),
    )  # fmt: skip
    assert plan(staged.target, Action.CUTOVER, ["acme"]) is None
    back = plan(staged.target, Action.ROLLBACK, ["acme", "initech"])
    assert back is not None
    assert (back.target, back.moved) == (
        ViewState(ViewMode.STAGED, frozenset({"globex"})),
        ("acme",),
    )
    last = plan(ViewState(ViewMode.STAGED, frozenset({"globex"})), Action.ROLLBACK, ["globex"])
    assert last is not None
    assert last.target == legacy
    whole = plan(staged.target, Action.CUTOVER, None)
    assert whole is not None
    assert (whole.target, whole.moved) == (ViewState(ViewMode.SHADOW), None)
    assert plan(ViewState(ViewMode.SHADOW), Action.CUTOVER, ["acme"]) is None
    assert plan(legacy, Action.ROLLBACK, None) is None
    assert plan(legacy, Action.ROLLBACK, ["acme"]) is None
    with pytest.raises(CutoverRefused, match="a whole cutover"):
        plan(ViewState(ViewMode.SHADOW), Action.ROLLBACK, ["acme"])
