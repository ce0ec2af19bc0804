-- Queue transitions. Every statement takes :now (NULL = the database clock). Every write
-- after a claim is fenced (id, lease owner, claim token, a live lease) and returns the rows
-- that won; rows are locked in one global order, (key, kind, id) COLLATE "C", so writers
-- never deadlock (docs/architecture.md: fencing, lock order).


-- name: queue_enqueue
-- One queued row per input unless (kind, key) is queued already (merge, via the partial
-- unique index: the queued row is kept and its merged_at set); returns every input with the
-- id of the row it inserted or merged into, and sends NOTIFY when something became visible
-- now. An event's row becomes visible after its delay, rounded up to the lookup window's
-- boundary (:window_seconds, 0 = not rounded).
WITH input AS (
    SELECT *
    FROM unnest(
        CAST(:kinds AS text[]), CAST(:keys AS text[]), CAST(:tenants AS text[]),
        CAST(:reasons AS text[]), CAST(:payloads AS jsonb[]), CAST(:delays AS float8[]),
        CAST(:max_attempts AS int[])
    ) WITH ORDINALITY AS i(kind, key, tenant, reason, payload, delay_s, max_attempts, ord)
),
-- the first input of each (kind, key): one statement may not insert or merge into a row
-- twice; a later input of the same ticket merges into what the first one did
firsts AS (
    SELECT DISTINCT ON (i.kind, i.key) i.*
    FROM input AS i
    ORDER BY i.kind, i.key, i.ord
),
-- in the global lock order, so two batches of the same keys wait for each other's inserts
-- in one order and never deadlock; the row records its tenant's plan priority at enqueue
-- (ownerless or unknown tenants: the middle plan), the claim reads the plan when it claims.
-- A merge locks the queued row and marks it (merged_at): a cancel that selected the row
-- before then leaves it queued, and one that locked it first makes this insert a new row
-- once it commits (the conflict is checked again), so no event is lost to a cancel.
inserted AS (
    INSERT INTO enrichq.queue AS q
        (kind, key, tenant, priority, reason, payload, visible_at, max_attempts)
    SELECT i.kind, i.key, i.tenant, coalesce(t.priority, :middle_priority),
           i.reason, i.payload,
           -- the lookup window (ENRICHQ_LOOKUP_WINDOW_SECONDS, :window_seconds > 0): event
           -- work becomes visible at the next multiple of the window since the epoch, in
           -- cohorts the fleet claims together (one lookup for many tickets); manual and
           -- redriven work is exempt (a person is waiting for it)
           CASE WHEN CAST(:window_seconds AS float8) > 0
                     AND i.reason NOT IN ('manual', 'redrive')
                THEN to_timestamp(
                         ceil(extract(epoch FROM v.at) / CAST(:window_seconds AS float8))
                         * CAST(:window_seconds AS float8))
                ELSE v.at END,
           i.max_attempts
    FROM firsts AS i
    CROSS JOIN LATERAL (
        SELECT coalesce(CAST(:now AS timestamptz), now()) + make_interval(secs => i.delay_s)
            AS at
    ) AS v
    LEFT JOIN enrichq.tenants AS t ON t.tenant = i.tenant
    ORDER BY i.key COLLATE "C", i.kind COLLATE "C", i.ord
    ON CONFLICT (kind, key) WHERE state = 'queued'
    -- the merge's own time (clock_timestamp), not its transaction's start: an ingest
    -- transaction that began before a cancel and merges after it selected is new work
    DO UPDATE SET merged_at = coalesce(CAST(:now AS timestamptz), clock_timestamp()),
                  -- a manual enqueue is visible now (DESIGN §3): it brings a delayed row
                  -- forward; an event keeps the row's own delay (a created ticket's waits
                  -- out the warehouse's replication lag)
                  visible_at = CASE WHEN excluded.reason = 'manual'
                                    THEN least(q.visible_at, excluded.visible_at)
                                    ELSE q.visible_at END
    RETURNING q.id, q.kind, q.key, q.visible_at, (q.xmax = 0) AS fresh
),
-- wake LISTENing workers once per kind that has work visible now (a new row, or a merged
-- one a manual enqueue brought forward)
notified AS (
    SELECT count(pg_notify(:channel, k.kind)) AS n
    FROM (
        SELECT DISTINCT kind FROM inserted
        WHERE visible_at <= coalesce(CAST(:now AS timestamptz), now())
    ) AS k
)
SELECT i.ord, i.kind, i.key,
       CASE WHEN ins.fresh THEN ins.id END AS inserted_id,
       CASE WHEN NOT ins.fresh THEN ins.id END AS merged_id
