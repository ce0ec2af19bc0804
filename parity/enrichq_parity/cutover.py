"""Cutover: move consumers from the legacy table to the shadow table, whole or per tenant,
gated on an approved, fresh, passing parity run; rollback is never gated."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from enrichq_parity.errors import ParityError
from enrichq_parity.model import (
    Approval,
    Coverage,
    Tally,
    Thresholds,
    decide,
    pct,
    plural,
)
from enrichq_parity.review import ParityRefused, approvals_of
from enrichq_schema.identifiers import qualified, relation_exists, render
from enrichq_schema.queries import Queries, load
from enrichq_schema.tables import PUBLIC_SCHEMA

if TYPE_CHECKING:
    from enrichq_schema.settings import Settings

VIEW = f"{PUBLIC_SCHEMA}.ticket_orders"
STAGED_TENANTS = f"{PUBLIC_SCHEMA}.cutover_tenants"
SHADOW_TABLE = "enrichq.ticket_orders"
# A swap of the view waits for its readers this long per try, and readers arriving meanwhile
# queue behind it that long at most; then it lets them go and tries again (`repoint_waiting`).
LOCK_TIMEOUT = "200ms"
# Tries go on this long by default (`enrichq cutover --wait`).
WAIT_SECONDS_DEFAULT = 60.0
LOCK_NOT_AVAILABLE = "55P03"


class CutoverError(ParityError):
    """Cutover cannot run on this database."""


class CutoverRefused(ParityRefused):
    """The cutover is refused (the parity gate, or a step that does not apply)."""


class Action(StrEnum):
    """Towards enrichq's rows, or back to the legacy rows."""

    CUTOVER = "cutover"
    ROLLBACK = "rollback"


@dataclass(frozen=True, slots=True)
class CutoverStep:
    """One step: the state it leads to, and the tenants it moves (None: every tenant)."""

    target: ViewState
    moved: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class ViewState:
    """The view's mode and, when staged, the tenants that read enrichq's rows."""

    mode: ViewMode
    tenants: frozenset[str] = frozenset()

    def reads_shadow(self, tenant: str) -> bool:
        """Whether consumers see enrichq's rows for this tenant's tickets."""
        return self.mode is ViewMode.SHADOW or (
            self.mode is ViewMode.STAGED and tenant in self.tenants
        )


class ViewMode(StrEnum):
    """What the consumer view reads."""

    LEGACY = "legacy"
    STAGED = "staged"
    SHADOW = "shadow"


def plan(current: ViewState, action: Action, tenants: Sequence[str] | None) -> CutoverStep | None:
    """The step that `action` on `tenants` (None: every tenant) takes from `current`.

    None: nothing to do (already there). CutoverRefused: a tenant cannot move back from a
    whole cutover (there is no list of the tenants that would stay).
    """
    if tenants is None:
        target = ViewMode.SHADOW if action is Action.CUTOVER else ViewMode.LEGACY
        if current.mode is target and not current.tenants:
            return None
        return CutoverStep(ViewState(target), None)
    asked = frozenset(tenants)
    if action is Action.CUTOVER:
        if current.mode is ViewMode.SHADOW:
            return None
        moved = tuple(sorted(asked - current.tenants))
        if not moved:
            return None
        return CutoverStep(ViewState(ViewMode.STAGED, current.tenants | asked), moved)
    if current.mode is ViewMode.SHADOW:
        raise CutoverRefused(
            f"every tenant reads {SHADOW_TABLE} (a whole cutover): roll every tenant back with "
            "`enrichq cutover --rollback`, then cut tenants over one by one"
        )
    moved = tuple(sorted(asked & current.tenants))
    if not moved:
        return None
    remaining = current.tenants - asked
    return CutoverStep(
        ViewState(ViewMode.STAGED, remaining) if remaining else ViewState(ViewMode.LEGACY), moved
    )


