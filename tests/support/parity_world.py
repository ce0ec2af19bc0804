"""Small help desk / warehouse / legacy / shadow worlds for the parity and cutover tests.

Each ticket's requester is a customer of its own (``C-<ticket>``, ``<ticket>@example.com``)
whose orders are in the warehouse, so the shadow-only orders a test writes are verified
unless the test says otherwise (another customer's order, one placed after enrichq's
lookup, one the warehouse does not know).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

NOW = datetime(2024, 3, 10, 12, 0, tzinfo=UTC)
DAY1 = datetime(2024, 3, 4, 9, 0, tzinfo=UTC)
DAY2 = datetime(2024, 3, 5, 9, 0, tzinfo=UTC)
SINCE = datetime(2024, 3, 1, tzinfo=UTC)

SOURCES_DDL = """
CREATE SCHEMA IF NOT EXISTS helpdesk;
CREATE TABLE IF NOT EXISTS helpdesk.tickets (
    id text PRIMARY KEY, requester_email text, tenant text,
    created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL);
CREATE INDEX IF NOT EXISTS tickets_created_at_idx ON helpdesk.tickets (created_at);
CREATE SCHEMA IF NOT EXISTS warehouse;
CREATE TABLE IF NOT EXISTS warehouse.customers (customer_id text PRIMARY KEY, email text);
CREATE TABLE IF NOT EXISTS warehouse.orders (
    order_id text PRIMARY KEY, customer_id text, placed_at timestamptz, total numeric);
CREATE SCHEMA IF NOT EXISTS legacy;
CREATE TABLE IF NOT EXISTS legacy.ticket_orders (
    ticket_id text, order_id text, looked_up_at timestamptz);
