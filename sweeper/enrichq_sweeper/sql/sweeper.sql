-- The sweeper's statements: sweep, redrive, prune, the refresh schedule, the run log.
-- Every statement takes :now (NULL = the database clock). Batched writes lock their rows in
-- id order, like the queue's own statements, so a batch and a settle never deadlock.


-- name: sweeper_statement_timeout
-- Sets statement_timeout (milliseconds, as text) for the rest of the transaction only, and
-- plans every statement for its own parameters: psycopg prepares a statement after a few
-- runs, and the generic plan Postgres then picks for a batch of keys it cannot see is
-- measured to be 5-20x slower than the plan for the actual batch.
SELECT set_config('statement_timeout', :timeout_ms, true),
       set_config('plan_cache_mode', 'force_custom_plan', true);


-- name: leader_session_settings
-- Makes the server end the leader's session, and so free its lock, when the leader goes
-- silent: idle for :idle_ms, or its TCP peer unanswering (keepalives after
-- :keepalives_idle s, every :keepalives_interval s, :keepalives_count probes; data
-- unacknowledged for :user_timeout_ms). For the rest of the session.
SELECT set_config('idle_session_timeout', :idle_ms, false),
       set_config('tcp_keepalives_idle', :keepalives_idle, false),
       set_config('tcp_keepalives_interval', :keepalives_interval, false),
       set_config('tcp_keepalives_count', :keepalives_count, false),
       set_config('tcp_user_timeout', :user_timeout_ms, false);


-- name: sweeper_advisory_lock
-- Tries the session-level lock that makes one sweeper the leader; true when held.
SELECT pg_try_advisory_lock(CAST(:lock_id AS bigint));


-- name: sweeper_advisory_unlock
-- Releases the leader lock (it is also released when the session ends).
SELECT pg_advisory_unlock(CAST(:lock_id AS bigint));


-- name: leader_lease_take
-- Takes the lease row :name for :owner until :ttl_seconds from now when it is free, has
-- run out, or is :owner's already (a renewal); returns its new expiry when :owner leads
-- now, no row when someone else does.
INSERT INTO enrichq.leader_leases AS l (name, owner, acquired_at, renewed_at, expires_at)
VALUES (
    :name,
    :owner,
    coalesce(CAST(:now AS timestamptz), now()),
    coalesce(CAST(:now AS timestamptz), now()),
    coalesce(CAST(:now AS timestamptz), now())
        + make_interval(secs => CAST(:ttl_seconds AS double precision))
)
ON CONFLICT (name) DO UPDATE
SET owner = excluded.owner,
    acquired_at = CASE WHEN l.owner = excluded.owner THEN l.acquired_at
                       ELSE excluded.acquired_at END,
    renewed_at = excluded.renewed_at,
    expires_at = excluded.expires_at
WHERE l.owner = excluded.owner OR l.expires_at <= excluded.renewed_at
RETURNING l.expires_at;


-- name: leader_lease_release
-- Gives the lease row :name up if :owner holds it, so another replica may lead at once.
DELETE FROM enrichq.leader_leases WHERE name = :name AND owner = :owner;


-- name: recovery_scan
-- Up to :batch_size expired leases after id :after_id, lowest id first (the cursor).
SELECT q.id, q.kind, q.key, q.attempts, q.max_attempts
FROM enrichq.queue AS q
WHERE q.state = 'leased'
  AND q.lease_expires_at < coalesce(CAST(:now AS timestamptz), now())
  AND q.id > :after_id
ORDER BY q.id
LIMIT :batch_size;


-- name: recovery_scan_page
-- The page `recovery_scan` reads, as one row: its ids in the global lock order of queue
-- rows, (key, kind, id) in byte order (COLLATE "C" compares bytes, as `lock_order` does),
-- its last id (the cursor) and its size; ids NULL and n 0 when there is none. What a pass
-- needs of a page, without a row per lease to build and sort in the sweeper.
SELECT array_agg(p.id ORDER BY p.key COLLATE "C", p.kind COLLATE "C", p.id) AS ids,
       max(p.id) AS last_id, count(*) AS n
