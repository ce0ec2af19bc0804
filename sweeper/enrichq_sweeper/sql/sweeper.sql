-- The sweeper's statements (DESIGN §3: sweep, redrive, prune; the refresh schedule; the
-- run log). Every statement takes :now (NULL = the database clock) so tests can move time.
-- Batched writes take their row locks in id order, like the queue's own statements, so a
-- batch and a worker's settle can wait for each other but never deadlock.


-- name: sweeper_statement_timeout
-- Sets statement_timeout (milliseconds, as text) for the rest of the transaction only, and
-- plans every statement for its own parameters: psycopg prepares a statement after a few
-- runs, and the generic plan Postgres then picks for a batch of keys it cannot see is
-- measured to be 5-20x slower than the plan for the actual batch.
SELECT set_config('statement_timeout', :timeout_ms, true),
       set_config('plan_cache_mode', 'force_custom_plan', true);


-- name: sweeper_advisory_lock
-- Tries the session-level lock that makes one sweeper the leader; true when held.
SELECT pg_try_advisory_lock(CAST(:lock_id AS bigint));


-- name: sweeper_advisory_unlock
-- Releases the leader lock (it is also released when the session ends).
SELECT pg_advisory_unlock(CAST(:lock_id AS bigint));


-- name: recovery_scan
-- Up to :batch_size expired leases after id :after_id, lowest id first (the cursor).
SELECT q.id, q.kind, q.key, q.attempts, q.max_attempts
FROM enrichq.queue AS q
WHERE q.state = 'leased'
  AND q.lease_expires_at < coalesce(CAST(:now AS timestamptz), now())
  AND q.id > :after_id
ORDER BY q.id
LIMIT :batch_size;


-- name: recovery_recover_batch
-- Recovers every expired lease of the scanned keys (:kinds[i], :keys[i]) in one statement;
-- returns `skipped` (rows that changed under the statement: the caller runs it again) and
-- the recovered ids per action (promote / supersede / exhaust) and kind, with the rows
-- they were superseded by, and each spent row's old lease. Taking all expired rows of a
-- key, not only those the scan saw, makes the newest expired row win when a key's rows
-- straddle two pages. No step joins two row sets: the per-key picks are one window over a
-- sorted list, so the cost stays n·log n whatever the planner believes about the table.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
-- the keys' expired leases, one index probe per key (OFFSET 0 keeps it so: flattened into
-- a join, the planner may hash every lease in the table instead)
expired AS (
    SELECT e.*
    FROM unnest(CAST(:kinds AS text[]), CAST(:keys AS text[])) AS b(kind, key)
    CROSS JOIN clock
    CROSS JOIN LATERAL (
        SELECT q.id, q.kind, q.key, q.attempts, q.max_attempts,
               (q.attempts >= q.max_attempts) AS spent, q.ctid AS row_at,
               -- what the gave-up hook gets, carried along for spent rows only
               CASE WHEN q.attempts >= q.max_attempts THEN q.tenant END AS tenant,
               CASE WHEN q.attempts >= q.max_attempts THEN q.lease_owner END AS lease_owner,
               CASE WHEN q.attempts >= q.max_attempts THEN q.lease_expires_at END
                   AS lease_expires_at,
               CASE WHEN q.attempts >= q.max_attempts THEN q.payload END AS payload
        FROM enrichq.queue AS q
        WHERE q.state = 'leased' AND q.kind = b.kind AND q.key = b.key
          AND q.lease_expires_at < clock.now
        OFFSET 0
    ) AS e
),
-- the keys' queued rows (one per key at most); one queued after this statement's snapshot
-- shows up as a unique violation instead, and the caller runs the statement again
queued AS (
    SELECT q.id, q.kind, q.key
    FROM enrichq.queue AS q
    WHERE q.state = 'queued'
      AND q.kind = ANY(CAST(:kinds AS text[])) AND q.key = ANY(CAST(:keys AS text[]))
),
-- per key: its queued row, and its newest expired row with attempts left
picks AS (
    SELECT c.*,
           max(c.id) FILTER (WHERE c.is_queued) OVER w AS queued_id,
           max(c.id) FILTER (WHERE NOT c.is_queued AND NOT c.spent) OVER w AS newest
    FROM (
        SELECT e.*, false AS is_queued FROM expired AS e
        UNION ALL
        SELECT q.id, q.kind, q.key, NULL, NULL, false, NULL, NULL, NULL, NULL, NULL, true
        FROM queued AS q
    ) AS c
    -- byte order is enough to group a key's rows, and much cheaper than the collation's
    WINDOW w AS (PARTITION BY c.kind COLLATE "C", c.key COLLATE "C")
),
-- in id order: the write takes its row locks in the order it meets the rows, and every
-- batched write of the queue locks in id order, so two can wait but never deadlock
decided AS (
    SELECT p.*,
           CASE WHEN p.spent THEN 'exhaust'
                WHEN p.queued_id IS NULL AND p.id = p.newest THEN 'promote'
                ELSE 'supersede' END AS action,
           coalesce(p.queued_id, p.newest) AS winner
    FROM picks AS p
    WHERE NOT p.is_queued
    ORDER BY p.id
),
-- wake LISTENing workers once per kind that gets work back (delivered at commit)
notified AS (
    SELECT count(pg_notify('enrichq_queue', k.kind)) AS n
    FROM (SELECT DISTINCT kind FROM decided WHERE action = 'promote') AS k
),
-- The write re-checks state and expiry on the row it changes, and takes only the row
-- version the decision saw (ctid, found without an index descent): a row a worker settled
-- or extended since the snapshot, even while this statement waited for its lock, is left
-- alone and counted as skipped.
updated AS (
    UPDATE enrichq.queue AS q
    SET state = CASE WHEN d.action = 'promote' THEN 'queued' ELSE 'dead_letter' END,
        dead_reason = CASE d.action WHEN 'exhaust' THEN 'attempts_exhausted'
                                    WHEN 'supersede' THEN 'superseded' END,
        superseded_by = CASE WHEN d.action = 'supersede' THEN d.winner END,
        finished_at = CASE WHEN d.action = 'promote' THEN NULL ELSE clock.now END,
        visible_at = CASE WHEN d.action = 'promote' THEN clock.now ELSE q.visible_at END,
        last_error = 'lease expired',
        updated_at = clock.now,
        lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
    FROM decided AS d, clock, notified
    WHERE q.ctid = d.row_at AND q.id = d.id
      AND q.state = 'leased' AND q.lease_expires_at < clock.now
    RETURNING q.id, d.action, q.superseded_by, d.kind, d.key, d.tenant, d.attempts,
              d.max_attempts, d.lease_owner, d.lease_expires_at, d.payload
)
-- one row per (action, kind) with the ids as arrays (a page is thousands of rows), except
-- spent rows: one row each, with the old lease and payload for the gave-up hook
SELECT s.skipped, g.*
FROM (
    SELECT (SELECT count(*) FROM decided) - (SELECT count(*) FROM updated) AS skipped
) AS s
LEFT JOIN (
    SELECT u.action, u.kind,
           array_agg(u.id ORDER BY u.id) AS ids,
           array_agg(u.superseded_by ORDER BY u.id) AS winners,
           min(u.key) AS key, min(u.tenant) AS tenant, min(u.attempts) AS attempts,
           min(u.max_attempts) AS max_attempts, min(u.lease_owner) AS lease_owner,
           min(u.lease_expires_at) AS lease_expires_at, (array_agg(u.payload))[1] AS payload
    FROM updated AS u
    GROUP BY u.action, u.kind, CASE WHEN u.action = 'exhaust' THEN u.id END
) AS g ON true;


