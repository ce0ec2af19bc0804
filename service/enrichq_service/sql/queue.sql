-- Queue transitions of DESIGN §3. Every statement takes :now (NULL = the database clock).
-- Every write after a claim is fenced on id, owner, the claim's attempt number,
-- state = 'leased' and a live lease, and returns only the rows that won.
-- Batched statements lock their rows in id order first, so two batches (a worker's
-- heartbeat and its settle, or a settle and the sweeper) can wait but never deadlock.
-- The fence is checked there, under the lock, on the newest version of each row (READ
-- COMMITTED re-checks a row that changed while the lock was awaited); no one else can
-- change a locked row, so the UPDATE that follows joins on the id alone.


-- name: queue_enqueue
-- One queued row per input unless (kind, key) is queued already (merge, via the partial
-- unique index); returns every input with the id of the row it inserted or merged into,
-- and sends NOTIFY when something became visible now.
WITH input AS (
    SELECT *
    FROM unnest(
        CAST(:kinds AS text[]), CAST(:keys AS text[]), CAST(:tenants AS text[]),
        CAST(:reasons AS text[]), CAST(:payloads AS jsonb[]), CAST(:delays AS float8[]),
        CAST(:priorities AS int[]), CAST(:max_attempts AS int[])
    ) WITH ORDINALITY AS i(kind, key, tenant, reason, payload, delay_s, priority,
                           max_attempts, ord)
),
-- the plan of each tenant sets its priority; ownerless or unknown tenants are the middle plan
inserted AS (
    INSERT INTO enrichq.queue AS q
        (kind, key, tenant, priority, reason, payload, visible_at, max_attempts)
    SELECT i.kind, i.key, i.tenant, coalesce(i.priority, t.priority, :middle_priority),
           i.reason, i.payload,
           coalesce(CAST(:now AS timestamptz), now()) + make_interval(secs => i.delay_s),
           i.max_attempts
    FROM input AS i
    LEFT JOIN enrichq.tenants AS t ON t.tenant = i.tenant
    ORDER BY i.ord
    ON CONFLICT DO NOTHING
    RETURNING q.id, q.kind, q.key, q.visible_at
),
-- wake LISTENing workers once per kind that has work visible now
notified AS (
    SELECT count(pg_notify('enrichq_queue', k.kind)) AS n
    FROM (
        SELECT DISTINCT kind FROM inserted
        WHERE visible_at <= coalesce(CAST(:now AS timestamptz), now())
    ) AS k
)
-- a merged input's row is found through the queued-key index, one probe per merge
SELECT i.ord, i.kind, i.key, ins.id AS inserted_id,
       CASE WHEN ins.id IS NULL THEN (
           SELECT e.id FROM enrichq.queue AS e
           WHERE e.state = 'queued' AND e.kind = i.kind AND e.key = i.key
       ) END AS merged_id
FROM input AS i
CROSS JOIN notified
LEFT JOIN inserted AS ins ON ins.kind = i.kind AND ins.key = i.key
ORDER BY i.ord;