FROM (
    SELECT q.id, q.kind, q.key
    FROM enrichq.queue AS q
    WHERE q.state = 'leased'
      AND q.lease_expires_at < coalesce(CAST(:now AS timestamptz), now())
      AND q.id > :after_id
    ORDER BY q.id
    LIMIT :batch_size
) AS p;


-- name: recovery_recover_batch
-- Recovers the page's rows (:ids, in (key, kind, id) byte order) that are still expired
-- leases, in one statement, and
-- returns one row per recovered row: its action (promote / supersede / exhaust), the row
-- it was superseded by, and, for a spent row, what the gave-up hook gets. Per row: spent
-- attempts → dead_letter (attempts_exhausted); a key with a queued row of its kind →
-- dead_letter (superseded by that row); else → queued, visible now. (A key has one lease
-- at most, queue_leased_key_uq, so no two expired rows of a key compete.)
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
-- the page's rows as this statement's snapshot sees them, each probed by its primary key
-- (a lateral per id, so no plan can reach the rows through every expired lease instead),
-- numbered in the order the ids come in: the global lock order (key, kind, id). Nothing is
-- locked here: the UPDATE below locks each row once, as it writes it.
seen AS MATERIALIZED (
    SELECT p.ord, r.*
    FROM unnest(CAST(:ids AS bigint[])) WITH ORDINALITY AS p (id, ord)
    CROSS JOIN clock
    CROSS JOIN LATERAL (
        SELECT q.id, q.ctid AS row_at, q.kind, q.key, q.tenant, q.attempts, q.max_attempts,
               q.lease_owner, q.lease_expires_at, q.attempts >= q.max_attempts AS spent
        FROM enrichq.queue AS q
        WHERE q.id = p.id AND q.state = 'leased' AND q.lease_expires_at < clock.now
        -- one row per id anyway; keeps the subquery from being pulled up into a join
        LIMIT 1
    ) AS r
),
-- the keys' queued rows (one per (kind, key) at most): one set of probes of the queued-key
-- index, both its columns bound by arrays built here from the page's rows (not sent by the
-- caller: a thousand keys dumped as a text array cost the sweeper more CPU than the probes
-- cost the server); one queued after this statement's snapshot shows up as a unique
-- violation instead, and the caller runs the statement again
queued AS (
    SELECT o.id, o.kind, o.key
    FROM enrichq.queue AS o
    WHERE o.state = 'queued'
      AND o.kind = ANY(ARRAY(SELECT DISTINCT s.kind FROM seen AS s))
      AND o.key = ANY(ARRAY(SELECT s.key FROM seen AS s))
),
decided AS MATERIALIZED (
    SELECT l.*, CASE WHEN NOT l.spent THEN o.id END AS queued_id
    FROM seen AS l
    LEFT JOIN queued AS o ON o.kind = l.kind AND o.key = l.key
),
-- wake LISTENing workers once per kind that gets work back (delivered at commit)
notified AS (
    SELECT count(pg_notify(:channel, k.kind)) AS n
    FROM (SELECT DISTINCT kind FROM decided WHERE NOT spent AND queued_id IS NULL) AS k
),
-- the UPDATE locks each row as it reaches it, in the lock order (a nested loop over the
-- sorted page, each row by its version: a Tid scan), so a batch and a worker's settle
-- wait for each other but never deadlock, and no row is locked twice (once to lock it,
-- once to write it). A row its worker settled or extended since the snapshot has a newer
-- version, which fails the re-check (READ COMMITTED re-checks the WHERE on it) and is
-- left alone.
updated AS (
    UPDATE enrichq.queue AS q
    SET state = CASE WHEN d.spent OR d.queued_id IS NOT NULL THEN 'dead_letter'
                     ELSE 'queued' END,
        dead_reason = CASE WHEN d.spent THEN 'attempts_exhausted'
                           WHEN d.queued_id IS NOT NULL THEN 'superseded' END,
        superseded_by = d.queued_id,
        finished_at = CASE WHEN d.spent OR d.queued_id IS NOT NULL THEN clock.now END,
        visible_at = CASE WHEN d.spent OR d.queued_id IS NOT NULL THEN q.visible_at
                          ELSE clock.now END,
        last_error = :lease_expired,
        updated_at = clock.now,
        lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
    FROM (SELECT * FROM decided ORDER BY ord) AS d, clock, notified
    WHERE q.ctid = d.row_at AND q.id = d.id
      -- re-checked on a version committed since the snapshot; written as a CASE so that no
      -- index of leased rows can stand in for the Tid scan (and its order)
      AND CASE WHEN q.state = 'leased' THEN q.lease_expires_at < clock.now ELSE false END
    RETURNING q.id, q.payload
)
-- what the gave-up hook gets only for spent rows (NULL for the rest: less to send and parse)
SELECT d.id,
       CASE WHEN d.spent THEN 'exhaust' WHEN d.queued_id IS NOT NULL THEN 'supersede'
            ELSE 'promote' END AS action,
       d.kind, d.queued_id AS winner,
       CASE WHEN d.spent THEN d.key END AS key,
       CASE WHEN d.spent THEN d.tenant END AS tenant,
       CASE WHEN d.spent THEN d.attempts END AS attempts,
       CASE WHEN d.spent THEN d.max_attempts END AS max_attempts,
       CASE WHEN d.spent THEN d.lease_owner END AS lease_owner,
       CASE WHEN d.spent THEN d.lease_expires_at END AS lease_expires_at,
       CASE WHEN d.spent THEN u.payload END AS payload