@dataclass(frozen=True, slots=True)
class GateRun:
    """The latest finished parity run, as the gate sees it.

    `thresholds` is None for a run recorded before verdicts by fault; `coverage` and
    `data_at` are None for a run recorded before runs kept what they read.
    """

    id: int
    finished_at: datetime
    thresholds: Thresholds | None
    total: Tally
    tenants: Mapping[str, Tally]
    approvals: tuple[Approval, ...]
    window_since: datetime | None = None
    window_until: datetime | None = None
    data_at: datetime | None = None
    replica_lag_seconds: float | None = None
    coverage: Coverage | None = None


@dataclass(frozen=True, slots=True)
class Bars:
    """What the gate holds a run to: the settings in force at cutover time."""

    thresholds: Thresholds
    max_age_hours: float
    window_days: float

    @classmethod
    def of(cls, settings: Settings) -> Bars:
        """The bars of these settings."""
        return cls(
            Thresholds(
                settings.parity_min_order_coverage,
                settings.parity_max_shadow_fault_rate,
                settings.parity_min_ticket_match_rate,
            ),
            settings.parity_max_age_hours,
            settings.parity_window_days,
        )


def gate(
    run: GateRun | None,
    now: datetime,
    bars: Bars,
    tenants: Sequence[str] | None,
    live: Coverage | None = None,
    *,
    excluding: bool = False,
) -> list[str]:
    """What keeps a cutover of `tenants` (None: every tenant) from happening; [] allows it.

    `excluding`: `tenants` are every tenant known but some excluded ones, judged like a
    whole cutover: each tenant of the run on its own figures, a tenant without a ticket in
    the window on its coverage alone.

    What cutover needs of the latest finished run, each said when missing: it passes by the
    bars in force now (each tenant on its own figures, every legacy fault accepted), it is
    fresh (its window ends, and its data is, within the age bound; it covers at least the
    configured window), a reviewer approved it, and (`live`: counted now) no ticket
    consumers can read is still never enriched and the shadow table holds what it saw.
    """
    if run is None:
        return ["no finished parity run: run `enrichq parity` first"]
    missing: list[str] = []
    if run.thresholds is None:
        missing.append(
            f"parity run #{run.id} was recorded before verdicts by fault: run `enrichq parity` "
            "again"
        )
    else:
        # a whole cutover: every tenant of the run on its own figures, as if moved alone
        judged: list[str | None] = list(
            sorted(run.tenants)
            if tenants is None
            else [t for t in tenants if t in run.tenants]
            if excluding
            else tenants
        )
        for tenant in judged or [None]:
            missing.extend(_passing(run, run.thresholds, bars.thresholds, tenant))
    missing.extend(_fresh(run, now, bars))
    if not run.approvals:
        missing.append(
            f"parity run #{run.id} is not approved: review its report, then "
            f"`enrichq parity approve {run.id} --by NAME`"
        )
    if run.coverage is None:
        missing.append(
            f"parity run #{run.id} was recorded before runs counted every ticket consumers can "
            "read: run `enrichq parity` again"
        )
    elif live is not None:
        missing.extend(_covered(run, run.coverage, live, tenants))
    return missing


def _fresh(run: GateRun, now: datetime, bars: Bars) -> list[str]:
    """Why the run is not fresh: its window ends too long ago, is too short, or its data
    (a standby's last replayed commit) is too old; [] when it is fresh."""
    bound = timedelta(hours=bars.max_age_hours)
    out: list[str] = []
    ended = run.window_until or run.finished_at
    if now - ended >= bound:
        out.append(
            f"parity run #{run.id} judged tickets created up to {ended:%Y-%m-%d %H:%M} UTC, "
            f"{_hours(now - ended)} h ago, older than ENRICHQ_PARITY_MAX_AGE_HOURS "
            f"({bars.max_age_hours:g}): run `enrichq parity` again"
        )
    if run.window_since is not None and run.window_until is not None:
        length = run.window_until - run.window_since
        if length < timedelta(days=bars.window_days) - timedelta(seconds=1):
            out.append(
                f"parity run #{run.id} covers {length.total_seconds() / 86400:.1f} days, "
                f"shorter than ENRICHQ_PARITY_WINDOW_DAYS ({bars.window_days:g}): run "
                "`enrichq parity` over the default window"
            )
    if run.data_at is not None and now - run.data_at >= bound:
        lag = (
            ""
            if run.replica_lag_seconds is None
            else f"; it read a standby {run.replica_lag_seconds:,.0f} s behind"
        )
        out.append(
            f"parity run #{run.id} read data as of {run.data_at:%Y-%m-%d %H:%M} UTC, "
            f"{_hours(now - run.data_at)} h old{lag}, older than ENRICHQ_PARITY_MAX_AGE_HOURS "
            f"({bars.max_age_hours:g}): run `enrichq parity` on a replica that is replaying "
            "(or on the primary)"
        )
    return out


