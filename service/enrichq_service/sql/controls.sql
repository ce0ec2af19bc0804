-- Operator controls over the queue: cancel (queued/leased → dead_letter, reason
-- `cancelled`), dlq discard (deleted) and dlq redrive (→ queued), chosen by one filter
-- (enrichq_service.controls.filters): ids read page by page in one snapshot, then worked
-- in batches that lock in the global order and check the filter again; and the dead-letter
-- listing. Every statement takes :now (NULL = the database clock).


-- fragment: keys_tenant_kind
-- The filter's criteria that read the same columns in either scope.
AND (CAST(:keys AS text[]) IS NULL OR q.key = ANY(CAST(:keys AS text[])))
AND (CAST(:tenant AS text) IS NULL OR q.tenant = CAST(:tenant AS text))
AND (CAST(:kind AS text) IS NULL OR q.kind = CAST(:kind AS text))


-- fragment: open_filter
-- The filter on a queued or leased row: `reason` is why it was enqueued, and its age runs
-- from when it was created.
{{keys_tenant_kind}}
AND (CAST(:reason AS text) IS NULL OR q.reason = CAST(:reason AS text))
AND (CAST(:older_than_seconds AS float8) IS NULL
     OR q.created_at < coalesce(CAST(:now AS timestamptz), now())
                       - make_interval(secs => CAST(:older_than_seconds AS float8)))


-- fragment: dead_filter
-- The filter on a dead letter: `reason` is why it died, and its age runs from when it did.
{{keys_tenant_kind}}
AND (CAST(:reason AS text) IS NULL OR q.dead_reason = CAST(:reason AS text))
AND (CAST(:older_than_seconds AS float8) IS NULL
     OR q.finished_at < coalesce(CAST(:now AS timestamptz), now())
                        - make_interval(secs => CAST(:older_than_seconds AS float8)))


-- fragment: page_ids_and_cursor
-- The one row a page of open rows returns (from its `page` CTE, numbered n in its index's
-- order): their ids in that order, how many, and the last one's (kind, key), the cursor.
last AS (
    SELECT p.kind, p.key FROM page AS p ORDER BY p.n DESC LIMIT 1
)
SELECT coalesce((SELECT array_agg(p.id ORDER BY p.n) FROM page AS p), '{}') AS ids,
       (SELECT count(*) FROM page) AS n,
       (SELECT kind FROM last) AS last_kind, (SELECT key FROM last) AS last_key


-- name: controls_page_queued
-- The next :page_size queued rows matching the filter after the cursor (:after_kind,
-- :after_key; NULL: from the start), in the order of the queued-key index, which the page
-- walks: a page reads the rows it returns (and those its filter skips), never the history.
-- One row: their ids in that order, how many, and the last one's (kind, key), the cursor.
-- (Rows are numbered in the index's order, so nothing sorts their text again.)
WITH page AS (
    SELECT q.id, q.kind, q.key, row_number() OVER (ORDER BY q.kind, q.key) AS n
    FROM enrichq.queue AS q
    WHERE q.state = 'queued'
      AND (CAST(:after_key AS text) IS NULL
           OR (q.kind, q.key) > (CAST(:after_kind AS text), CAST(:after_key AS text)))
      AND (CAST(:ids AS bigint[]) IS NULL OR q.id = ANY(CAST(:ids AS bigint[])))
      {{open_filter}}
    ORDER BY q.kind, q.key
    LIMIT :page_size
),
{{page_ids_and_cursor}}


-- name: controls_page_leased
-- The next :page_size leased rows matching the filter after the cursor (:after_key; NULL:
-- from the start), in the order of the leased-key index (one lease per key). One row, as
-- controls_page_queued.
WITH page AS (
    SELECT q.id, q.kind, q.key, row_number() OVER (ORDER BY q.key) AS n
    FROM enrichq.queue AS q
    WHERE q.state = 'leased'
      AND (CAST(:after_key AS text) IS NULL OR q.key > CAST(:after_key AS text))
      AND (CAST(:ids AS bigint[]) IS NULL OR q.id = ANY(CAST(:ids AS bigint[])))
      {{open_filter}}
    ORDER BY q.key
    LIMIT :page_size
),
{{page_ids_and_cursor}}


-- name: controls_page_dead
-- The next :page_size dead letters matching the filter after the cursor (:after_key,
-- :after_kind, :after_id; NULL: from the start), walking the dead-letter key index
-- backwards: a ticket's dead letters come together, its newest first (the one a redrive
-- queues again). One row: their ids in that order and, for each, the first (newest) id of
-- its ticket within the page (a ticket cut by the page's start has its newest on an
-- earlier page: the caller carries it over), how many, the first row's (kind, key) and
-- the last row's (key, kind, id), the cursor. Rows are numbered in the index's order and
-- tickets told apart by comparing neighbours, so nothing sorts their text again.
WITH page AS (
    SELECT q.id, q.kind, q.key,
           row_number() OVER (ORDER BY q.key DESC, q.kind DESC, q.id DESC) AS n
    FROM enrichq.queue AS q
    WHERE q.state = 'dead_letter'
      AND (CAST(:after_key AS text) IS NULL
           OR (q.key, q.kind, q.id)
              < (CAST(:after_key AS text), CAST(:after_kind AS text), CAST(:after_id AS bigint)))
      AND (CAST(:ids AS bigint[]) IS NULL OR q.id = ANY(CAST(:ids AS bigint[])))
      {{dead_filter}}
    ORDER BY q.key DESC, q.kind DESC, q.id DESC
    LIMIT :page_size
),
-- a row whose ticket differs from the row before starts a ticket
marked AS (
    SELECT p.id, p.n,
           (p.kind, p.key) IS DISTINCT FROM (lag(p.kind) OVER w, lag(p.key) OVER w) AS starts
    FROM page AS p
    WINDOW w AS (ORDER BY p.n)
),
grouped AS (
    SELECT m.id, m.n, count(*) FILTER (WHERE m.starts) OVER (ORDER BY m.n) AS ticket
    FROM marked AS m
),
ranked AS (
    SELECT g.id, g.n, first_value(g.id) OVER (PARTITION BY g.ticket ORDER BY g.n) AS winner
    FROM grouped AS g
),
first AS (
    SELECT p.kind, p.key FROM page AS p WHERE p.n = 1
),
last AS (
    SELECT p.kind, p.key, p.id FROM page AS p ORDER BY p.n DESC LIMIT 1
)
SELECT coalesce((SELECT array_agg(r.id ORDER BY r.n) FROM ranked AS r), '{}') AS ids,
       coalesce((SELECT array_agg(r.winner ORDER BY r.n) FROM ranked AS r), '{}') AS winners,
       (SELECT count(*) FROM page) AS n,
       (SELECT kind FROM first) AS first_kind, (SELECT key FROM first) AS first_key,
       (SELECT kind FROM last) AS last_kind, (SELECT key FROM last) AS last_key,
       (SELECT id FROM last) AS last_id;


