"""the daily budget reserves what a warehouse query costs, not what a ticket's share does

The admission reserved the latest day's average bytes per lookup-log row for each lookup:
a row is a ticket, and a batch lookup is one query for up to ENRICHQ_LOOKUP_BATCH_SIZE
tickets, so it reserved a fiftieth of the query's cost. And a cost that rose since that
day was reserved at the old average by every lookup in flight at once. Now:

- a lookup in flight records its real cost once its query returns (`cost`), and holds that
  until its settle charges it;
- the ledger counts the day's queries (`queries`) and its costliest (`query_bytes_max`),
  from the lookups it releases;
- a lookup reserves today's worst query cost (the costliest charged today, or learned by a
  lookup in flight), which a rise raises at once (lookups charged today without their
  queries counted, before a budget was set: their average); before any cost of today is known it
  reserves the latest earlier day's average per query, and counts as a lookup of unknown
  cost (one per worker at a time, until its cost is learned). A lookup admitted at a lower
  estimate and still running counts at the worst known now.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05 08:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"
SIGNATURE = (
    "enrichq.admission_take(uuid, text, integer, bigint, bigint, double precision,"
    " timestamptz, integer)"
)

# Admits one warehouse lookup as a_token, of a_owner, unless the fleet-wide cap (a_cap, 0 =
# none) has no free slot or today's budget (a_budget, 0 = none) is spent, counting what the
# lookups in flight are expected to cost. It reserves a_expected bytes (NULL: today's worst
# query cost; before one is known, the latest earlier day's average per query, as a cost
# not known) until its settle releases them, or until a_lease_seconds pass without its
# owner's heartbeat. Returns why it was refused ('cap', 'budget' or NULL), the bytes
# reserved, whether that cost is known, the database time, and when the budget's day
# resets.
ADMISSION_TAKE = """
CREATE OR REPLACE FUNCTION enrichq.admission_take(
    a_token uuid, a_owner text, a_cap integer, a_budget bigint, a_expected bigint,
    a_lease_seconds double precision, a_now timestamptz, a_lock_space integer)
RETURNS TABLE (refused text, reserved bigint, known boolean, now timestamptz,
               resets_at timestamptz)
LANGUAGE sql VOLATILE AS $fn$
-- the only admission of the fleet until this statement commits
SELECT pg_advisory_xact_lock(a_lock_space, 0);
-- a new snapshot, taken once the lock is granted
WITH clock AS (
    SELECT coalesce(a_now, now()) AS now, CAST(timezone('UTC', coalesce(a_now, now())) AS date)
        AS day
),
-- the rows of holders that died (every statement here sees the table as it was before)
purged AS (
    DELETE FROM enrichq.lookups_in_flight AS f
    USING clock
    WHERE f.expires_at <= clock.now
),
ledger AS (
    SELECT coalesce(t.bytes_billed, 0) AS spent,
           -- today's costliest query, once today has charged one (lookups charged
           -- without counting their queries, before a budget was set: their average)
           CASE WHEN t.queries > 0 THEN t.query_bytes_max
                WHEN t.lookups > 0 THEN t.bytes_billed / t.lookups END AS worst,
           -- the latest earlier day's average per query (per lookup-log row before the
           -- ledger counted queries)
           (SELECT b.bytes_billed / coalesce(nullif(b.queries, 0), b.lookups)
            FROM enrichq.budget_ledger AS b
            WHERE b.day < clock.day AND (b.queries > 0 OR b.lookups > 0)
            ORDER BY b.day DESC LIMIT 1) AS before
    FROM clock
    LEFT JOIN enrichq.budget_ledger AS t ON t.day = clock.day
),
-- the costliest query of the lookups in flight that returned (their real cost)
learned AS (
    SELECT max(f.cost) AS largest
    FROM enrichq.lookups_in_flight AS f
    CROSS JOIN clock
    WHERE f.expires_at > clock.now
),
estimate AS (
    SELECT coalesce(a_expected, greatest(ledger.worst, learned.largest)) AS known_cost,
           ledger.before
    FROM ledger, learned
),
-- the live lookups: one whose query returned at its real cost, one still running at the
-- worst of what it reserved and what a query is known to cost now (a rise counts at once)
live AS (
    SELECT count(*) AS slots,
           coalesce(sum(coalesce(f.cost, greatest(f.reserved_bytes,
                                                  coalesce(e.known_cost, e.before, 0)))), 0)
               AS reserved
    FROM enrichq.lookups_in_flight AS f
    CROSS JOIN clock
    CROSS JOIN estimate AS e
    WHERE f.expires_at > clock.now
),
verdict AS (
    SELECT CASE WHEN a_cap > 0 AND live.slots >= a_cap THEN 'cap'
                WHEN a_budget > 0 AND ledger.spent + live.reserved >= a_budget THEN 'budget'
           END AS refused,
           coalesce(e.known_cost, e.before, 0) AS expected,
           e.known_cost IS NOT NULL AS known
    FROM ledger, live, estimate AS e
),
taken AS (
    INSERT INTO enrichq.lookups_in_flight (token, owner, reserved_bytes, started_at, expires_at)
    SELECT a_token, a_owner, v.expected, clock.now,
           clock.now + make_interval(secs => a_lease_seconds)
    FROM verdict AS v
    CROSS JOIN clock
    WHERE v.refused IS NULL
    RETURNING reserved_bytes
)
SELECT v.refused, (SELECT t.reserved_bytes FROM taken AS t), v.known, clock.now,
       timezone('UTC', CAST(date_trunc('day', timezone('UTC', clock.now)) + interval '1 day'
                            AS timestamp))
