"""The demo's seeded world says, in the parity report's own terms, what its first parity run
will find: the demo's seed line and its report reconcile."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from tests.support.settings import parity_settings

from enrichq_parity.model import TicketClass
from enrichq_parity.parity import run_parity
from enrichq_service import seed

NOW = datetime(2024, 3, 10, 12, 0, tzinfo=UTC)

# What enrichq's lookup finds for every ticket at NOW: each order of the requester's customer
# (e-mail compared in any case) placed by then; every ticket enriched.
ENRICH_ALL = """
INSERT INTO enrichq.ticket_orders (ticket_id, order_id, customer_id, placed_at, total,
                                   looked_up_at, queue_id)
SELECT t.id, o.order_id, o.customer_id, o.placed_at, o.total, :now, 1
FROM helpdesk.tickets AS t
JOIN warehouse.customers AS c ON lower(c.email) = lower(t.requester_email)
JOIN warehouse.orders AS o ON o.customer_id = c.customer_id AND o.placed_at <= :now;
INSERT INTO enrichq.ticket_enrichments (ticket_id, enriched_at, order_count, queue_id)
SELECT t.id, :now, (SELECT count(*) FROM enrichq.ticket_orders AS s WHERE s.ticket_id = t.id), 1
FROM helpdesk.tickets AS t;
"""


def test_the_seed_says_what_parity_will_find(db_engine: sa.Engine, db_url: str) -> None:
    with db_engine.begin() as conn:
        world = seed.seed_world(conn, tickets=1500, now=NOW - timedelta(hours=3))
        for statement in ENRICH_ALL.split(";")[:-1]:
            conn.execute(sa.text(statement), {"now": NOW - timedelta(hours=1)})
    report = run_parity(
        db_engine,
        db_engine,
        parity_settings(db_url, parity_grace_seconds=60),
        since=NOW - timedelta(days=4),
        until=None,
        now=NOW,
    )
    t = report.total
    assert t.compared == world.tickets
    found = {c.value: t.count(c) for c in TicketClass if t.count(c)}
    assert found == dict(world.expected)
    assert t.legacy_orders == world.legacy_orders
    # every imperfection the seed line names is there to be found
    assert world.legacy_lost > 0
    assert world.legacy_partial > 0
    assert world.late_orders > 0
    assert found["legacy_missing"] >= world.legacy_lost