FROM input AS i
CROSS JOIN notified
LEFT JOIN inserted AS ins ON ins.kind = i.kind AND ins.key = i.key
ORDER BY i.ord;


-- name: queue_heads_refresh
-- Evaluates again the heads (enrichq.queue_heads) of the pairs (:pair_kinds[i],
-- :pair_tenants[i]) and up to :due_batch heads of :kinds that are due, skipping any another
-- transaction holds; returns how many it evaluated. The claim calls it before it ranks the
-- pairs (so the levels are those of :now) and after, for the pairs it took rows from.
SELECT enrichq.queue_heads_refresh(
    CAST(:kinds AS text[]), CAST(:pair_kinds AS text[]), CAST(:pair_tenants AS text[]),
    coalesce(CAST(:now AS timestamptz), now()), CAST(:aging_seconds AS float8),
    CAST(:top_priority AS int), CAST(:middle_priority AS int), CAST(:due_batch AS int),
    CAST(:recheck_seconds AS float8)
) AS evaluated;


-- name: queue_claim_batch prepared
-- Leases up to :limit visible rows of the kinds :kinds to :owner and returns them, each
-- with the claim token that fences its later writes. Order (DESIGN §3, fairness), across
-- kinds, per (kind, tenant) as its head says (enrichq.queue_heads, evaluated by
-- queue_heads_refresh just before): the tenant's plan priority (ownerless work counts as
-- the middle plan, whatever its kind) plus one level per aging period its oldest visible
-- row has waited, at most the top plan's, so no row waits more than about (plan levels ×
-- aging) behind a higher plan's backlog, however fast that grows; then the (kind, tenant)
-- served least in the last day (claims count as served, so in-flight work counts); then
-- oldest visible first; backfill work last of all (its head is a level below every plan and
-- never ages). Never a key that has a lease, of any kind: committed (the
-- leased-key probe), being claimed by another transaction right now (the key's try-lock),
-- or committed after this statement's snapshot (the leased-key index refuses the second
-- lease: the caller claims again). Never a (kind, tenant) an operator paused
-- (enrichq.pauses). Attempts + 1 at claim time.
WITH RECURSIVE clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
-- the pairs with visible work, best first: a walk of the heads' order index, one entry a
-- step (every term ascending: levels behind the top, served, oldest). The nested loop below
-- pulls the steps one by one and stops as soon as the batch is full, so a claim reads a
-- few heads whatever the number of tenants with queued rows, visible or not
walk AS (
    (SELECT h.behind, h.served, h.oldest, h.kind, h.tenant
     FROM enrichq.queue_heads AS h
     WHERE h.behind IS NOT NULL
     ORDER BY h.behind, h.served, h.oldest, h.kind, h.tenant
     LIMIT 1)
    UNION ALL
    SELECT n.behind, n.served, n.oldest, n.kind, n.tenant
    FROM walk AS w
    CROSS JOIN LATERAL (
        SELECT h.behind, h.served, h.oldest, h.kind, h.tenant
        FROM enrichq.queue_heads AS h
        WHERE h.behind IS NOT NULL
          AND (h.behind, h.served, h.oldest, h.kind, h.tenant)
              > (w.behind, w.served, w.oldest, w.kind, w.tenant)
        ORDER BY h.behind, h.served, h.oldest, h.kind, h.tenant
        LIMIT 1
    ) AS n
),
ranked AS (
    SELECT w.behind, w.served, w.oldest, w.kind, w.tenant
    FROM walk AS w
    WHERE w.kind = ANY(CAST(:kinds AS text[]))
      -- paused by an operator (`enrichq pause`): skipped before any of its rows is read
      AND NOT EXISTS (
          SELECT 1 FROM enrichq.pauses AS p
          WHERE (p.kind IS NULL OR p.kind = w.kind)
            AND (p.tenant IS NULL OR p.tenant = w.tenant))
),
picked AS (
    SELECT r.behind, r.served, r.oldest, r.kind, r.tenant, c.id, c.key, c.visible_at
    FROM ranked AS r
    CROSS JOIN clock
    CROSS JOIN LATERAL (
        SELECT q.id, q.key, q.visible_at
        FROM enrichq.queue AS q
        WHERE q.state = 'queued' AND q.kind = r.kind
          AND coalesce(q.tenant, '') = r.tenant
          AND q.visible_at <= clock.now
          -- first one probe of the leased-key index (OFFSET 0 keeps it a probe: flattened
          -- into an anti join, the planner reads every lease and sorts the whole backlog),
          -- then the key's try-lock, which the claims of this key not committed yet hold;
          -- CASE makes the order certain
          AND CASE WHEN NOT EXISTS (
                       SELECT 1 FROM enrichq.queue AS l
                       WHERE l.state = 'leased' AND l.key = q.key
                       OFFSET 0)
                   THEN pg_try_advisory_xact_lock(CAST(:key_lock_space AS int), hashtext(q.key))
                   ELSE false END
        ORDER BY q.visible_at
        LIMIT :limit
        FOR UPDATE OF q SKIP LOCKED
    ) AS c
    LIMIT :limit
),
-- one row per key: this transaction's own try-lock on a key succeeds again, so a ticket
-- with visible work of two kinds is taken once, by the kind that comes first in claim order
chosen AS (
    SELECT DISTINCT ON (p.key) p.id
    FROM picked AS p
    ORDER BY p.key, p.behind, p.served, p.oldest, p.kind, p.tenant, p.visible_at
),
claimed AS (
    UPDATE enrichq.queue AS q
    SET state = 'leased',
        attempts = q.attempts + 1,
        lease_owner = :owner,
        claim_token = gen_random_uuid(),
        lease_expires_at = clock.now + make_interval(secs => :lease_seconds),
        heartbeat_at = clock.now,
        updated_at = clock.now
    FROM chosen, clock
    WHERE q.id = chosen.id
    RETURNING q.id, q.kind, q.key, q.tenant, q.reason, q.payload, q.attempts,
              q.max_attempts, q.claim_token, q.lease_expires_at, q.created_at, q.last_error,
              q.updated_at AS claimed_at
),
-- count the claims for fairness (pairs in a fixed order: concurrent claims never deadlock)
counted AS (
    INSERT INTO enrichq.tenant_served AS s (kind, tenant, bucket, served)
    SELECT c.kind, coalesce(c.tenant, ''), date_trunc('hour', clock.now), count(*)
    FROM claimed AS c
    CROSS JOIN clock
    GROUP BY 1, 2, 3
    ORDER BY 1, 2
    ON CONFLICT (kind, tenant, bucket) DO UPDATE SET served = s.served + excluded.served
)
SELECT * FROM claimed ORDER BY id;


