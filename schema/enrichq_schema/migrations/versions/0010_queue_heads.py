"""the claim starts from one head per (kind, tenant), not from every tenant's queued rows

A claim ranked every (kind, tenant) with queued rows, visible or not, on every call, so its
cost grew with the number of tenants holding work (issue 26). `enrichq.queue_heads` keeps
one row per pair: the oldest queued visible time (never after any queued row of the pair),
and, as of its last evaluation, how many levels below the top plan's it is and its claims of
the last day. The queue's
statement triggers make or lower a pair's head whenever a statement queues rows (enqueue,
retry, defer, recovery, redrive, refresh, and any INSERT), so no writer can forget it; the
claim evaluates the heads that are due and the pairs it took rows from, through
`enrichq.queue_heads_refresh`, and reads the pairs in claim order from an index.

Locks: the trigger takes KEY SHARE on a head it leaves alone (so no one raises the head past
its uncommitted rows), or writes it, in (kind, tenant) order. The refresh never waits (SKIP
LOCKED): it evaluates under FOR NO KEY UPDATE, and moves `oldest` later only under FOR
UPDATE, reading the queue in a statement that starts after that lock is granted.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "enrichq"

NOTE = """
CREATE FUNCTION enrichq.queue_heads_note() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    pair record;
BEGIN
    -- the pairs this statement queued rows of, each with its oldest such row, in the heads'
    -- lock order
    FOR pair IN
        SELECT g.kind, g.tenant, g.oldest
        FROM (
            SELECT a.kind, coalesce(a.tenant, '') AS tenant, min(a.visible_at) AS oldest
            FROM added AS a
            WHERE a.state = 'queued'
            GROUP BY 1, 2
        ) AS g
        ORDER BY g.kind COLLATE "C", g.tenant COLLATE "C"
    LOOP
        -- a head at or before these rows already: held (KEY SHARE) until this transaction
        -- ends, so no refresh moves it past rows it cannot see yet
        PERFORM 1 FROM enrichq.queue_heads AS h
        WHERE h.kind = pair.kind AND h.tenant = pair.tenant AND h.oldest <= pair.oldest
        FOR KEY SHARE OF h;
        -- else a new head, or one that moves earlier: due at once, and in the claim order
        -- meanwhile (at the top, until the next claim evaluates it: a claim that runs while
        -- another one evaluates it still sees the pair)
        -- (backfill work below every plan: evaluated or not, it never ranks above them)
        IF NOT FOUND THEN
            INSERT INTO enrichq.queue_heads AS h (kind, tenant, oldest, behind, due_at)
            VALUES (
                pair.kind, pair.tenant, pair.oldest,
                CASE WHEN pair.kind = 'backfill' THEN 32767 ELSE 0 END, '-infinity'
            )
            ON CONFLICT (kind, tenant) DO UPDATE
            SET oldest = least(h.oldest, excluded.oldest),
                behind = coalesce(h.behind, excluded.behind),
                due_at = excluded.due_at;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
CREATE TRIGGER queue_heads_on_insert AFTER INSERT ON enrichq.queue
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT
    EXECUTE FUNCTION enrichq.queue_heads_note();
CREATE TRIGGER queue_heads_on_update AFTER UPDATE ON enrichq.queue
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT
    EXECUTE FUNCTION enrichq.queue_heads_note();
"""

REFRESH = """
CREATE FUNCTION enrichq.queue_heads_refresh(
    p_kinds text[], p_pair_kinds text[], p_pair_tenants text[], p_now timestamptz,
    p_aging float8, p_top int, p_middle int, p_due_batch int, p_recheck float8
) RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    took_kinds text[];
    took_tenants text[];
    sure_kinds text[];
    sure_tenants text[];
    n int;