def _hours(age: timedelta) -> str:
    return f"{age.total_seconds() / 3600:.1f}"


def _covered(
    run: GateRun, seen: Coverage, live: Coverage, tenants: Sequence[str] | None
) -> list[str]:
    """Why consumers would lose rows they read now: tickets never enriched, counted now, and
    a shadow table that holds less than the run saw; [] when neither."""
    every = sorted({t.tenant for t in live.tenants} | {t.tenant for t in seen.tenants})
    scope = every if tenants is None else list(tenants)
    out: list[str] = []
    never = {t: live.of(t).not_enriched for t in scope if live.of(t).not_enriched}
    if never:
        if tenants is not None and len(scope) == 1:
            (tenant,) = scope
            out.append(
                f"{plural(never[tenant], 'ticket')} of tenant {tenant_name(tenant)} that consumers "
                "can read were never enriched by enrichq (all time, not only the parity "
                f"window): run `enrichq backfill --tenant {tenant_name(tenant)}` and let the "
                "workers drain it"
            )
        else:
            which = ", ".join(f"{tenant_name(t)} {n:,}" for t, n in never.items())
            out.append(
                f"{plural(sum(never.values()), 'ticket')} that consumers can read were never "
                f"enriched by enrichq ({which}; all time, not only the parity window): run "
                "`enrichq backfill` and let the workers drain it"
            )
    if tenants is None and live.legacy_only_not_enriched:
        out.append(
            f"{plural(live.legacy_only_not_enriched, 'ticket')} with legacy rows are missing "
            "from the tickets mirror and were never enriched: a whole cutover would hide "
            "them (add them to the mirror and run `enrichq backfill`, or cut tenants over "
            "with --tenant or --exclude-tenant, which keeps their legacy rows)"
        )
    for tenant in scope:
        then, now_ = seen.of(tenant), live.of(tenant)
        if now_.enriched < then.enriched or now_.shadow_orders < then.shadow_orders:
            out.append(
                f"{SHADOW_TABLE} holds {now_.shadow_orders:,} order rows of "
                f"{plural(now_.enriched, 'enriched ticket')} of tenant {tenant_name(tenant)}, "
                f"fewer than parity run #{run.id} saw ({then.shadow_orders:,} order rows of "
                f"{then.enriched:,}): run `enrichq parity` again"
            )
    return out


def _passing(run: GateRun, own: Thresholds, bars: Thresholds, tenant: str | None) -> list[str]:
    """Why the run does not pass for `tenant` (None: over every ticket) by the bars in force
    now; [] when it does."""
    tally = run.total if tenant is None else run.tenants.get(tenant)
    who = "" if tenant is None else f" for tenant {tenant_name(tenant)}"
    if tally is None:
        return [
            f"parity run #{run.id} has no tickets of tenant {tenant_name(tenant)}: nothing to judge"
        ]
    verdict = decide(tally, bars)
    if not verdict.passed:
        return [f"parity run #{run.id} did not pass{who} ({verdict.reason}){_bars_then(own, bars)}"]
    if not verdict.ready:
        return [
            f"parity run #{run.id} has "
            f"{plural(tally.unaccepted_legacy_faults, 'legacy-fault ticket')}{who} that no "
            "accepted rule covers: accept them (`enrichq parity --accept FILE`) and run parity "
            "again"
        ]
    return []