-- name: controls_redrive_preview
-- Of the dead letters :winners (each the newest match of its ticket), how many a redrive
-- would queue again now: those whose ticket has no queued row (the others would merge).
SELECT count(*) AS redriven
FROM enrichq.queue AS q
WHERE q.id = ANY(CAST(:winners AS bigint[]))
  AND q.state = 'dead_letter'
  AND NOT EXISTS (
      SELECT 1 FROM enrichq.queue AS o
      WHERE o.state = 'queued' AND o.kind = q.kind AND o.key = q.key);


-- name: controls_snapshot
-- Makes the rest of the transaction read one snapshot, and only read: a selection's pages
-- then see the queue as it was when the first one ran.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY;


-- name: controls_clock
-- When the action began (:now, NULL = the database clock).
SELECT coalesce(CAST(:now AS timestamptz), now()) AS started;


-- name: controls_open_ids
-- Which of :ids are queued or leased (for `--id`: an id that is not is refused by name).
SELECT q.id
FROM enrichq.queue AS q
WHERE q.id = ANY(CAST(:ids AS bigint[])) AND q.state IN ('queued', 'leased');


-- name: controls_dead_ids
-- Which of :ids are dead letters (for `--id`: an id that is not is refused by name).
SELECT q.id
FROM enrichq.queue AS q
WHERE q.id = ANY(CAST(:ids AS bigint[])) AND q.state = 'dead_letter';


-- name: controls_sample
-- The rows :ids (what a dry run shows), in the order of :ids.
SELECT q.id, q.kind, q.key, q.tenant, q.state, q.reason, q.dead_reason, q.attempts,
       q.max_attempts, q.lease_owner, q.created_at, q.finished_at
FROM unnest(CAST(:ids AS bigint[])) WITH ORDINALITY AS s(id, ord)
JOIN enrichq.queue AS q ON q.id = s.id
ORDER BY s.ord;


