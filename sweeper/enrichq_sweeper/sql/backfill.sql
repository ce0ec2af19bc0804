-- The backfill (`enrichq backfill`): enqueue every ticket consumers can read that enrichq
-- never enriched, a page at a time. {tickets} and {legacy} are the configured tables,
-- quoted by enrichq_schema.identifiers (identifiers cannot be bound parameters).

-- name: backfill_count
-- How many tickets a backfill walks: the mirror's (of tenant :tenant, '' = none; NULL: every
-- tenant) created at or after :since (NULL: all), then, with no tenant asked for, the
-- legacy table's tickets (looked up at or after :since), each page of which it reads to find
-- those the mirror lacks. For the progress bar.
SELECT (
    SELECT count(*) FROM {tickets} AS t
    WHERE (CAST(:tenant AS text) IS NULL OR coalesce(CAST(t.tenant AS text), '') = :tenant)
      AND (CAST(:since AS timestamptz) IS NULL OR t.created_at >= CAST(:since AS timestamptz))
) + (
    SELECT count(DISTINCT l.ticket_id)
    FROM {legacy} AS l
    WHERE CAST(:tenant AS text) IS NULL
      AND (CAST(:since AS timestamptz) IS NULL OR l.looked_up_at >= CAST(:since AS timestamptz))
) AS tickets

-- fragment: never_enriched_and_not_open
-- Which never-enriched tickets (`never AS n`) a page enqueues: those with an id a queue key
-- can hold and no open queue row of any kind (that row enriches them anyway).
    WHERE char_length(n.key) BETWEEN 1 AND :key_max_length
      AND NOT EXISTS (SELECT 1 FROM enrichq.queue AS o WHERE o.state = 'queued' AND o.key = n.key)
      AND NOT EXISTS (SELECT 1 FROM enrichq.queue AS o WHERE o.state = 'leased' AND o.key = n.key)

-- fragment: enqueue_due
-- Where a page's backfill rows come from: its due tickets (none on a dry run), inserted
-- in the global lock order, each at most once.
    FROM due AS d
    CROSS JOIN clock
    WHERE NOT CAST(:dry_run AS boolean)
    ORDER BY d.key COLLATE "C"
    ON CONFLICT DO NOTHING
    RETURNING q.id

-- name: backfill_mirror_page
-- One page of the mirror's tickets (tenant :tenant, NULL: every one; created at or after
-- :since, NULL: all), the :page_size after the id :after in id order. Enqueues a backfill
-- row (visible now, the lowest priority) for each that enrichq never enriched and that has
-- no open queue row of any kind (that row enriches it anyway), unless :dry_run. Returns the
-- page's size (twice: scanned, walked), how many were never enriched, how many of those went in (dry run: would), and
-- where the next page starts.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
page AS MATERIALIZED (
    SELECT CAST(t.id AS text) AS key, CAST(t.tenant AS text) AS tenant
    FROM {tickets} AS t
    WHERE CAST(t.id AS text) > CAST(:after AS text)
      AND (CAST(:tenant AS text) IS NULL OR coalesce(CAST(t.tenant AS text), '') = :tenant)
      AND (CAST(:since AS timestamptz) IS NULL OR t.created_at >= CAST(:since AS timestamptz))
    ORDER BY CAST(t.id AS text)
    LIMIT :page_size
),
never AS MATERIALIZED (
    SELECT p.key, p.tenant
    FROM page AS p
    WHERE NOT EXISTS (SELECT 1 FROM enrichq.ticket_enrichments AS e WHERE e.ticket_id = p.key)
),
due AS (
    SELECT n.key, n.tenant
    FROM never AS n
    {{never_enriched_and_not_open}}
),
-- in the global lock order, like every enqueue
inserted AS (
    INSERT INTO enrichq.queue AS q
        (kind, key, tenant, priority, reason, state, visible_at, attempts, max_attempts)
    SELECT 'backfill', d.key, nullif(d.tenant, ''), :priority, 'manual', 'queued', clock.now, 0,
           :max_attempts
    {{enqueue_due}}
)
SELECT (SELECT count(*) FROM page) AS scanned,
       (SELECT count(*) FROM page) AS walked,
       (SELECT count(*) FROM never) AS never_enriched,
       CASE WHEN CAST(:dry_run AS boolean) THEN (SELECT count(*) FROM due)
            ELSE (SELECT count(*) FROM inserted) END AS enqueued,
       (SELECT max(key) FROM page) AS last_key

-- name: backfill_legacy_page
-- One page of the tickets with rows in {legacy} (looked up at or after :since, NULL: all)
-- that the mirror lacks, the :page_size ticket ids after :after in id order (an index scan
-- of the legacy table's ticket_id index); enqueues them like backfill_mirror_page, with no
-- tenant. The worker retries such a ticket until the mirror has it. `walked`: the ids the
-- page read (a short page is the last), `scanned`: those the mirror lacks.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
ids AS MATERIALIZED (
    SELECT DISTINCT CAST(l.ticket_id AS text) AS key
    FROM {legacy} AS l
    WHERE CAST(l.ticket_id AS text) > CAST(:after AS text)
      AND (CAST(:since AS timestamptz) IS NULL OR l.looked_up_at >= CAST(:since AS timestamptz))
    ORDER BY 1
    LIMIT :page_size
),
page AS MATERIALIZED (
    SELECT i.key FROM ids AS i
    WHERE NOT EXISTS (SELECT 1 FROM {tickets} AS t WHERE CAST(t.id AS text) = i.key)
),
never AS MATERIALIZED (
    SELECT p.key
    FROM page AS p
    WHERE NOT EXISTS (SELECT 1 FROM enrichq.ticket_enrichments AS e WHERE e.ticket_id = p.key)
),
due AS (
    SELECT n.key
    FROM never AS n
    {{never_enriched_and_not_open}}
),
inserted AS (
    INSERT INTO enrichq.queue AS q
        (kind, key, tenant, priority, reason, state, visible_at, attempts, max_attempts)
    SELECT 'backfill', d.key, NULL, :priority, 'manual', 'queued', clock.now, 0, :max_attempts
    {{enqueue_due}}
)
SELECT (SELECT count(*) FROM page) AS scanned,
       (SELECT count(*) FROM ids) AS walked,
       (SELECT count(*) FROM never) AS never_enriched,
       CASE WHEN CAST(:dry_run AS boolean) THEN (SELECT count(*) FROM due)
            ELSE (SELECT count(*) FROM inserted) END AS enqueued,
       (SELECT max(key) FROM ids) AS last_key

-- name: backfill_notify
-- Wakes LISTENing workers for backfill work on :channel (delivered at commit).
SELECT pg_notify(:channel, 'backfill')
