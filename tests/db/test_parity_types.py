"""Parity over legacy and warehouse tables whose id columns are not `text`: ids compare as
text everywhere (as the worker and the consumer view compare them), and a column type that
cannot be compared is refused before anything is recorded."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa
from tests.support.parity_world import DAY1, NOW, SINCE, seed
from tests.support.settings import parity_settings

from enrichq_parity.model import TicketClass
from enrichq_parity.parity import ParityInputError, run_parity
from enrichq_service.cli import main

# (legacy ticket_id type, legacy order_id type, warehouse key type)
TYPES = {
    "text": ("text", "text", "text"),
    "varchar": ("varchar(64)", "varchar(64)", "varchar(64)"),
    "bigint": ("bigint", "bigint", "bigint"),
    "uuid": ("uuid", "uuid", "uuid"),
    "mixed": ("bigint", "varchar(64)", "bigint"),
}


def _ids(kind: str, n: int) -> list[str]:
    """n ids that are valid for the column type; numeric ids that sort differently as numbers
    and as text (9 < 10, but '10' < '9'), so a comparison that sorts by the column's own type
    instead of by text sees different arrays."""
    if kind == "uuid":
        return [str(uuid.UUID(int=(i + 1) * 7919)) for i in range(n)]
    if kind in {"bigint", "mixed"}:
        return [str(9 + i) for i in range(n)]
    return [f"K-{i}" for i in range(n)]


def _world(conn: sa.Connection, case: str) -> dict[str, str]:
    """A mirror (text ids), a legacy table and a warehouse of the case's types; returns the
    tickets by what they are."""
    ticket_type, order_type, key_type = TYPES[case]
    # a text or varchar ticket_id's own index serves the comparison as text; another type
    # needs one on its text form
    index = "ticket_id" if ticket_type in {"text", "varchar(64)"} else "(CAST(ticket_id AS text))"
    id_kind = "uuid" if case == "uuid" else ("bigint" if "bigint" in ticket_type else "text")
    order_kind = "uuid" if case == "uuid" else ("bigint" if "bigint" in order_type else "text")
    conn.exec_driver_sql(
        f"""
        CREATE SCHEMA helpdesk;
        CREATE TABLE helpdesk.tickets (id text PRIMARY KEY, requester_email text, tenant text,
            created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL);
        CREATE SCHEMA warehouse;
        CREATE TABLE warehouse.customers (customer_id {key_type} PRIMARY KEY, email text);
        CREATE TABLE warehouse.orders (order_id {order_type} PRIMARY KEY,
            customer_id {key_type}, placed_at timestamptz, total numeric);
        CREATE SCHEMA legacy;
        CREATE TABLE legacy.ticket_orders (ticket_id {ticket_type}, order_id {order_type},
            looked_up_at timestamptz);
        CREATE INDEX legacy_ticket_idx ON legacy.ticket_orders ({index});
        """
    )
    tickets = _ids(id_kind, 3)
    orders = _ids(order_kind, 6)
    customers = _ids("uuid" if key_type == "uuid" else "bigint", 3)
    # exact (two orders that sort differently as numbers and as text), partial, extra
    plan = {
        tickets[0]: (orders[0:2], orders[0:2]),
        tickets[1]: (orders[2:4], orders[2:3]),
        tickets[2]: (orders[4:5], orders[4:6]),
    }
    looked = DAY1 + timedelta(hours=1)
    for (ticket, (legacy, shadow)), customer in zip(plan.items(), customers, strict=True):
        email = f"{ticket}@example.com"
        conn.execute(
            sa.text("INSERT INTO helpdesk.tickets VALUES (:t, :e, 'acme', :at, :at)"),
            {"t": ticket, "e": email, "at": DAY1},
        )
        conn.execute(
            sa.text(f"INSERT INTO warehouse.customers VALUES (CAST(:c AS {key_type}), :e)"),
            {"c": customer, "e": email},
        )
        for order in sorted(set(legacy) | set(shadow)):
            conn.execute(
                sa.text(
                    f"INSERT INTO warehouse.orders VALUES (CAST(:o AS {order_type}),"
                    f" CAST(:c AS {key_type}), :at, 10)"
                ),
                {"o": order, "c": customer, "at": DAY1 - timedelta(days=1)},
            )
        for order in legacy:
            conn.execute(
                sa.text(
                    f"INSERT INTO legacy.ticket_orders VALUES (CAST(:t AS {ticket_type}),"
                    f" CAST(:o AS {order_type}), :at)"
                ),
                {"t": ticket, "o": order, "at": looked},
            )
        for order in shadow:
            conn.execute(
                sa.text(
                    "INSERT INTO enrichq.ticket_orders (ticket_id, order_id, customer_id,"
                    " placed_at, total, looked_up_at, queue_id)"
                    " VALUES (:t, :o, :c, :placed, 10, :at, 1)"
                ),
                {
                    "t": ticket,
                    "o": order,
                    "c": customer,
                    "placed": DAY1 - timedelta(days=1),
                    "at": looked + timedelta(minutes=30),
                },
            )
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_enrichments (ticket_id, enriched_at, order_count,"
                " queue_id) VALUES (:t, :at, :n, 1)"
            ),
            {"t": ticket, "at": looked + timedelta(minutes=30), "n": len(shadow)},
        )
    return {"exact": tickets[0], "partial": tickets[1], "extra": tickets[2]}


@pytest.mark.parametrize("case", list(TYPES))
def test_ids_of_any_comparable_type_compare_as_text(
    db_engine: sa.Engine, db_url: str, case: str
) -> None:
    got: dict[str, str] = {}
    seed(db_engine, lambda conn: got.update(_world(conn, case)))
    report = run_parity(
        db_engine, db_engine, parity_settings(db_url), since=SINCE, until=None, now=NOW
    )
    t = report.total
    assert (t.count(TicketClass.EXACT), t.count(TicketClass.PARTIAL)) == (1, 1)
    # the extra order is the ticket's customer's, placed before the lookup: verified
    assert t.count(TicketClass.EXTRA_ONLY) == 1
    assert (t.legacy_orders, t.matched_orders, t.missing_orders, t.extra_orders) == (5, 4, 1, 1)
    [partial] = report.mismatches[TicketClass.PARTIAL]
    assert partial.ticket_id == got["partial"]


def _refused_world(conn: sa.Connection) -> None:
    conn.exec_driver_sql(
        """
        CREATE SCHEMA helpdesk;
        CREATE TABLE helpdesk.tickets (id text PRIMARY KEY, requester_email text, tenant text,
            created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL);
        CREATE SCHEMA legacy;
        CREATE TABLE legacy.ticket_orders (ticket_id bytea, order_id text,
            looked_up_at timestamptz);
        CREATE INDEX ON legacy.ticket_orders (ticket_id);
        """
    )


def test_an_id_type_that_cannot_be_compared_is_refused_and_nothing_is_recorded(
    db_engine: sa.Engine, db_url: str
) -> None:
    seed(db_engine, _refused_world)
    with pytest.raises(ParityInputError, match=r"ticket_id is bytea"):
        run_parity(db_engine, db_engine, parity_settings(db_url), since=SINCE, until=None, now=NOW)
    with db_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.parity_runs")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.runs")).scalar() == 0


def test_the_cli_refuses_an_uncomparable_type_in_one_line(
    db_engine: sa.Engine,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seed(db_engine, _refused_world)
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    assert main(["parity"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "ticket_id is bytea" in err


def test_a_non_text_ticket_id_needs_an_index_on_its_text_form(
    db_engine: sa.Engine, db_url: str
) -> None:
    def build(conn: sa.Connection) -> None:
        _world(conn, "bigint")
        conn.exec_driver_sql(
            "DROP INDEX legacy.legacy_ticket_idx; CREATE INDEX ON legacy.ticket_orders (ticket_id)"
        )

    seed(db_engine, build)
    with pytest.raises(ParityInputError) as refused:
        run_parity(db_engine, db_engine, parity_settings(db_url), since=SINCE, until=None, now=NOW)
    assert str(refused.value) == (
        "legacy table legacy.ticket_orders has no index on its ticket_id (int8) as text, which "
        "parity reads it by: CREATE INDEX CONCURRENTLY ON legacy.ticket_orders "
        "((CAST(ticket_id AS text)))"
    )