-- name: queue_heartbeat prepared
-- Extends every listed lease (:ids[i] claimed with :tokens[i]) that :owner still holds,
-- and returns the ids it extended; a listed id that is missing was lost.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
held AS (
    SELECT q.id
    FROM enrichq.queue AS q
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[])) AS h (id, token)
        ON q.id = h.id AND q.claim_token = h.token
    CROSS JOIN clock
    WHERE q.state = 'leased' AND q.lease_owner = :owner AND q.lease_expires_at > clock.now
    ORDER BY q.key COLLATE "C", q.kind COLLATE "C", q.id
    FOR UPDATE OF q
)
UPDATE enrichq.queue AS q
SET lease_expires_at = clock.now + make_interval(secs => :lease_seconds),
    heartbeat_at = clock.now
FROM held, clock
WHERE q.id = held.id
RETURNING q.id;


-- name: queue_settle prepared
-- Settles a group of held jobs in one statement (:ids[i] claimed with :tokens[i], by
-- :actions[i]), locking them all first in the global order:
--   complete → done (the caller writes the results of exactly the rows that won);
--   fail     → failed, for good, with :errors[i];
--   retry    → queued :delays[i] seconds from now (the caller's backoff), with :errors[i];
--              its attempts spent → dead_letter (attempts_exhausted);
--   defer    → queued at :untils[i] (NULL: now), the claim's attempt given back.
-- A retry or defer whose key is queued already is dead-lettered as superseded by that row.
-- Returns (id, state, dead_reason) of the rows that won.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
held AS MATERIALIZED (
    SELECT q.id, q.kind, q.key, q.attempts >= q.max_attempts AS spent, s.action, s.error,
           s.until, s.delay
    FROM enrichq.queue AS q
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[]), CAST(:actions AS text[]),
                CAST(:errors AS text[]), CAST(:untils AS timestamptz[]),
                CAST(:delays AS float8[]))
        AS s (id, token, action, error, until, delay)
        ON q.id = s.id AND q.claim_token = s.token
    CROSS JOIN clock
    WHERE q.state = 'leased' AND q.lease_owner = :owner AND q.lease_expires_at > clock.now
    ORDER BY q.key COLLATE "C", q.kind COLLATE "C", q.id
    FOR UPDATE OF q
),
decided AS (
    SELECT h.id, h.action, h.error, h.until, h.delay,
           h.action = 'retry' AND h.spent AS exhausted,
           CASE WHEN h.action IN ('retry', 'defer') THEN (
               SELECT o.id FROM enrichq.queue AS o
               WHERE o.state = 'queued' AND o.kind = h.kind AND o.key = h.key
           ) END AS queued_id
    FROM held AS h
)
UPDATE enrichq.queue AS q
SET state = CASE WHEN d.action = 'complete' THEN 'done'
                 WHEN d.action = 'fail' THEN 'failed'
                 WHEN d.exhausted OR d.queued_id IS NOT NULL THEN 'dead_letter'
                 ELSE 'queued' END,
    dead_reason = CASE WHEN d.exhausted THEN 'attempts_exhausted'
                       WHEN d.queued_id IS NOT NULL THEN 'superseded' END,
    superseded_by = CASE WHEN NOT d.exhausted THEN d.queued_id END,
    finished_at = CASE WHEN d.action IN ('complete', 'fail') OR d.exhausted
                            OR d.queued_id IS NOT NULL THEN clock.now END,
    visible_at = CASE
        WHEN d.exhausted OR d.queued_id IS NOT NULL THEN q.visible_at
        WHEN d.action = 'retry' THEN clock.now + make_interval(secs => d.delay)
        WHEN d.action = 'defer' THEN greatest(coalesce(d.until, clock.now), clock.now)
        ELSE q.visible_at END,
    attempts = CASE WHEN d.action = 'defer' THEN greatest(q.attempts - 1, 0)
                    ELSE q.attempts END,
    last_error = CASE WHEN d.action IN ('retry', 'fail') THEN d.error ELSE q.last_error END,
    updated_at = clock.now,
    lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