-- name: queue_notify
-- Wakes LISTENing workers for :kind (delivered when the transaction commits).
SELECT pg_notify('enrichq_queue', :kind);


-- name: retention_prune_finished
-- Deletes up to :batch_size done/failed rows finished before :cutoff (skipping rows another
-- transaction holds); returns (state, how many) per state deleted.
WITH doomed AS (
    SELECT q.id
    FROM enrichq.queue AS q
    WHERE q.state IN ('done', 'failed')
      AND q.finished_at < CAST(:cutoff AS timestamptz)
    ORDER BY q.finished_at
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM enrichq.queue AS q
    USING doomed
    WHERE q.id = doomed.id AND q.state IN ('done', 'failed')
    RETURNING q.state
)
SELECT state AS what, count(*) AS n FROM deleted GROUP BY state;


-- name: retention_prune_dead
-- Deletes up to :batch_size dead letters finished before :cutoff; returns ('dead_letter', n).
WITH doomed AS (
    SELECT q.id
    FROM enrichq.queue AS q
    WHERE q.state = 'dead_letter'
      AND q.finished_at < CAST(:cutoff AS timestamptz)
    ORDER BY q.finished_at
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM enrichq.queue AS q
    USING doomed
    WHERE q.id = doomed.id AND q.state = 'dead_letter'
    RETURNING q.id
)
SELECT 'dead_letter' AS what, count(*) AS n FROM deleted;


-- name: retention_prune_tenant_served
-- Deletes up to :batch_size claim-count buckets older than :cutoff; returns ('tenant_served', n).
WITH doomed AS (
    SELECT s.kind, s.tenant, s.bucket
    FROM enrichq.tenant_served AS s
    WHERE s.bucket < CAST(:cutoff AS timestamptz)
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM enrichq.tenant_served AS s
    USING doomed AS d
    WHERE s.kind = d.kind AND s.tenant = d.tenant AND s.bucket = d.bucket
    RETURNING 1
)
SELECT 'tenant_served' AS what, count(*) AS n FROM deleted;