def _bars_then(own: Thresholds, bars: Thresholds) -> str:
    """The run's own bars, when they are not the ones in force now."""
    if (own.min_order_coverage, own.max_shadow_fault_rate) == (
        bars.min_order_coverage,
        bars.max_shadow_fault_rate,
    ):
        return ""
    return (
        f" by the bars in force now; it ran with order coverage ≥ "
        f"{pct(own.min_order_coverage)} and shadow fault rate ≤ "
        f"{pct(own.max_shadow_fault_rate)}"
    )


@dataclass(frozen=True, slots=True)
class CutoverResult:
    """What a cutover or rollback did: the events it recorded (none: it was there already)."""

    action: Action
    state: ViewState
    event_ids: tuple[int, ...]
    parity_run_id: int | None
    message: str

    @property
    def changed(self) -> bool:
        """Whether it moved anything (a step records one event per tenant moved, or one)."""
        return bool(self.event_ids)


def _queries() -> Queries:
    return load("enrichq_parity", "sql/cutover.sql")


def ensure_view(conn: sa.Connection, settings: Settings) -> ViewState:
    """Create the consumer view on the legacy table if it is missing; what it reads now."""
    q = _queries()
    conn.execute(q("cutover_lock"))
    if not relation_exists(conn, VIEW):
        present = conn.execute(q("cutover_schema_exists"), {"name": PUBLIC_SCHEMA}).scalar_one()
        if not present:
            raise CutoverError(f"schema {PUBLIC_SCHEMA} does not exist (run `enrichq migrate`)")
        _point(conn, ViewMode.LEGACY, settings)
    return view_state(conn, settings)


def view_state(conn: sa.Connection, settings: Settings) -> ViewState:
    """What the view reads now (legacy when it does not exist yet)."""
    sources = set(_sources(conn))
    if not sources or sources == {settings.legacy_table}:
        return ViewState(ViewMode.LEGACY)
    if STAGED_TENANTS in sources:
        tenants = conn.execute(_queries()("cutover_staged_tenants")).scalars().all()
        return ViewState(ViewMode.STAGED, frozenset(tenants))
    if sources == {SHADOW_TABLE}:
        return ViewState(ViewMode.SHADOW)
    # Someone pointed it elsewhere by hand: the next step repoints it as enrichq would.
    return ViewState(ViewMode.LEGACY if SHADOW_TABLE not in sources else ViewMode.SHADOW)


def repoint(
    conn: sa.Connection,
    settings: Settings,
    *,
    action: Action,
    tenants: Sequence[str] | None,
    actor: str,
    now: datetime | None = None,
    exclude: Sequence[str] = (),
) -> CutoverResult:
    """Move `tenants` (None: every tenant but those in `exclude`) towards enrichq's rows or
    back, in the caller's transaction: gate (towards enrichq only), record one event per
    tenant moved, then change the staged set and, when the mode changes, the view.
    CutoverRefused: the gate said no."""
    q = _queries()
    conn.execute(q("cutover_lock"))
    conn.execute(q("cutover_lock_timeout"), {"timeout": LOCK_TIMEOUT})
    current = ensure_view(conn, settings)
    at: datetime = conn.execute(q("cutover_now"), {"now": now}).scalar_one()
    run = _gate_run(conn)
    live = None
    if action is Action.CUTOVER:
        whole = tenants is None and not exclude
        live = live_coverage(conn, settings, at, legacy_only=whole)
        if exclude:
            # every tenant known but the excluded ones, staged: the others stay on legacy
            if tenants is not None:
                raise CutoverRefused("--exclude-tenant goes with a whole cutover, not --tenant")
            known = {t.tenant for t in live.tenants} | set(current.tenants)
            known |= set(run.tenants) if run is not None else set()
            tenants = sorted(known - set(exclude))
            if not tenants:
                raise CutoverRefused("every tenant is excluded: nothing to move")
    step = plan(current, action, tenants)
    if step is None:
        return CutoverResult(action, current, (), None, _unchanged(action, tenants))
    if action is Action.CUTOVER:
        refusals = gate(run, at, Bars.of(settings), step.moved, live, excluding=bool(exclude))
        if refusals:
            raise CutoverRefused("; ".join(refusals))
    run_id = None if run is None else run.id
    target_table = SHADOW_TABLE if action is Action.CUTOVER else settings.legacy_table
    was = _describe(current, settings)
    events = tuple(
        _record(
            conn,
            action=action,
            target=target_table,
            parity_run_id=run_id,
            actor=actor,
            now=now,
            note=f"was: {was}",
            tenant=tenant,
        )
        for tenant in (step.moved if step.moved is not None else [None])
    )
    _apply(conn, settings, current, step, events)
    return CutoverResult(
        action,
        step.target,
        events,
        run_id,
        _moved(action, step, settings=settings, run=run, at=at, events=events, actor=actor),
    )