FROM verdict AS v
CROSS JOIN clock;
$fn$
"""


def upgrade() -> None:
    """Count queries on the ledger, learn costs in flight, reserve per query."""
    op.add_column(
        "budget_ledger",
        sa.Column("queries", sa.BigInteger(), server_default="0", nullable=False),
        schema=SCHEMA,
    )
    op.add_column(
        "budget_ledger",
        sa.Column("query_bytes_max", sa.BigInteger(), server_default="0", nullable=False),
        schema=SCHEMA,
    )
    op.create_check_constraint(
        op.f("budget_ledger_queries_non_negative"), "budget_ledger", "queries >= 0", schema=SCHEMA
    )
    op.create_check_constraint(
        op.f("budget_ledger_query_bytes_max_non_negative"),
        "budget_ledger",
        "query_bytes_max >= 0",
        schema=SCHEMA,
    )
    op.add_column("lookups_in_flight", sa.Column("cost", sa.BigInteger()), schema=SCHEMA)
    op.create_check_constraint(
        op.f("lookups_in_flight_cost_non_negative"), "lookups_in_flight", "cost >= 0", schema=SCHEMA
    )
    op.execute(ADMISSION_TAKE)


def downgrade() -> None:
    """Back to 0015's admission (per lookup-log row), without the new columns."""
    op.execute(f"DROP FUNCTION {SIGNATURE}")
    op.execute(_previous_admission())
    op.drop_constraint(
        op.f("lookups_in_flight_cost_non_negative"),
        "lookups_in_flight",
        schema=SCHEMA,
        type_="check",
    )
    op.drop_column("lookups_in_flight", "cost", schema=SCHEMA)
    for name in (
        "budget_ledger_query_bytes_max_non_negative",
        "budget_ledger_queries_non_negative",
    ):
        op.drop_constraint(op.f(name), "budget_ledger", schema=SCHEMA, type_="check")
    op.drop_column("budget_ledger", "query_bytes_max", schema=SCHEMA)
    op.drop_column("budget_ledger", "queries", schema=SCHEMA)


def _previous_admission() -> str:
    """0015's `enrichq.admission_take`, read from its revision file (one copy of it)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name("0015_admission_in_one_statement.py")
    spec = importlib.util.spec_from_file_location("enrichq_migration_0015", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.ADMISSION_TAKE
    return text
