"""a warehouse admission is one statement: the fleet's lock is never held across a reply

An admission took the fleet-wide advisory lock in one statement, counted and inserted in a
second, and let the lock go at COMMIT, a third round trip: a worker frozen (SIGSTOP, a
stalled VM) between them held every other worker's admission until their statement
timeout. `enrichq.admission_take` takes the lock, counts with a fresh snapshot (a volatile
function's statements each take one, so it sees every admission committed before the lock
was granted) and inserts, in one statement the worker runs outside a transaction: the lock
goes with the statement's own commit, on the server, whatever the client does meanwhile.

It also says whether the cost it reserved is known (`known`): a latest day's average of 0
bytes is a known cost of nothing, not an unknown one.

Revision ID: 0015
Revises: 0013
Create Date: 2026-12-04 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Admits one warehouse lookup as a_token, of a_owner, unless the fleet-wide cap (a_cap, 0 =
# none) has no free slot or today's budget (a_budget, 0 = none) is spent, counting the bytes
# reserved by the lookups in flight. It reserves a_expected bytes (NULL: the latest day's
# average lookup, else the largest known cost in flight) until its settle releases them, or
# until a_lease_seconds pass without its owner's heartbeat (a slot whose holder died is free
# again within one lease; its row is deleted here, so the table holds only the fleet's live
# lookups). Returns why it was refused ('cap', 'budget' or NULL), the bytes reserved,
# whether that cost is known, the database time, and when the budget's day resets.
ADMISSION_TAKE = """
CREATE FUNCTION enrichq.admission_take(
    a_token uuid, a_owner text, a_cap integer, a_budget bigint, a_expected bigint,
    a_lease_seconds double precision, a_now timestamptz, a_lock_space integer)
RETURNS TABLE (refused text, reserved bigint, known boolean, now timestamptz,
               resets_at timestamptz)
LANGUAGE sql VOLATILE AS $fn$
-- the only admission of the fleet until this statement commits
SELECT pg_advisory_xact_lock(a_lock_space, 0);
-- a new snapshot, taken once the lock is granted
WITH clock AS (
    SELECT coalesce(a_now, now()) AS now
),
-- the rows of holders that died (every statement here sees the table as it was before)
purged AS (
    DELETE FROM enrichq.lookups_in_flight AS f
    USING clock
    WHERE f.expires_at <= clock.now
),
ledger AS (
    SELECT coalesce((SELECT b.bytes_billed FROM enrichq.budget_ledger AS b
                     WHERE b.day = CAST(timezone('UTC', clock.now) AS date)), 0) AS spent,
           (SELECT b.bytes_billed / b.lookups FROM enrichq.budget_ledger AS b
            WHERE b.lookups > 0 ORDER BY b.day DESC LIMIT 1) AS average
    FROM clock
),
-- the live lookups; one admitted before any cost was known (reserved 0, not learned yet)
-- counts as the average now that one is
live AS (
    SELECT count(*) AS slots,
           coalesce(sum(CASE WHEN f.reserved_bytes > 0 THEN f.reserved_bytes
                             ELSE coalesce(ledger.average, 0) END), 0) AS reserved,
           max(nullif(f.reserved_bytes, 0)) AS largest
    FROM enrichq.lookups_in_flight AS f
    CROSS JOIN clock
    CROSS JOIN ledger
    WHERE f.expires_at > clock.now
),
verdict AS (
    SELECT CASE WHEN a_cap > 0 AND live.slots >= a_cap THEN 'cap'
                WHEN a_budget > 0 AND ledger.spent + live.reserved >= a_budget THEN 'budget'
           END AS refused,
           -- before the ledger knows an average: what a lookup that ran and is not
           -- settled yet really cost; none of these: unknown (one such lookup per worker
           -- at a time), reserved as 0
           coalesce(a_expected, ledger.average, live.largest, 0) AS expected,
           a_expected IS NOT NULL OR ledger.average IS NOT NULL OR live.largest IS NOT NULL
               AS known
    FROM ledger, live
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

SIGNATURE = (
    "enrichq.admission_take(uuid, text, integer, bigint, bigint, double precision,"
    " timestamptz, integer)"
)


def upgrade() -> None:
    """Create the one-statement admission."""
    op.execute(ADMISSION_TAKE)


def downgrade() -> None:
    """Drop it (the worker of 0009 admits in a transaction of its own)."""
    op.execute(f"DROP FUNCTION {SIGNATURE}")