-- name: queue_claim_batch prepared
-- Leases up to :limit visible rows of :kind to :owner and returns them. Order: the tenant's
-- plan priority, then the tenant served least of this kind in the last day (claims count as
-- served, so in-flight work counts), then oldest visible first. Never a key with a live lease.
WITH RECURSIVE tenant_walk(tenant) AS (
    -- loose index scan on queue_claim_idx: each tenant with queued rows of this kind,
    -- O(tenants · log n) whatever the size of the backlog or the history
    (SELECT coalesce(q.tenant, '') FROM enrichq.queue AS q
     WHERE q.state = 'queued' AND q.kind = :kind
     ORDER BY coalesce(q.tenant, '') LIMIT 1)
    UNION ALL
    SELECT (SELECT coalesce(q.tenant, '') FROM enrichq.queue AS q
            WHERE q.state = 'queued' AND q.kind = :kind
              AND coalesce(q.tenant, '') > w.tenant
            ORDER BY coalesce(q.tenant, '') LIMIT 1)
    FROM tenant_walk AS w
    WHERE w.tenant IS NOT NULL
),
-- claims per tenant in the last day: at most 25 hourly buckets per tenant
served AS (
    SELECT s.tenant, sum(s.served) AS served
    FROM enrichq.tenant_served AS s
    WHERE s.kind = :kind AND s.bucket > coalesce(CAST(:now AS timestamptz), now()) - interval '1 day'
    GROUP BY s.tenant
),
-- tenants with visible work, in claim order; the nested loop below visits them in this
-- order and stops as soon as the batch is full
ranked AS MATERIALIZED (
    SELECT w.tenant, v.priority, v.served, v.oldest
    FROM tenant_walk AS w
    LEFT JOIN enrichq.tenants AS t ON t.tenant = w.tenant
    LEFT JOIN served AS s ON s.tenant = w.tenant
    CROSS JOIN LATERAL (
        SELECT CASE WHEN w.tenant = '' THEN :middle_priority
                    ELSE coalesce(t.priority, :middle_priority) END AS priority,
               coalesce(s.served, 0) AS served,
               (SELECT q.visible_at FROM enrichq.queue AS q
                WHERE q.state = 'queued' AND q.kind = :kind
                  AND coalesce(q.tenant, '') = w.tenant AND q.visible_at <= coalesce(CAST(:now AS timestamptz), now())
                ORDER BY q.visible_at LIMIT 1) AS oldest
    ) AS v
    WHERE w.tenant IS NOT NULL AND v.oldest IS NOT NULL
    ORDER BY v.priority DESC, v.served, v.oldest, w.tenant
),
picked AS (
    SELECT c.id
    FROM ranked AS r
    CROSS JOIN LATERAL (
        SELECT q.id
        FROM enrichq.queue AS q
        WHERE q.state = 'queued' AND q.kind = :kind
          AND coalesce(q.tenant, '') = r.tenant
          AND q.visible_at <= coalesce(CAST(:now AS timestamptz), now())
          -- one index probe per candidate: OFFSET 0 stops the planner from turning this
          -- into an anti join that reads every lease and then sorts the whole backlog
          AND NOT EXISTS (
              SELECT 1 FROM enrichq.queue AS l
              WHERE l.state = 'leased' AND l.key = q.key
                AND l.lease_expires_at > coalesce(CAST(:now AS timestamptz), now())
              OFFSET 0
          )
        ORDER BY q.visible_at
        LIMIT :limit
        FOR UPDATE OF q SKIP LOCKED
    ) AS c
    LIMIT :limit
),
claimed AS (
    UPDATE enrichq.queue AS q
    SET state = 'leased',
        attempts = q.attempts + 1,
        lease_owner = :owner,
        lease_expires_at = coalesce(CAST(:now AS timestamptz), now()) + make_interval(secs => :lease_seconds),
        heartbeat_at = coalesce(CAST(:now AS timestamptz), now()),
        updated_at = coalesce(CAST(:now AS timestamptz), now())
    FROM picked
    WHERE q.id = picked.id
    RETURNING q.id, q.kind, q.key, q.tenant, q.reason, q.payload, q.attempts,
              q.max_attempts, q.lease_expires_at, q.created_at, q.last_error
),
-- count the claims for fairness (tenants in a fixed order: concurrent claims never deadlock)
counted AS (
    INSERT INTO enrichq.tenant_served AS s (kind, tenant, bucket, served)
    SELECT :kind, coalesce(c.tenant, ''), date_trunc('hour', coalesce(CAST(:now AS timestamptz), now())), count(*)
    FROM claimed AS c
    GROUP BY 2, 3
    ORDER BY 2
    ON CONFLICT (kind, tenant, bucket) DO UPDATE SET served = s.served + excluded.served
)
SELECT * FROM claimed ORDER BY id;


-- name: queue_heartbeat prepared
-- Extends every listed lease :owner still holds (matching the claim's attempt) and returns
-- the ids it extended; a listed id that is missing was lost.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
held AS (
    SELECT q.id
    FROM enrichq.queue AS q
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:attempts AS int[])) AS h(id, attempt)
        ON q.id = h.id AND q.attempts = h.attempt
    CROSS JOIN clock
    WHERE q.state = 'leased' AND q.lease_owner = :owner AND q.lease_expires_at > clock.now
    ORDER BY q.id
    FOR UPDATE OF q
)
UPDATE enrichq.queue AS q
SET lease_expires_at = clock.now + make_interval(secs => :lease_seconds),
    heartbeat_at = clock.now
FROM held, clock
WHERE q.id = held.id
RETURNING q.id;


-- name: queue_complete prepared
-- leased → done for every listed (id, attempt) :owner still holds; returns the ids that won.
-- The caller writes the results of exactly these ids in the same transaction.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
held AS (
    SELECT q.id
    FROM enrichq.queue AS q
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:attempts AS int[])) AS s(id, attempt)
        ON q.id = s.id AND q.attempts = s.attempt
    CROSS JOIN clock
    WHERE q.state = 'leased' AND q.lease_owner = :owner AND q.lease_expires_at > clock.now
    ORDER BY q.id
    FOR UPDATE OF q
)
UPDATE enrichq.queue AS q
SET state = 'done', finished_at = clock.now, updated_at = clock.now,
    lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
FROM held, clock
WHERE q.id = held.id
RETURNING q.id;


