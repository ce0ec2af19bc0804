"""A small, realistic world for the demo and the tests: help desk, warehouse, legacy output.

The default shapes of DESIGN §4. The legacy output carries the imperfections a parity
review is for: tickets the legacy flow lost, partial results, and orders placed after the
legacy lookup (drift, not a mismatch).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import sqlalchemy as sa

from enrichq_schema.queries import load

SQL = load("enrichq_service", "sql/seed.sql")


@dataclass(frozen=True, slots=True)
class WorldSummary:
    """What was seeded, and how many tickets carry each imperfection."""

    tickets: int
    customers: int
    orders: int
    legacy_rows: int
    legacy_lost: int
    legacy_partial: int
    late_orders: int
    no_orders: int
    unknown_requester: int
    expected_classes: Mapping[str, str] = field(default_factory=dict)
    """Each ticket's parity class (a TicketClass value) once enrichq has enriched every
    ticket: what the demo's first parity run must find."""

    @property
    def expected(self) -> dict[str, int]:
        """Tickets per parity class once enrichq has enriched every ticket."""
        return dict(Counter(self.expected_classes.values()))

    def expected_without(self, left_out: Iterable[str]) -> dict[str, int]:
        """Tickets per parity class, leaving out the tickets `left_out` (outside a window)."""
        gone = set(left_out)
        return dict(Counter(c for t, c in self.expected_classes.items() if t not in gone))

    @property
    def legacy_orders(self) -> int:
        """The legacy output's orders: parity's "legacy orders" over the whole world."""
        return self.legacy_rows


def create_external_tables(conn: sa.Connection) -> None:
    """The help desk mirror, the warehouse and the legacy output (if they do not exist)."""
    for name in SQL:
        if name.startswith("seed_create_"):
            conn.execute(SQL(name))


def copy_warehouse(source: sa.Connection, target: sa.Connection) -> int:
    """Create the warehouse tables in `target`, of any dialect the seed's SQL runs on
    (PostgreSQL, DuckDB), and fill them with exactly the rows of `source`'s; rows copied."""
    target.execute(SQL("seed_create_warehouse"))
    copied = 0
    for select, insert in (
        ("seed_select_customers", "seed_insert_customers"),
        ("seed_select_orders", "seed_insert_orders"),
    ):
        rows = [dict(r._mapping) for r in source.execute(SQL(select))]
        if rows:
            target.execute(SQL(insert), rows)
        copied += len(rows)
    return copied