-- name: retention_prune_lookup_log
-- Deletes up to :batch_size lookup-log rows created before :cutoff, oldest id first;
-- returns ('lookup_log', n).
WITH doomed AS (
    SELECT l.id
    FROM enrichq.lookup_log AS l
    WHERE l.created_at < CAST(:cutoff AS timestamptz)
    ORDER BY l.id
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM enrichq.lookup_log AS l USING doomed WHERE l.id = doomed.id RETURNING 1
)
SELECT 'lookup_log' AS what, count(*) AS n FROM deleted;


-- name: retention_prune_runs
-- Deletes up to :batch_size finished run-log rows started before :cutoff, oldest id
-- first; returns ('runs', n).
WITH doomed AS (
    SELECT r.id
    FROM enrichq.runs AS r
    WHERE r.started_at < CAST(:cutoff AS timestamptz) AND r.finished_at IS NOT NULL
    ORDER BY r.id
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM enrichq.runs AS r USING doomed WHERE r.id = doomed.id RETURNING 1
)
SELECT 'runs' AS what, count(*) AS n FROM deleted;


-- name: retention_cutoff
-- The instant :seconds before :now (the database clock when :now is NULL).
SELECT coalesce(CAST(:now AS timestamptz), now()) - make_interval(secs => CAST(:seconds AS float8));


-- name: refresh_enqueue
-- Enqueues one refresh row (visible now, no tenant) per ticket of {tickets_table} updated in
-- the last :updated_within_seconds whose last enrichment is older than
-- :enriched_before_seconds or missing, unless the ticket has open work already; merges with
-- a queued refresh through the partial unique index. Returns how many rows went in.
-- {tickets_table} is an identifier, which cannot be a bound parameter: refresh.py puts in
-- the validated, quoted name from the settings before the text is compiled.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
inserted AS (
    INSERT INTO enrichq.queue AS q
        (kind, key, tenant, priority, reason, state, visible_at, attempts, max_attempts)
    SELECT 'refresh', CAST(t.id AS text), NULL, :priority, 'refresh', 'queued', clock.now, 0,
           :max_attempts
    FROM {tickets_table} AS t
    CROSS JOIN clock
    LEFT JOIN enrichq.ticket_enrichments AS e ON e.ticket_id = CAST(t.id AS text)
    WHERE t.updated_at >= clock.now - make_interval(secs => CAST(:updated_within_seconds AS float8))
      AND (e.enriched_at IS NULL
           OR e.enriched_at < clock.now - make_interval(secs => CAST(:enriched_before_seconds AS float8)))
      AND char_length(CAST(t.id AS text)) BETWEEN 1 AND :key_max_length
      -- a queued or running job of either kind enriches the ticket anyway
      AND NOT EXISTS (
          SELECT 1 FROM enrichq.queue AS o
          WHERE o.state = 'queued' AND o.kind IN ('enrich', 'refresh')
            AND o.key = CAST(t.id AS text))
      AND NOT EXISTS (
          SELECT 1 FROM enrichq.queue AS o
          WHERE o.state = 'leased' AND o.kind IN ('enrich', 'refresh')
            AND o.key = CAST(t.id AS text))
    ORDER BY t.updated_at
    ON CONFLICT DO NOTHING
    RETURNING q.id
)
SELECT count(*) FROM inserted;


-- name: dlq_list
-- Dead letters, newest id first, at most :limit.
SELECT q.id, q.kind, q.key, q.tenant, q.reason, q.dead_reason, q.superseded_by, q.attempts,
       q.max_attempts, q.last_error, q.finished_at, q.created_at
FROM enrichq.queue AS q
WHERE q.state = 'dead_letter'
ORDER BY q.id DESC
LIMIT :limit;


-- name: dlq_list_by_reason
-- Dead letters with dead_reason :reason, newest id first, at most :limit.
SELECT q.id, q.kind, q.key, q.tenant, q.reason, q.dead_reason, q.superseded_by, q.attempts,
       q.max_attempts, q.last_error, q.finished_at, q.created_at
FROM enrichq.queue AS q
WHERE q.state = 'dead_letter' AND q.dead_reason = :reason
ORDER BY q.id DESC
LIMIT :limit;


-- name: runs_start
-- Opens the run-log row of one sweeper pass; returns its id.
INSERT INTO enrichq.runs (component, owner, counts)
VALUES ('sweeper', :owner, CAST(:counts AS jsonb))
RETURNING id;


-- name: runs_finish
-- Closes the run-log row :id with its stop reason, counts and error.
UPDATE enrichq.runs
SET finished_at = clock_timestamp(), stop_reason = :stop_reason,
    counts = CAST(:counts AS jsonb), error = :error
WHERE id = :id;