-- name: queue_fail
-- leased → failed (permanent error, terminal) for every listed job :owner still holds;
-- returns the ids that won.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
held AS (
    SELECT q.id, s.error
    FROM enrichq.queue AS q
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:attempts AS int[]), CAST(:errors AS text[]))
        AS s(id, attempt, error)
        ON q.id = s.id AND q.attempts = s.attempt
    CROSS JOIN clock
    WHERE q.state = 'leased' AND q.lease_owner = :owner AND q.lease_expires_at > clock.now
    ORDER BY q.id
    FOR UPDATE OF q
)
UPDATE enrichq.queue AS q
SET state = 'failed', last_error = held.error, finished_at = clock.now,
    updated_at = clock.now, lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
FROM held, clock
WHERE q.id = held.id
RETURNING q.id;


-- name: queue_retry
-- leased → queued after a transient error, visible after capped exponential backoff with
-- half-to-full jitter: min(cap, base·2^attempts)·(0.5 + random()/2). Spent attempts →
-- dead_letter (attempts_exhausted); a key that is queued already → dead_letter (superseded
-- by that row). Returns (id, state) of the rows that won.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
held AS (
    SELECT q.id, s.error, (q.attempts >= q.max_attempts) AS exhausted,
           (SELECT o.id FROM enrichq.queue AS o
            WHERE o.state = 'queued' AND o.kind = q.kind AND o.key = q.key) AS queued_id
    FROM enrichq.queue AS q
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:attempts AS int[]), CAST(:errors AS text[]))
        AS s(id, attempt, error)
        ON q.id = s.id AND q.attempts = s.attempt
    CROSS JOIN clock
    WHERE q.state = 'leased' AND q.lease_owner = :owner AND q.lease_expires_at > clock.now
    ORDER BY q.id
    FOR UPDATE OF q
)
UPDATE enrichq.queue AS q
SET state = CASE WHEN held.exhausted OR held.queued_id IS NOT NULL THEN 'dead_letter'
                 ELSE 'queued' END,
    dead_reason = CASE WHEN held.exhausted THEN 'attempts_exhausted'
                       WHEN held.queued_id IS NOT NULL THEN 'superseded' END,
    superseded_by = CASE WHEN NOT held.exhausted THEN held.queued_id END,
    finished_at = CASE WHEN held.exhausted OR held.queued_id IS NOT NULL THEN clock.now END,
    visible_at = CASE WHEN held.exhausted OR held.queued_id IS NOT NULL THEN q.visible_at
                      ELSE clock.now + make_interval(secs =>
                          least(CAST(:backoff_cap AS float8),
                                CAST(:backoff_base AS float8) * power(2, q.attempts))
                          * (0.5 + random() / 2)) END,
    last_error = held.error, updated_at = clock.now,
    lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
FROM held, clock
WHERE q.id = held.id
RETURNING q.id, q.state;


-- name: queue_defer
-- leased → queued until a given time, giving back the claim's attempt (nothing went wrong,
-- the work just cannot run yet); a key that is queued already → superseded by that row.
-- Returns (id, state) of the rows that won.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
held AS (
    SELECT q.id, s.until,
           (SELECT o.id FROM enrichq.queue AS o
            WHERE o.state = 'queued' AND o.kind = q.kind AND o.key = q.key) AS queued_id
    FROM enrichq.queue AS q
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:attempts AS int[]),
                CAST(:untils AS timestamptz[])) AS s(id, attempt, until)
        ON q.id = s.id AND q.attempts = s.attempt
    CROSS JOIN clock
    WHERE q.state = 'leased' AND q.lease_owner = :owner AND q.lease_expires_at > clock.now
    ORDER BY q.id
    FOR UPDATE OF q
)
UPDATE enrichq.queue AS q
SET state = CASE WHEN held.queued_id IS NULL THEN 'queued' ELSE 'dead_letter' END,
    dead_reason = CASE WHEN held.queued_id IS NOT NULL THEN 'superseded' END,
    superseded_by = held.queued_id,
    finished_at = CASE WHEN held.queued_id IS NOT NULL THEN clock.now END,
    visible_at = greatest(coalesce(held.until, clock.now), clock.now),
    attempts = greatest(q.attempts - 1, 0),
    updated_at = clock.now,
    lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
FROM held, clock
WHERE q.id = held.id
RETURNING q.id, q.state;


-- name: queue_queued_ids
-- The queued row of each (kind, key): for merges that waited on a concurrent enqueue, whose
-- row committed after the enqueue statement's snapshot and so was not visible to it.
SELECT q.kind, q.key, q.id
FROM enrichq.queue AS q
JOIN unnest(CAST(:kinds AS text[]), CAST(:keys AS text[])) AS k(kind, key)
    ON q.kind = k.kind AND q.key = k.key
WHERE q.state = 'queued';


-- name: queue_get
-- One row by id, every column (tests and the CLI).
SELECT * FROM enrichq.queue WHERE id = :id;