def repoint_waiting(
    engine: sa.Engine,
    settings: Settings,
    *,
    action: Action,
    tenants: Sequence[str] | None,
    actor: str,
    exclude: Sequence[str] = (),
    wait_seconds: float = WAIT_SECONDS_DEFAULT,
    on_retry: Callable[[int], None] | None = None,
    rng: random.Random | None = None,
) -> CutoverResult:
    """`repoint` in a transaction of its own, tried again while a reader holds the view.

    Each try waits LOCK_TIMEOUT for the view's lock, so a reader that arrives while the swap
    waits is held up that long at most; between tries (a jittered, growing pause, up to a
    second) readers run freely. After `wait_seconds` the lock error is raised.
    `on_retry(tries)` is called before each pause (to tell an operator why it waits).
    """
    rng = rng or random.Random()  # noqa: S311  # jitter, not cryptography
    deadline = time.monotonic() + wait_seconds
    tries = 0
    while True:
        tries += 1
        try:
            with engine.begin() as conn:
                return repoint(
                    conn, settings, action=action, tenants=tenants, actor=actor, exclude=exclude
                )
        except sa.exc.OperationalError as exc:
            if not lock_not_available(exc) or time.monotonic() >= deadline:
                raise
        if on_retry is not None:
            on_retry(tries)
        pause = min(1.0, 0.05 * 2 ** min(tries, 5)) * (0.5 + rng.random() / 2)
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))