BEGIN
    -- the heads to evaluate: the pairs given (a claim took rows of them) and the due ones of
    -- p_kinds, soonest first; one another claim is evaluating is left to it
    SELECT coalesce(array_agg(l.kind), '{}'), coalesce(array_agg(l.tenant), '{}')
    INTO took_kinds, took_tenants
    FROM (
        SELECT h.kind, h.tenant
        FROM (
            SELECT g.kind, g.tenant FROM unnest(p_pair_kinds, p_pair_tenants) AS g (kind, tenant)
            UNION
            (SELECT d.kind, d.tenant FROM enrichq.queue_heads AS d
             WHERE d.due_at <= p_now AND d.kind = ANY(p_kinds)
             ORDER BY d.due_at
             LIMIT p_due_batch)
        ) AS w
        -- one probe of the primary key per head
        JOIN enrichq.queue_heads AS h ON h.kind = w.kind AND h.tenant = w.tenant
        FOR NO KEY UPDATE OF h SKIP LOCKED
    ) AS l;
    IF cardinality(took_kinds) = 0 THEN
        RETURN 0;
    END IF;
    -- those no writer holds: their oldest may move later, read by the next statement, whose
    -- snapshot starts after this lock (a writer that comes later waits, then sees the move)
    SELECT coalesce(array_agg(l.kind), '{}'), coalesce(array_agg(l.tenant), '{}')
    INTO sure_kinds, sure_tenants
    FROM (
        SELECT h.kind, h.tenant
        FROM enrichq.queue_heads AS h
        WHERE (h.kind, h.tenant) IN (
                  SELECT t.kind, t.tenant FROM unnest(took_kinds, took_tenants) AS t (kind, tenant)
              )
        FOR UPDATE OF h SKIP LOCKED
    ) AS l;
    UPDATE enrichq.queue_heads AS h
    SET oldest = e.oldest,
        behind = p_top - e.level,
        served = e.served,
        due_at = least(
            -- visible, or one aging step further
            CASE WHEN e.level IS NULL THEN e.oldest
                 WHEN e.level < p_top THEN e.oldest + make_interval(secs => least(
                     (floor(extract(epoch FROM p_now - e.oldest) / p_aging) + 1) * p_aging,
                     1e11))
            END,
            -- the oldest served hour counted leaves the day
            e.first_bucket + interval '1 day',
            -- and a look now and then (a plan changed, a head no one could move yet)
            CASE WHEN e.oldest < 'infinity' THEN
                p_now + make_interval(secs => p_recheck * (0.5 + random() / 2))
            END)
    FROM (
        SELECT t.kind, t.tenant, o.oldest,
               -- backfill work (`enrichq backfill`) a level below every plan, never aged:
               -- it is served when nothing else is visible
               CASE WHEN o.oldest > p_now THEN NULL
                    WHEN t.kind = 'backfill' THEN -1
                    ELSE least(
                   p_top,
                   coalesce((SELECT p.priority FROM enrichq.tenants AS p
                             WHERE p.tenant = t.tenant AND t.tenant <> ''), p_middle)
                   + floor(extract(epoch FROM p_now - o.oldest) / p_aging)) END AS level,
               s.served, s.first_bucket
        FROM unnest(took_kinds, took_tenants) AS t (kind, tenant)
        JOIN enrichq.queue_heads AS c ON c.kind = t.kind AND c.tenant = t.tenant
        CROSS JOIN LATERAL (
            SELECT CASE
                -- held: the oldest row this snapshot sees, or earlier
                WHEN NOT (t.kind, t.tenant) IN (
                        SELECT u.kind, u.tenant
                        FROM unnest(sure_kinds, sure_tenants) AS u (kind, tenant))
                    THEN least(c.oldest, r.visible_at)
                -- sure: exactly the oldest queued row ('infinity': none)
                ELSE coalesce(r.visible_at, 'infinity') END AS oldest
            FROM (SELECT 1) AS one
            LEFT JOIN LATERAL (
                SELECT q.visible_at FROM enrichq.queue AS q
                WHERE q.state = 'queued' AND q.kind = t.kind
                  AND coalesce(q.tenant, '') = t.tenant
                ORDER BY q.visible_at
                LIMIT 1
            ) AS r ON true
        ) AS o
        CROSS JOIN LATERAL (
            SELECT coalesce(sum(b.served), 0) AS served, min(b.bucket) AS first_bucket
            FROM enrichq.tenant_served AS b
            WHERE b.kind = t.kind AND b.tenant = t.tenant
              AND b.bucket > p_now - interval '1 day'
        ) AS s
    ) AS e
    WHERE h.kind = e.kind AND h.tenant = e.tenant;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;
"""

BACKFILL = """
INSERT INTO enrichq.queue_heads (kind, tenant, oldest, behind, due_at)
SELECT q.kind, coalesce(q.tenant, ''), min(q.visible_at), 0, '-infinity'
FROM enrichq.queue AS q
WHERE q.state = 'queued'
GROUP BY 1, 2
"""


def upgrade() -> None:
    """The heads table, its triggers and refresh, and a head for every pair queued now."""
    op.create_table(
        "queue_heads",
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("oldest", sa.DateTime(timezone=True), nullable=False),
        sa.Column("behind", sa.SmallInteger(), nullable=True),
        sa.Column("served", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("kind", "tenant", name=op.f("queue_heads_pkey")),
        schema=SCHEMA,
    )
    op.create_index(
        "queue_heads_order_idx",
        "queue_heads",
        ["behind", "served", "oldest", "kind", "tenant"],
        unique=False,
        schema=SCHEMA,
        postgresql_where=sa.text("behind IS NOT NULL"),
    )
    op.create_index("queue_heads_due_idx", "queue_heads", ["due_at"], unique=False, schema=SCHEMA)
    op.execute(NOTE)
    op.execute(REFRESH)
    op.execute(BACKFILL)


def downgrade() -> None:
    """Back to a claim that walks every pair: no heads, no triggers."""
    op.execute("DROP TRIGGER queue_heads_on_update ON enrichq.queue")
    op.execute("DROP TRIGGER queue_heads_on_insert ON enrichq.queue")
    op.execute(
        "DROP FUNCTION enrichq.queue_heads_refresh(text[], text[], text[], timestamptz, float8,"
        " int, int, int, float8)"
    )
    op.execute("DROP FUNCTION enrichq.queue_heads_note()")
    op.drop_index("queue_heads_due_idx", table_name="queue_heads", schema=SCHEMA)
    op.drop_index("queue_heads_order_idx", table_name="queue_heads", schema=SCHEMA)
    op.drop_table("queue_heads", schema=SCHEMA)