CREATE INDEX IF NOT EXISTS legacy_ticket_orders_ticket_id_idx ON legacy.ticket_orders (ticket_id);
"""

OTHER_CUSTOMER = "C-someone-else"


def create_sources(conn: sa.Connection, *, legacy: bool = True) -> None:
    """The help desk mirror, the warehouse and (unless told not to) the legacy output."""
    ddl = SOURCES_DDL if legacy else SOURCES_DDL.split("CREATE SCHEMA IF NOT EXISTS legacy", 1)[0]
    conn.exec_driver_sql(ddl)
    conn.execute(
        sa.text(
            "INSERT INTO warehouse.customers VALUES (:c, 'someone@example.net')"
            " ON CONFLICT DO NOTHING"
        ),
        {"c": OTHER_CUSTOMER},
    )


def add_ticket(
    conn: sa.Connection,
    ticket_id: str,
    *,
    created_at: datetime,
    tenant: str | None = "acme",
    legacy: Sequence[str] = (),
    looked_up_at: datetime | None = None,
    shadow: Sequence[str] | None = None,
    placed_at: Mapping[str, datetime] | None = None,
    foreign: Collection[str] = (),
    unknown: Collection[str] = (),
    email: str | None = None,
    legacy_table: str = "legacy.ticket_orders",
) -> None:
    """One ticket with its legacy rows and shadow result (shadow=None: never enriched).

    The legacy flow looked up an hour after creation (`looked_up_at`), enrichq 30 minutes
    after that. Orders are placed a day before the ticket unless `placed_at` says otherwise;
    `foreign` orders belong to another customer, `unknown` ones are not in the warehouse.
    """
    looked = looked_up_at or created_at + timedelta(hours=1)
    customer = f"C-{ticket_id}"
    requester = email or f"{ticket_id}@example.com"
    conn.execute(
        sa.text("INSERT INTO helpdesk.tickets VALUES (:id, :email, :tenant, :created, :created)"),
        {"id": ticket_id, "email": requester, "tenant": tenant, "created": created_at},
    )
    conn.execute(
        sa.text("INSERT INTO warehouse.customers VALUES (:c, :email)"),
        {"c": customer, "email": f"{ticket_id}@example.com"},
    )
    for order_id in legacy:
        conn.execute(
            sa.text(f"INSERT INTO {legacy_table} VALUES (:t, :o, :at)"),
            {"t": ticket_id, "o": order_id, "at": looked},
        )
    default_placed = created_at - timedelta(days=1)
    every = set(legacy) | set(shadow or ())
    for order_id in sorted(every - set(unknown)):
        conn.execute(
            sa.text(
                "INSERT INTO warehouse.orders VALUES (:o, :c, :at, 10)"
                " ON CONFLICT (order_id) DO NOTHING"
            ),
            {
                "o": order_id,
                "c": OTHER_CUSTOMER if order_id in foreign else customer,
                "at": (placed_at or {}).get(order_id, default_placed),
            },
        )
    if shadow is None:
        return
    enriched = looked + timedelta(minutes=30)
    for order_id in shadow:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_orders (ticket_id, order_id, customer_id, placed_at,"
                " total, looked_up_at, queue_id) VALUES (:t, :o, :c, :placed, 10, :at, 1)"
            ),
            {
                "t": ticket_id,
                "o": order_id,
                "c": customer,
                "placed": (placed_at or {}).get(order_id, default_placed),
                "at": enriched,
            },
        )
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.ticket_enrichments (ticket_id, enriched_at, order_count,"
            " queue_id) VALUES (:t, :at, :n, 1)"
        ),
        {"t": ticket_id, "at": enriched, "n": len(shadow)},
    )


def add_queue_row(conn: sa.Connection, key: str, state: str) -> None:
    """An open queue row (queued or leased) for ticket `key`."""
    leased = state == "leased"
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.queue (kind, key, reason, state, max_attempts, attempts,"
            " lease_owner, lease_expires_at) VALUES ('enrich', :key, 'updated', :state, 5,"
            " :attempts, :owner, CASE WHEN :leased THEN now() + interval '1 minute' END)"
        ),
        {"key": key, "state": state, "attempts": 1 if leased else 0,
         "owner": "w-1" if leased else None, "leased": leased},
    )  # fmt: skip


def seed_every_class(conn: sa.Connection) -> None:
    """Known differences of every class over two days, plus exclusions and an outsider.

    12 tickets compared: exact 3, drift only 1, partial 2, shadow missing 1, unverified 3,
    legacy missing 1, extra only 1; 3 excluded; tenants acme (9), globex (2), none (1).
    """
    create_sources(conn)
    lookup = DAY2 + timedelta(hours=1)
    # day 1 (2024-03-04)
    add_ticket(conn, "T-01-exact", created_at=DAY1, legacy=["A1", "A2"], shadow=["A1", "A2"])
    add_ticket(conn, "T-02-empty", created_at=DAY1, legacy=[], shadow=[])
    add_ticket(
        conn, "T-03-partial", created_at=DAY1, tenant="globex",
        legacy=["P1", "P2", "P3"], shadow=["P1"],
    )  # fmt: skip
    add_ticket(conn, "T-04-lost", created_at=DAY1, tenant="globex", legacy=["S1", "S2"])
    # another customer's order: enrichq invented it
    add_ticket(
        conn, "T-14-foreign", created_at=DAY1, legacy=["F1"], shadow=["F1", "F2"], foreign={"F2"}
    )
    # day 2 (2024-03-05)
    add_ticket(
        conn, "T-05-drift", created_at=DAY2, legacy=["D1"], shadow=["D1", "D2"],
        looked_up_at=lookup, placed_at={"D2": lookup + timedelta(minutes=5)},
    )  # fmt: skip
    add_ticket(
        conn, "T-06-partial-extra", created_at=DAY2, legacy=["Q1", "Q2"], shadow=["Q1", "Q9"],
        looked_up_at=lookup,
    )  # fmt: skip
    add_ticket(conn, "T-07-legacy-missing", created_at=DAY2, tenant=None, shadow=["L1"])
    add_ticket(conn, "T-08-extra", created_at=DAY2, legacy=["E1"], shadow=["E1", "E2"])
    # placed after enrichq's own lookup (30 min after legacy's): enrichq cannot have seen it
    add_ticket(
        conn, "T-09-late", created_at=DAY2, legacy=["W1"], shadow=["W1", "W2"],
        looked_up_at=lookup, placed_at={"W2": lookup + timedelta(hours=2)},
    )  # fmt: skip
    # the legacy flow wrote X1 twice: still one order
    add_ticket(conn, "T-10-dup", created_at=DAY2, legacy=["X1", "X1"], shadow=["X1"])
    # an order the warehouse does not know
    add_ticket(conn, "T-15-unknown", created_at=DAY2, shadow=["U1"], unknown={"U1"})
    # excluded: too young, and open queue rows (queued, leased)
    add_ticket(conn, "T-11-young", created_at=NOW - timedelta(minutes=30), legacy=["Y1"], shadow=[])
    add_ticket(conn, "T-12-queued", created_at=DAY2, legacy=["Z1"], shadow=[])
    add_queue_row(conn, "T-12-queued", "queued")
    add_ticket(conn, "T-13-leased", created_at=DAY2, legacy=["Z2"])
    add_queue_row(conn, "T-13-leased", "leased")
    # outside the window: never counted
    add_ticket(conn, "T-99-old", created_at=datetime(2024, 2, 1, tzinfo=UTC), legacy=["O1"])


def seed_legacy_faults_only(conn: sa.Connection, *, created_at: datetime = DAY1) -> None:
    """20 tickets of tenant acme: 16 exact, 2 lost by legacy, 2 with an order legacy missed;
    and 10 exact tickets of tenant globex. No shadow fault."""
    create_sources(conn)
    for i in range(16):
        add_ticket(conn, f"A-{i:02d}", created_at=created_at, legacy=[f"A{i}"], shadow=[f"A{i}"])
    for i in range(2):
        add_ticket(conn, f"A-lost-{i}", created_at=created_at, shadow=[f"L{i}"])
        add_ticket(
            conn, f"A-extra-{i}", created_at=created_at, legacy=[f"E{i}"],
            shadow=[f"E{i}", f"E{i}b"],
        )  # fmt: skip
    for i in range(10):
        add_ticket(
            conn, f"G-{i:02d}", created_at=created_at, tenant="globex",
            legacy=[f"G{i}"], shadow=[f"G{i}"],
        )  # fmt: skip


def seed(engine: sa.Engine, builder: Callable[[sa.Connection], None]) -> None:
    """Build a world in one committed transaction."""
    with engine.begin() as conn:
        builder(conn)