FROM decided AS d, clock
WHERE q.id = d.id
RETURNING q.id, q.state, q.dead_reason;


-- name: queue_leases_not_held
-- The live leases of :owner other than :held_ids that no heartbeat has extended since their
-- claim, as the claim returns them: what a claim whose COMMIT reply was lost leased to this
-- worker without its knowing (the claim tokens included, so the worker can give them
-- back). A worker heartbeats every row it heard of, so a row it worked on and then let go
-- (its heartbeat's reply lost) is never taken for one. Read through the index of live
-- leases by expiry: a scan of the leased rows, never the history.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
)
SELECT q.id, q.kind, q.key, q.tenant, q.reason, q.payload, q.attempts, q.max_attempts,
       q.claim_token, q.lease_expires_at, q.created_at, q.last_error, q.updated_at AS claimed_at
FROM enrichq.queue AS q
CROSS JOIN clock
WHERE q.state = 'leased' AND q.lease_expires_at > clock.now AND q.lease_owner = :owner
  AND q.heartbeat_at = q.updated_at  -- both set by the claim, and only heartbeats move one
  AND NOT q.id = ANY(CAST(:held_ids AS bigint[]))
ORDER BY q.id;


-- name: queue_queued_ids
-- The queued row of each (kind, key): for merges that waited on a concurrent enqueue, whose
-- row committed after the enqueue statement's snapshot and so was not visible to it.
SELECT q.kind, q.key, q.id
FROM enrichq.queue AS q
JOIN unnest(CAST(:kinds AS text[]), CAST(:keys AS text[])) AS k(kind, key)
    ON q.kind = k.kind AND q.key = k.key
WHERE q.state = 'queued';


-- name: queue_read_back
-- The rows :ids as they are now: what a settle whose COMMIT reply was lost really did.
SELECT q.id, q.state, q.claim_token, q.attempts, q.dead_reason, q.last_error
FROM enrichq.queue AS q
WHERE q.id = ANY(CAST(:ids AS bigint[]));


-- name: queue_get
-- One row by id, every column (tests and the CLI).
SELECT * FROM enrichq.queue WHERE id = :id;