def lock_not_available(exc: sa.exc.OperationalError) -> bool:
    """Whether the statement gave up waiting for a lock (its lock_timeout passed)."""
    return getattr(exc.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE


def _apply(
    conn: sa.Connection,
    settings: Settings,
    current: ViewState,
    step: CutoverStep,
    events: Sequence[int],
) -> None:
    """Change the staged set and, if the mode changes, the view (same transaction)."""
    q = _queries()
    target = step.target
    if target.mode is ViewMode.STAGED:
        assert step.moved is not None  # only a per-tenant step stages
        if target.tenants > current.tenants:
            for tenant, event_id in zip(step.moved, events, strict=True):
                conn.execute(q("cutover_stage_tenant"), {"tenant": tenant, "event_id": event_id})
        else:
            conn.execute(q("cutover_unstage_tenants"), {"tenants": list(step.moved)})
    else:
        conn.execute(q("cutover_unstage_all"))
    if target.mode is not current.mode:
        _point(conn, target.mode, settings)


def _point(conn: sa.Connection, mode: ViewMode, settings: Settings) -> None:
    """CREATE OR REPLACE the view for `mode`; a missing table is a one-line error."""
    q = _queries()
    legacy = qualified(conn.dialect, settings.legacy_table)
    if not relation_exists(conn, legacy):
        raise CutoverError(f"table {settings.legacy_table} does not exist (ENRICHQ_LEGACY_TABLE)")
    if mode is ViewMode.LEGACY:
        conn.execute(render(q["cutover_point_view"], source=legacy))
        return
    if not relation_exists(conn, SHADOW_TABLE):
        raise CutoverError(f"table {SHADOW_TABLE} does not exist (run `enrichq migrate`)")
    if mode is ViewMode.SHADOW:
        conn.execute(render(q["cutover_point_view"], source=SHADOW_TABLE))
        return
    tickets = qualified(conn.dialect, settings.tickets_table)
    if not relation_exists(conn, tickets):
        raise CutoverError(
            f"table {settings.tickets_table} does not exist (ENRICHQ_TICKETS_TABLE): a staged "
            "cutover finds each ticket's tenant there"
        )
    conn.execute(render(q["cutover_point_view_staged"], legacy=legacy, tickets=tickets))


def _describe(state: ViewState, settings: Settings) -> str:
    """What consumers read, in words."""
    if state.mode is ViewMode.LEGACY:
        return f"{settings.legacy_table} for every tenant"
    if state.mode is ViewMode.SHADOW:
        return f"{SHADOW_TABLE} for every tenant"
    return (
        f"{SHADOW_TABLE} for {_tenant_list(state.tenants)}, {settings.legacy_table} for the others"
    )


def _unchanged(action: Action, tenants: Sequence[str] | None) -> str:
    side = "enrichq's rows" if action is Action.CUTOVER else "the legacy rows"
    if tenants is None:
        return f"every tenant already reads {side} through {VIEW}; nothing changed"
    verb = "reads" if len(set(tenants)) == 1 else "read"
    return f"{_tenant_list(tenants)} already {verb} {side}; nothing changed"


def _moved(
    action: Action,
    step: CutoverStep,
    *,
    settings: Settings,
    run: GateRun | None,
    at: datetime,
    events: Sequence[int],
    actor: str,
) -> str:
    who = step.moved
    subject = "every tenant" if who is None else _tenant_list(who)
    table = SHADOW_TABLE if action is Action.CUTOVER else settings.legacy_table
    verb = "now read" + ("s" if who is None or len(who) == 1 else "")
    ids = ", ".join(f"#{e}" for e in events)
    record = f"event{'s' if len(events) > 1 else ''} {ids} by {actor}"
    now_reads = f"{VIEW} reads {_describe(step.target, settings)}"
    if action is Action.ROLLBACK:
        return f"{subject} {verb} {table} again; {now_reads}; {record}"
    assert run is not None  # the gate refuses without a run
    age = (at - run.finished_at).total_seconds() / 3600
    approved = ", ".join(a.approved_by for a in run.approvals)
    return (
        f"{subject} {verb} {table}; {now_reads}; parity run #{run.id} passed "
        f"{age:.1f} h ago, approved by {approved}; {record}"
    )


def _tenant_list(tenants: Sequence[str] | frozenset[str]) -> str:
    names_ = sorted(set(tenants))
    label = "tenant" if len(names_) == 1 else "tenants"
    return f"{label} {', '.join(tenant_name(t) for t in names_)}"


def tenant_name(tenant: str | None) -> str:
    """A tenant as messages and tables show it ('' is "(no tenant)")."""
    return "(no tenant)" if tenant == "" else str(tenant)


def _sources(conn: sa.Connection) -> list[str]:
    """What the view reads, as schema.table (none: the view does not exist)."""
    rows = conn.execute(_queries()("cutover_view_sources"), {"view": VIEW}).all()
    return [f"{r.schema_name}.{r.table_name}" for r in rows]


def live_coverage(
    conn: sa.Connection, settings: Settings, at: datetime, *, legacy_only: bool = True
) -> Coverage:
    """Every ticket consumers can read, counted now on the database cutover moves (what the
    gate checks against the run's figures); `legacy_only`: the legacy tickets the mirror
    lacks too (only a whole cutover hides them)."""
    from enrichq_parity.parity import read_coverage

    relations = {}
    for name, table, setting in (
        ("tickets", settings.tickets_table, "ENRICHQ_TICKETS_TABLE"),
        ("legacy", settings.legacy_table, "ENRICHQ_LEGACY_TABLE"),
    ):
        relations[name] = qualified(conn.dialect, table)
        if not relation_exists(conn, relations[name]):
            raise CutoverError(
                f"table {table} does not exist ({setting}): the gate counts the tickets "
                "consumers can read there"
            )
    young_after = at - timedelta(
        seconds=settings.delay_created_seconds + settings.parity_grace_seconds
    )
    return read_coverage(conn, relations, young_after, legacy_only=legacy_only)


def _gate_run(conn: sa.Connection) -> GateRun | None:
    row = conn.execute(_queries()("cutover_gate_run")).first()
    if row is None:
        return None
    thresholds = (
        None
        if row.max_shadow_fault_rate is None
        else Thresholds(
            row.min_order_coverage, row.max_shadow_fault_rate, row.min_ticket_match_rate
        )
    )
    return GateRun(
        id=row.id,
        finished_at=row.finished_at,
        thresholds=thresholds,
        total=Tally.from_dict(row.total or {}),
        tenants={t["tenant"]: Tally.from_dict(t) for t in row.tenants or ()},
        approvals=approvals_of(conn, [row.id])[row.id],
        window_since=row.window_since,
        window_until=row.window_until,
        data_at=row.data_at,
        replica_lag_seconds=row.replica_lag_seconds,
        coverage=None if row.coverage is None else Coverage.from_dict(row.coverage),
    )


def _record(
    conn: sa.Connection,
    *,
    action: Action,
    target: str,
    parity_run_id: int | None,
    actor: str,
    now: datetime | None,
    note: str,
    tenant: str | None,
) -> int:
    row = conn.execute(
        _queries()("cutover_record"),
        {
            "action": action.value,
            "target": target,
            "parity_run_id": parity_run_id,
            "actor": actor,
            "now": now,
            "note": note,
            "tenant": tenant,
        },
    ).one()
    event_id: int = row.id
    return event_id


# -- status ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantStatus:
    """What one tenant's consumers read, and the step that put it there (None: never moved)."""

    tenant: str
    reads: str
    since: datetime | None
    actor: str | None
    event_id: int | None
    parity_run_id: int | None


@dataclass(frozen=True, slots=True)
class Status:
    """The view's mode, and per tenant what its consumers read."""

    exists: bool
    state: ViewState
    description: str
    tenants: tuple[TenantStatus, ...]
    whole: TenantStatus | None

    def as_dict(self) -> dict[str, Any]:
        """JSON shape."""

        def one(t: TenantStatus) -> dict[str, Any]:
            return {
                "tenant": t.tenant,
                "reads": t.reads,
                "since": None if t.since is None else t.since.isoformat(),
                "actor": t.actor,
                "event_id": t.event_id,
                "parity_run_id": t.parity_run_id,
            }

        return {
            "view": VIEW,
            "exists": self.exists,
            "mode": self.state.mode.value,
            "reads": self.description,
            "tenants": [one(t) for t in self.tenants],
        }


def status(conn: sa.Connection, settings: Settings) -> Status:
    """Per tenant, what consumers read and since when, by whom (read-only)."""
    q = _queries()
    exists = relation_exists(conn, VIEW)
    state = view_state(conn, settings) if exists else ViewState(ViewMode.LEGACY)
    events = conn.execute(q("cutover_status_events")).all()
    whole_event = next((e for e in events if e.tenant is None), None)
    by_tenant = {e.tenant: e for e in events if e.tenant is not None}
    run = _gate_run(conn)
    known = set(by_tenant) | set(state.tenants) | (set(run.tenants) if run else set())
    rows = []
    for tenant in sorted(known):
        event = by_tenant.get(tenant)
        if whole_event is not None and (event is None or whole_event.id > event.id):
            event = whole_event
        rows.append(
            TenantStatus(
                tenant=tenant,
                reads=SHADOW_TABLE if state.reads_shadow(tenant) else settings.legacy_table,
                since=None if event is None else event.at,
                actor=None if event is None else event.actor,
                event_id=None if event is None else event.id,
                parity_run_id=None if event is None else event.parity_run_id,
            )
        )
    whole = (
        None
        if whole_event is None
        else TenantStatus(
            "",
            whole_event.target,
            whole_event.at,
            whole_event.actor,
            whole_event.id,
            whole_event.parity_run_id,
        )
    )
    description = _describe(state, settings) if exists else "nothing yet: the view does not exist"
    return Status(exists, state, description, tuple(rows), whole)