FROM decided AS d
JOIN updated AS u ON u.id = d.id
ORDER BY d.id;


-- name: queue_notify
-- Wakes LISTENing workers for :kind on :channel (NOTIFY_CHANNEL; delivered when the
-- transaction commits).
SELECT pg_notify(:channel, :kind);


-- name: retention_prune_finished
-- Deletes up to :batch_size done/failed rows finished before :cutoff, oldest first
-- (skipping rows another transaction holds), through queue_finished_idx, which holds no
-- dead letters; returns (state, how many) per state deleted.
WITH doomed AS (
    SELECT q.ctid AS row_at
    FROM enrichq.queue AS q
    WHERE q.state IN ('done', 'failed')
      AND q.finished_at < CAST(:cutoff AS timestamptz)
    ORDER BY q.finished_at
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
-- the locked rows by their row versions: a Tid scan, whatever the size of the table
deleted AS (
    DELETE FROM enrichq.queue AS q
    WHERE q.ctid = ANY(ARRAY(SELECT row_at FROM doomed)) AND q.state IN ('done', 'failed')
    RETURNING q.state
)
SELECT state AS what, count(*) AS n FROM deleted GROUP BY state;


-- name: retention_prune_dead
-- Deletes up to :batch_size dead letters finished before :cutoff, oldest first, through
-- queue_dead_finished_idx; returns ('dead_letter', n).
WITH doomed AS (
    SELECT q.ctid AS row_at
    FROM enrichq.queue AS q
    WHERE q.state = 'dead_letter'
      AND q.finished_at < CAST(:cutoff AS timestamptz)
    ORDER BY q.finished_at
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM enrichq.queue AS q
    WHERE q.ctid = ANY(ARRAY(SELECT row_at FROM doomed)) AND q.state = 'dead_letter'
    RETURNING q.id
)
SELECT 'dead_letter' AS what, count(*) AS n FROM deleted;


-- name: retention_prune_tenant_served
-- Deletes up to :batch_size claim-count buckets older than :cutoff, oldest first (through
-- tenant_served_bucket_idx); returns ('tenant_served', n).
WITH doomed AS (
    SELECT s.ctid AS row_at
    FROM enrichq.tenant_served AS s
    WHERE s.bucket < CAST(:cutoff AS timestamptz)
    ORDER BY s.bucket
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM enrichq.tenant_served AS s
    WHERE s.ctid = ANY(ARRAY(SELECT row_at FROM doomed))
    RETURNING 1
)
SELECT 'tenant_served' AS what, count(*) AS n FROM deleted;


-- name: retention_prune_lookup_log
-- Deletes up to :batch_size lookup-log rows created before :cutoff, oldest first (through
-- lookup_log_created_at_idx); returns ('lookup_log', n).
WITH doomed AS (
    SELECT l.ctid AS row_at
    FROM enrichq.lookup_log AS l
    WHERE l.created_at < CAST(:cutoff AS timestamptz)
    ORDER BY l.created_at
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM enrichq.lookup_log AS l
    WHERE l.ctid = ANY(ARRAY(SELECT row_at FROM doomed))
    RETURNING 1
)
SELECT 'lookup_log' AS what, count(*) AS n FROM deleted;


-- name: retention_prune_runs
-- Deletes up to :batch_size run-log rows that finished before :cutoff, the earliest ended
-- first (through runs_finished_at_idx); returns ('runs', n). A run's age counts from its
-- end: a run longer than the retention keeps its stop reason for the whole retention, and
-- a run not finished (running, or its process died) is never deleted.
WITH doomed AS (
    SELECT r.ctid AS row_at
    FROM enrichq.runs AS r
    WHERE r.finished_at < CAST(:cutoff AS timestamptz)
    ORDER BY r.finished_at
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM enrichq.runs AS r
    WHERE r.ctid = ANY(ARRAY(SELECT row_at FROM doomed))
    RETURNING 1
)
SELECT 'runs' AS what, count(*) AS n FROM deleted;


-- name: retention_cutoff
-- The instant :seconds before :now (the database clock when :now is NULL).
SELECT coalesce(CAST(:now AS timestamptz), now()) - make_interval(secs => CAST(:seconds AS float8));


-- fragment: recently_updated_page
-- The clock, and the page of a walk of the tickets updated in the last
-- :updated_within_seconds, after the cursor (:after_updated_at, :after_id) in (updated_at,
-- id) order, :batch_size of them through the mirror's (updated_at, id) index: what the
-- refresh and the reconcile passes walk.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
page AS MATERIALIZED (
    SELECT CAST(t.id AS text) AS key, t.updated_at,
           -- the ticket's tenant, as ingest takes it (a tenant no enqueue accepts: none)
           CASE WHEN char_length(CAST(t.tenant AS text)) BETWEEN 1 AND :key_max_length
                THEN CAST(t.tenant AS text) END AS tenant
    FROM {tickets_table} AS t
    CROSS JOIN clock
    WHERE t.updated_at >= clock.now - make_interval(secs => CAST(:updated_within_seconds AS float8))
      AND (t.updated_at, CAST(t.id AS text))
          > (CAST(:after_updated_at AS timestamptz), CAST(:after_id AS text))
    ORDER BY t.updated_at, CAST(t.id AS text)
    LIMIT :batch_size
),


-- name: refresh_enqueue_page
-- One page of the refresh schedule: the next :batch_size tickets of {tickets_table}
-- updated in the last :updated_within_seconds, after the cursor (:after_updated_at,
-- :after_id) in (updated_at, id) order. Enqueues a refresh row (visible now, the ticket's
-- tenant and its plan's priority, :priority for ownerless tickets, like any enqueue) for
-- each whose enrichment is older than :enriched_before_seconds, unless the ticket has
-- open work of either kind, or the queue gave up on it after that enrichment (a failed
-- row, or a dead letter other than superseded): such a ticket waits for a redrive, so a
-- poison ticket is never fed to the fleet again. A never-enriched ticket is not refresh's
-- to do: its own enrich row is, or its dead letter. Returns how many rows went in, how
-- many tickets the page held, and where the next page starts.
-- {tickets_table} is an identifier, which cannot be a bound parameter: refresh.py puts in
-- the validated, quoted name from the settings before the text is compiled.
{{recently_updated_page}}
due AS (
    SELECT p.key, p.tenant
    FROM page AS p
    JOIN enrichq.ticket_enrichments AS e ON e.ticket_id = p.key
    CROSS JOIN clock
    WHERE e.enriched_at < clock.now - make_interval(secs => CAST(:enriched_before_seconds AS float8))
      AND char_length(p.key) BETWEEN 1 AND :key_max_length
      -- a queued or running job of either kind enriches the ticket anyway
      AND NOT EXISTS (
          SELECT 1 FROM enrichq.queue AS o
          WHERE o.state = 'queued' AND o.kind IN ('enrich', 'refresh') AND o.key = p.key)
      AND NOT EXISTS (
          SELECT 1 FROM enrichq.queue AS o WHERE o.state = 'leased' AND o.key = p.key)
      AND NOT EXISTS (
          SELECT 1 FROM enrichq.queue AS g
          WHERE (g.state = 'failed' OR (g.state = 'dead_letter' AND g.dead_reason <> 'superseded'))
            AND g.key = p.key AND g.id > e.queue_id)
),
-- in the global lock order, like every enqueue
inserted AS (
    INSERT INTO enrichq.queue AS q
        (kind, key, tenant, priority, reason, state, visible_at, attempts, max_attempts)
    SELECT 'refresh', d.key, d.tenant, coalesce(t.priority, :priority), 'refresh', 'queued',
           clock.now, 0, :max_attempts
    FROM due AS d
    CROSS JOIN clock
    LEFT JOIN enrichq.tenants AS t ON t.tenant = d.tenant
    ORDER BY d.key COLLATE "C"
    ON CONFLICT DO NOTHING
    RETURNING q.id
),
last AS (
    SELECT p.updated_at, p.key FROM page AS p ORDER BY p.updated_at DESC, p.key DESC LIMIT 1
)
SELECT (SELECT count(*) FROM inserted) AS inserted,
       (SELECT count(*) FROM page) AS scanned,
       (SELECT updated_at FROM last) AS last_updated_at,
       (SELECT key FROM last) AS last_id;


-- name: reconcile_enqueue_page
-- One page of the reconcile pass: the next :batch_size tickets of {tickets_table} updated
-- in the last :updated_within_seconds but not in the last :quiet_seconds (the visibility
-- delay: an event sent for that change has had the time to arrive and be queued), after the
-- cursor (:after_updated_at, :after_id) in (updated_at, id) order. Enqueues an enrich row
-- (reason reconcile, visible now, the ticket's tenant and its plan's priority, :priority for
-- ownerless tickets, like any enqueue) for each that was never looked up, or whose last
-- lookup started before its last change (ticket_enrichments.enriched_at is the lookup's
-- start), unless the ticket has open work of any kind (that work looks it up anyway), or the
-- queue gave up on it (a failed row, or a dead letter other than superseded) after that
-- change: such a ticket waits for a redrive or a new change. Returns how many rows went in
-- per tenant ('' = none), how many tickets the page held, and where the next page starts.
-- {tickets_table} is an identifier: reconcile.py puts in the validated, quoted name.
{{recently_updated_page}}
due AS (
    SELECT p.key, p.tenant
    FROM page AS p
    CROSS JOIN clock
    LEFT JOIN enrichq.ticket_enrichments AS e ON e.ticket_id = p.key
    WHERE p.updated_at < clock.now - make_interval(secs => CAST(:quiet_seconds AS float8))
      AND (e.ticket_id IS NULL OR e.enriched_at < p.updated_at)
      AND char_length(p.key) BETWEEN 1 AND :key_max_length
      -- a queued or running job of any kind looks the ticket up anyway
      AND NOT EXISTS (
          SELECT 1 FROM enrichq.queue AS o
          WHERE o.state = 'queued' AND o.kind IN ('enrich', 'refresh', 'backfill')
            AND o.key = p.key)
      AND NOT EXISTS (
          SELECT 1 FROM enrichq.queue AS o WHERE o.state = 'leased' AND o.key = p.key)
      AND NOT EXISTS (
          SELECT 1 FROM enrichq.queue AS g
          WHERE (g.state = 'failed' OR (g.state = 'dead_letter' AND g.dead_reason <> 'superseded'))
            AND g.key = p.key AND g.finished_at >= p.updated_at)
),
-- in the global lock order, like every enqueue
inserted AS (
    INSERT INTO enrichq.queue AS q
        (kind, key, tenant, priority, reason, state, visible_at, attempts, max_attempts)
    SELECT 'enrich', d.key, d.tenant, coalesce(t.priority, :priority), 'reconcile', 'queued',
           clock.now, 0, :max_attempts
    FROM due AS d
    CROSS JOIN clock
    LEFT JOIN enrichq.tenants AS t ON t.tenant = d.tenant
    ORDER BY d.key COLLATE "C"
    ON CONFLICT DO NOTHING
    RETURNING q.tenant
),
last AS (
    SELECT p.updated_at, p.key FROM page AS p ORDER BY p.updated_at DESC, p.key DESC LIMIT 1
)
SELECT (SELECT coalesce(jsonb_object_agg(b.tenant, b.n), '{}'::jsonb)
        FROM (SELECT coalesce(i.tenant, '') AS tenant, count(*) AS n
              FROM inserted AS i GROUP BY 1) AS b) AS by_tenant,
       (SELECT count(*) FROM page) AS scanned,
       (SELECT updated_at FROM last) AS last_updated_at,
       (SELECT key FROM last) AS last_id;


-- name: counts_refresh
-- Recounts the terminal rows (done and failed by kind, dead letters by kind and reason)
-- into enrichq.queue_counts, index-only over queue_finished_idx and
-- queue_dead_finished_idx, and drops the counts of groups that have no rows any more;
-- returns how many groups there are. Run it after counts_plan: once most of the table is
-- terminal, the planner prices a sequential scan below the index-only one, which reads a
-- quarter of the pages (enrichq_sweeper.counts).
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
counted AS (
    SELECT q.kind, q.state, '' AS dead_reason, count(*) AS n
    FROM enrichq.queue AS q
    WHERE q.state IN ('done', 'failed')
    GROUP BY q.kind, q.state
    UNION ALL
    SELECT q.kind, 'dead_letter', q.dead_reason, count(*)
    FROM enrichq.queue AS q
    WHERE q.state = 'dead_letter'
    GROUP BY q.kind, q.dead_reason
),
upserted AS (
    INSERT INTO enrichq.queue_counts AS c (kind, state, dead_reason, rows, counted_at)
    SELECT x.kind, x.state, x.dead_reason, x.n, clock.now
    FROM counted AS x
    CROSS JOIN clock
    ORDER BY 1, 2, 3
    ON CONFLICT (kind, state, dead_reason) DO UPDATE
    SET rows = excluded.rows, counted_at = excluded.counted_at
    RETURNING 1
),
gone AS (
    DELETE FROM enrichq.queue_counts AS c
    WHERE NOT EXISTS (
        SELECT 1 FROM counted AS x
        WHERE x.kind = c.kind AND x.state = c.state AND x.dead_reason = c.dead_reason)
    RETURNING 1
)
SELECT (SELECT count(*) FROM upserted) AS groups, (SELECT count(*) FROM gone) AS dropped;


-- name: counts_plan
-- For the rest of the transaction: no sequential scan where an index serves (counts_refresh
-- reads the finished-row indexes, index-only).
SELECT set_config('enable_seqscan', 'off', true);