-- name: controls_cancel_batch
-- queued/leased → dead_letter (cancelled) for the rows of :batch_ids that still match the
-- filter; returns how many were queued and how many leased, and how many queued rows were
-- kept because an event merged into them at or after :started (when the action began:
-- that work arrived after the operator acted, and survives). A leased row leaves `leased`,
-- which is what fences its worker: every heartbeat and settle matches state = 'leased', so
-- the worker's later writes are refused and its result is never written. The lease columns
-- are cleared and finished_at set, as for every terminal row (the table's CHECKs).
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
-- locked in the queue's lock order; a row a worker settled while this waited is checked
-- again on its new version (READ COMMITTED) and left alone when it no longer matches
-- (a merge locks the row it marks, so the mark is read here on the row's newest version)
chosen AS (
    SELECT q.id, q.state AS was,
           (q.state = 'queued' AND q.merged_at >= CAST(:started AS timestamptz)) AS merged
    FROM enrichq.queue AS q
    WHERE q.id = ANY(CAST(:batch_ids AS bigint[]))
      AND q.state IN ('queued', 'leased')
      {{open_filter}}
    ORDER BY q.key COLLATE "C", q.kind COLLATE "C", q.id
    FOR UPDATE OF q
),
cancelled AS (
    UPDATE enrichq.queue AS q
    SET state = 'dead_letter', dead_reason = 'cancelled', superseded_by = NULL,
        finished_at = clock.now, updated_at = clock.now,
        lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
    FROM chosen, clock
    WHERE q.id = chosen.id AND chosen.merged IS NOT TRUE
    RETURNING chosen.was
)
SELECT count(*) FILTER (WHERE c.was = 'queued') AS queued,
       count(*) FILTER (WHERE c.was = 'leased') AS leased,
       (SELECT count(*) FROM chosen AS k WHERE k.merged) AS kept
FROM cancelled AS c;


-- name: controls_discard_batch
-- Deletes the dead letters of :batch_ids that still match the filter; returns how many.
WITH chosen AS (
    SELECT q.id
    FROM enrichq.queue AS q
    WHERE q.id = ANY(CAST(:batch_ids AS bigint[]))
      AND q.state = 'dead_letter'
      {{dead_filter}}
    ORDER BY q.key COLLATE "C", q.kind COLLATE "C", q.id
    FOR UPDATE OF q
),
deleted AS (
    DELETE FROM enrichq.queue AS q
    USING chosen
    WHERE q.id = chosen.id
    RETURNING q.id
)
SELECT count(*) AS discarded FROM deleted;


-- name: controls_redrive_batch
-- dead_letter → queued (visible now, attempts 0, reason redrive) for the dead letters of
-- :batch_ids that still match the filter, merging like enqueue: a row is redriven when it
-- is the newest match of its (kind, key) (:winners[i] is that id for :batch_ids[i]) and
-- the key has no queued row; the others stay dead (merged). Returns how many of each.
-- last_error is kept: it says why the row died until its next attempt says otherwise.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
batch AS (
    SELECT b.id, b.winner
    FROM unnest(CAST(:batch_ids AS bigint[]), CAST(:winners AS bigint[])) AS b(id, winner)
),
chosen AS (
    SELECT q.id, q.kind, q.key, b.winner
    FROM enrichq.queue AS q
    JOIN batch AS b ON b.id = q.id
    WHERE q.state = 'dead_letter'
      {{dead_filter}}
    ORDER BY q.key COLLATE "C", q.kind COLLATE "C", q.id
    FOR UPDATE OF q
),
-- the batch's keys' queued rows, one index probe per key; one queued after this
-- statement's snapshot shows up as a unique violation instead, and the caller runs the
-- statement again (enrichq_schema.db.rerun_lost_races)
queued AS (
    SELECT o.id, o.kind, o.key
    FROM (SELECT DISTINCT c.kind, c.key FROM chosen AS c) AS k
    CROSS JOIN LATERAL (
        SELECT q.id, q.kind, q.key FROM enrichq.queue AS q
        WHERE q.state = 'queued' AND q.kind = k.kind AND q.key = k.key
    ) AS o
),
decided AS (
    SELECT c.id, c.kind, (qd.id IS NULL AND c.id = c.winner) AS redrive
    FROM chosen AS c
    LEFT JOIN queued AS qd ON qd.kind = c.kind AND qd.key = c.key
),
redriven AS (
    UPDATE enrichq.queue AS q
    SET state = 'queued', attempts = 0, reason = 'redrive', visible_at = clock.now,
        dead_reason = NULL, superseded_by = NULL, finished_at = NULL, updated_at = clock.now,
        lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
    FROM decided AS d, clock
    WHERE q.id = d.id AND d.redrive
    RETURNING q.kind
),
-- wake LISTENing workers once per kind that got work back (delivered at commit)
notified AS (
    SELECT count(pg_notify(:channel, k.kind)) AS n
    FROM (SELECT DISTINCT r.kind FROM redriven AS r) AS k
)
SELECT count(*) FILTER (WHERE d.redrive) AS redriven,
       count(*) FILTER (WHERE NOT d.redrive) AS merged
FROM decided AS d
CROSS JOIN notified;


-- name: controls_pause
-- Pauses claims of one scope (:kind, :tenant; NULL = every kind / every tenant). Pausing a
-- scope that is already paused keeps its start (the age alerts read) and who paused it, and
-- takes the new reason if one is given. `created` says which happened.
INSERT INTO enrichq.pauses AS p (kind, tenant, reason, paused_by, paused_at)
VALUES (:kind, :tenant, :reason, :actor, coalesce(CAST(:now AS timestamptz), now()))
ON CONFLICT ON CONSTRAINT pauses_kind_tenant_key
DO UPDATE SET reason = coalesce(EXCLUDED.reason, p.reason)
RETURNING p.kind, p.tenant, p.reason, p.paused_by, p.paused_at, (p.xmax = 0) AS created;


-- name: controls_scope_seen
-- Whether work of :kinds (every kind a pause names) and :tenant (NULL: any) was ever seen:
-- a tenant with a plan, claims counted for it (the fairness buckets), or open rows of it
-- (through the claim index: ownerless work is tenant ''). A pause of a scope never seen
-- may stop nothing (a misspelt tenant).
SELECT EXISTS (
           SELECT 1 FROM enrichq.tenants AS t
           WHERE CAST(:tenant AS text) IS NOT NULL AND t.tenant = CAST(:tenant AS text))
       OR EXISTS (
           SELECT 1 FROM enrichq.tenant_served AS s
           WHERE s.kind = ANY(CAST(:kinds AS text[]))
             AND (CAST(:tenant AS text) IS NULL OR s.tenant = CAST(:tenant AS text)))
       OR EXISTS (
           SELECT 1 FROM enrichq.queue AS q
           WHERE q.state = 'queued' AND q.kind = ANY(CAST(:kinds AS text[]))
             AND (CAST(:tenant AS text) IS NULL
                  OR coalesce(q.tenant, '') = CAST(:tenant AS text)))
       OR EXISTS (
           SELECT 1 FROM enrichq.queue AS q
           WHERE q.state = 'leased' AND q.kind = ANY(CAST(:kinds AS text[]))
             AND (CAST(:tenant AS text) IS NULL OR q.tenant = CAST(:tenant AS text)))
       AS seen;


-- name: controls_resume
-- Resumes one scope exactly as it was paused (the pause of every kind of tenant acme is
-- not resumed by resuming kind enrich alone); the pauses deleted.
DELETE FROM enrichq.pauses
WHERE kind IS NOT DISTINCT FROM :kind AND tenant IS NOT DISTINCT FROM :tenant
RETURNING kind, tenant, reason, paused_by, paused_at;


-- name: controls_resume_all
-- Resumes every pause; the pauses deleted.
DELETE FROM enrichq.pauses
RETURNING kind, tenant, reason, paused_by, paused_at;


-- name: controls_pauses
-- Every pause in place, oldest first, with its age on the database clock.
SELECT kind, tenant, reason, paused_by, paused_at,
       CAST(extract(epoch FROM coalesce(CAST(:now AS timestamptz), now()) - paused_at)
            AS float8) AS age_seconds
FROM enrichq.pauses
ORDER BY paused_at, id;


-- name: dlq_list
-- Dead letters, newest id first, at most :limit, each with the state of the row that
-- superseded it (NULL when retention has pruned that row: dead letters outlive it). The
-- newest :limit of each dead reason (:reasons, every one there is) are read through the
-- index by reason and id, and merged: never the table's id order, which walks the whole
-- history back to the newest dead letter.
SELECT q.id, q.kind, q.key, q.tenant, q.reason, q.dead_reason, q.superseded_by,
       (SELECT w.state FROM enrichq.queue AS w WHERE w.id = q.superseded_by)
           AS superseded_by_state,
       q.attempts, q.max_attempts, q.last_error, q.finished_at, q.created_at
FROM unnest(CAST(:reasons AS text[])) AS r(dead_reason)
CROSS JOIN LATERAL (
    SELECT d.id FROM enrichq.queue AS d
    WHERE d.state = 'dead_letter' AND d.dead_reason = r.dead_reason
    ORDER BY d.id DESC
    LIMIT :limit
) AS newest
JOIN enrichq.queue AS q ON q.id = newest.id
ORDER BY q.id DESC
LIMIT :limit;


-- name: dlq_list_by_reason
-- Dead letters with dead_reason :reason, newest id first, at most :limit, each with the
-- state of the row that superseded it (NULL when retention has pruned that row).
SELECT q.id, q.kind, q.key, q.tenant, q.reason, q.dead_reason, q.superseded_by,
       (SELECT w.state FROM enrichq.queue AS w WHERE w.id = q.superseded_by)
           AS superseded_by_state,
       q.attempts, q.max_attempts, q.last_error, q.finished_at, q.created_at
FROM enrichq.queue AS q
WHERE q.state = 'dead_letter' AND q.dead_reason = :reason
ORDER BY q.id DESC
LIMIT :limit;