def seed_world(
    conn: sa.Connection,
    *,
    tickets: int,
    seed: int = 7,
    now: datetime | None = None,
    age: timedelta = timedelta(days=2),
    tenants: tuple[str, ...] = ("acme", "globex", "initech"),
) -> WorldSummary:
    """Seed `tickets` tickets created over the `age` before `now`, deterministically."""
    rng = random.Random(seed)  # noqa: S311 -- demo data, not secrets: it must be repeatable
    now = now or datetime.now(UTC)
    create_external_tables(conn)
    customers = max(1, tickets * 2 // 3)
    cust_rows, order_rows, orders_of = _warehouse(rng, customers, now - age)
    ticket_rows: list[dict[str, object]] = []
    legacy_rows: list[dict[str, object]] = []
    lost = partial = late = empty = unknown = 0
    expected: dict[str, str] = {}
    written: dict[str, tuple[str | None, set[str], datetime]] = {}
    late_of: dict[str, list[dict[str, object]]] = {}
    for t in range(tickets):
        tid = f"T-{t:06d}"
        created = now - age * rng.random() - timedelta(hours=1)
        cid: str | None
        if rng.random() < 0.03:
            email = f"stranger{t}@example.org"  # nobody in the warehouse: an empty result
            unknown += 1
            cid = None
        else:
            c = rng.randrange(customers)
            email = f"Customer{c}@Example.com" if rng.random() < 0.1 else f"customer{c}@example.com"
            cid = f"C-{c:06d}"
        ticket_rows.append(
            {
                "id": tid,
                "requester_email": email,
                "tenant": rng.choice(tenants),
                "created_at": created,
                "updated_at": created + timedelta(minutes=rng.randint(0, 90)),
            }
        )
        found = list(orders_of.get(cid, [])) if cid else []
        if not found:
            empty += 1
        looked_up = created + timedelta(minutes=10)
        roll = rng.random()
        if roll < 0.02 and found:
            lost += 1  # the legacy flow dropped this ticket entirely
            found = []
        elif roll < 0.04 and len(found) > 1:
            partial += 1  # the legacy flow saved only some orders
            found = found[: len(found) - 1]
        if roll > 0.97 and cid:
            late += 1  # an order placed after the legacy lookup: drift
            row = {
                "order_id": f"O-late-{t:06d}",
                "customer_id": cid,
                "placed_at": looked_up + timedelta(minutes=30),
                "total": Decimal("19.99"),
            }
            order_rows.append(row)
            late_of.setdefault(cid, []).append(row)
        written[tid] = (cid, {str(o["order_id"]) for o in found}, looked_up)
        legacy_rows.extend(
            {"ticket_id": tid, "order_id": o["order_id"], "looked_up_at": looked_up} for o in found
        )
    # What parity will call each ticket once enrichq has looked every one up (after this
    # seed: every order of its customer, late ones included, other tickets' late orders too).
    for tid, (cid, legacy, looked_up) in written.items():
        shadow = [*orders_of.get(cid, []), *late_of.get(cid, [])] if cid else []
        expected[tid] = _expected_class(shadow, legacy, looked_up)
    conn.execute(SQL("seed_insert_customers"), cust_rows)
    if order_rows:
        conn.execute(SQL("seed_insert_orders"), order_rows)
    conn.execute(SQL("seed_insert_tickets"), ticket_rows)
    if legacy_rows:
        conn.execute(SQL("seed_insert_legacy"), legacy_rows)
    return WorldSummary(
        tickets=tickets,
        customers=customers,
        orders=len(order_rows),
        legacy_rows=len(legacy_rows),
        legacy_lost=lost,
        legacy_partial=partial,
        late_orders=late,
        no_orders=empty,
        unknown_requester=unknown,
        expected_classes=expected,
    )


def _warehouse(
    rng: random.Random, customers: int, before: datetime
) -> tuple[list[dict[str, object]], list[dict[str, object]], dict[str, list[dict[str, object]]]]:
    """(customer rows, order rows, orders by customer): 0 to 5 orders each, placed up to 400
    days before `before`."""
    cust_rows: list[dict[str, object]] = [
        {"customer_id": f"C-{c:06d}", "email": f"customer{c}@example.com"} for c in range(customers)
    ]
    order_rows: list[dict[str, object]] = []
    orders_of: dict[str, list[dict[str, object]]] = {}
    for c in range(customers):
        customer_id = f"C-{c:06d}"
        for o in range(rng.choice((0, 1, 2, 3, 3, 4, 5))):
            row = {
                "order_id": f"O-{c:06d}-{o}",
                "customer_id": customer_id,
                "placed_at": before - timedelta(days=rng.randint(1, 400)),
                "total": Decimal(rng.randint(500, 50_000)) / 100,
            }
            order_rows.append(row)
            orders_of.setdefault(customer_id, []).append(row)
    return cust_rows, order_rows, orders_of


def _expected_class(shadow: list[dict[str, object]], legacy: set[str], looked_up: datetime) -> str:
    """Parity's class of a ticket whose legacy rows hold `legacy` (looked up at `looked_up`)
    and whose enrichq result is `shadow`: orders only enrichq has are drift when placed after
    the legacy lookup (which only a legacy row records), else extras."""
    only_shadow = [o for o in shadow if str(o["order_id"]) not in legacy]
    drift = [o for o in only_shadow if legacy and o["placed_at"] > looked_up]  # type: ignore[operator]  # a datetime
    extra = len(only_shadow) - len(drift)
    if not legacy and extra:
        return "legacy_missing"
    if extra:
        return "extra_only"
    return "drift_only" if drift else "exact"
