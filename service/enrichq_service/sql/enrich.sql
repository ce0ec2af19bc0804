-- Enrichment reads and writes (DESIGN §4), and the fleet-wide admission of warehouse
-- lookups (the daily budget and the warehouse cap). Table names of the help desk mirror and
-- the warehouse come from settings; they are validated schema.table identifiers that the
-- loader's caller quotes into {tickets}, {customers} and {orders}, since a table name
-- cannot be a bound parameter. Everything else is bound.


-- name: enrich_read_tickets
-- The mirrored tickets with these ids (a missing id is not mirrored yet).
SELECT id, requester_email, tenant, created_at, updated_at
FROM {tickets}
WHERE id = ANY(CAST(:ids AS text[]));


-- name: enrich_warehouse_orders_batch
-- The orders of the customers with the requesters' e-mails, each with the e-mail it was
-- asked for as given, newest first: one warehouse query for a whole batch of tickets, the
-- same text on every dialect. {asked} is one `SELECT :asked_N AS asked` per e-mail joined
-- by UNION ALL (the caller renders the placeholders; the values are bound). Case is folded
-- once, by the warehouse's lower() on both sides, as parity compares e-mails: never by
-- Python on one side and SQL on the other (Python's lower() of `ΣΑΣ` is `σας`, SQL's
-- `σασ`).
SELECT a.asked AS email, o.order_id, o.customer_id, o.placed_at, o.total
FROM ({asked}) AS a
JOIN {customers} AS c ON lower(c.email) = lower(a.asked)
JOIN {orders} AS o ON o.customer_id = c.customer_id
ORDER BY a.asked, o.placed_at DESC, o.order_id;


-- name: enrich_statement_timeout
-- Limits the rest of the warehouse transaction's statements to :timeout_ms (text): the
-- attempt's remaining time (PostgreSQL warehouses).
SELECT set_config('statement_timeout', :timeout_ms, true);


-- name: enrich_upsert_enrichments
-- One row per enriched ticket, also for an empty result: when and from which queue row.
-- It runs first, with the tickets in byte order: its row lock (or its wait on an insert of
-- the same ticket not committed yet) serializes the result writes of one ticket, so the
-- delete that follows sees every order an earlier write committed, and the later write
-- replaces the earlier one whole. Two writers of overlapping tickets lock them in the same
-- order and never deadlock.
INSERT INTO enrichq.ticket_enrichments AS e (ticket_id, enriched_at, order_count, queue_id)
SELECT u.ticket_id, coalesce(u.enriched_at, now()), u.order_count, u.queue_id
FROM unnest(
    CAST(:tickets AS text[]), CAST(:enriched_ats AS timestamptz[]),
    CAST(:order_counts AS int[]), CAST(:queue_ids AS bigint[])
) AS u (ticket_id, enriched_at, order_count, queue_id)
ORDER BY u.ticket_id COLLATE "C"
ON CONFLICT (ticket_id) DO UPDATE
SET enriched_at = excluded.enriched_at, order_count = excluded.order_count,
    queue_id = excluded.queue_id;


-- name: enrich_delete_ticket_orders
-- Drop the previous result of these tickets: a new lookup replaces it whole.
DELETE FROM enrichq.ticket_orders WHERE ticket_id = ANY(CAST(:tickets AS text[]));


-- name: enrich_insert_ticket_orders
-- The orders found for the tickets whose settle won, one row per (ticket, order); an order
-- listed twice in one result is written once.
INSERT INTO enrichq.ticket_orders
    (ticket_id, order_id, customer_id, placed_at, total, looked_up_at, queue_id)
SELECT u.ticket_id, u.order_id, u.customer_id, u.placed_at, u.total,
       coalesce(u.looked_up_at, now()), u.queue_id
FROM unnest(
    CAST(:tickets AS text[]), CAST(:order_ids AS text[]), CAST(:customer_ids AS text[]),
    CAST(:placed_ats AS timestamptz[]), CAST(:totals AS numeric[]),
    CAST(:looked_up_ats AS timestamptz[]), CAST(:queue_ids AS bigint[])
) AS u (ticket_id, order_id, customer_id, placed_at, total, looked_up_at, queue_id)
ON CONFLICT (ticket_id, order_id) DO NOTHING;


-- name: enrich_log_lookups
-- Records each lookup once per claim (queue id and claim token: a settle that runs again
-- after a lost COMMIT reply records nothing twice), adds what it recorded now to today's
-- (UTC) budget ledger, and releases the lookups' fleet-wide reservations (:admissions),
-- counting the queries whose cost they learned (and the costliest) on the ledger.
-- Returns how many rows it recorded now.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
logged AS (
    INSERT INTO enrichq.lookup_log AS l
        (queue_id, claim_token, ticket_id, attempt, job_id, bytes_billed, rows, duration_ms,
         status, error, created_at)
    SELECT u.queue_id, u.claim_token, u.ticket_id, u.attempt, u.job_id, u.bytes_billed,
           u.rows, u.duration_ms, u.status, u.error, clock.now
    FROM unnest(
        CAST(:queue_ids AS bigint[]), CAST(:tokens AS uuid[]), CAST(:tickets AS text[]),
        CAST(:attempts AS int[]), CAST(:job_ids AS text[]), CAST(:bytes AS bigint[]),
        CAST(:rows AS int[]), CAST(:durations AS float8[]), CAST(:statuses AS text[]),
        CAST(:errors AS text[])
    ) AS u (queue_id, claim_token, ticket_id, attempt, job_id, bytes_billed, rows,
            duration_ms, status, error)
    CROSS JOIN clock
    ORDER BY u.queue_id
    ON CONFLICT (queue_id, claim_token) DO NOTHING
    RETURNING l.bytes_billed
),
-- the lookups' fleet-wide reservations, released (:admissions); each that learned its
-- query's real cost counts that query on the ledger (once: its row goes with the first
-- settle of its batch)
released AS (
    DELETE FROM enrichq.lookups_in_flight AS f
    WHERE f.token = ANY(CAST(:admissions AS uuid[]))
    RETURNING f.cost
),
-- The day's sum saturates at bigint's largest value instead of overflowing (numeric
-- arithmetic, then least): a ledger that reached it (one lookup's bill is at most 2^50
-- since enrichq_service.enrich.BYTES_MAX, but a row written before may be larger) means
-- "every budget spent", and never refuses the settles of the rest of the day.
charged AS (
    INSERT INTO enrichq.budget_ledger AS b
        (day, bytes_billed, lookups, queries, query_bytes_max, updated_at)
    SELECT CAST(timezone('UTC', clock.now) AS date),
           CAST(least(coalesce(g.bytes, 0), 9223372036854775807) AS bigint), g.n, r.n,
           coalesce(r.largest, 0), clock.now
    FROM clock
    CROSS JOIN (SELECT sum(l.bytes_billed) AS bytes, count(*) AS n FROM logged AS l) AS g
    CROSS JOIN (SELECT count(x.cost) AS n, max(x.cost) AS largest FROM released AS x) AS r
    WHERE g.n > 0 OR r.n > 0
    ON CONFLICT (day) DO UPDATE
    SET bytes_billed = CAST(least(CAST(b.bytes_billed AS numeric) + excluded.bytes_billed,
                                  9223372036854775807) AS bigint),
        lookups = b.lookups + excluded.lookups, queries = b.queries + excluded.queries,
        query_bytes_max = greatest(b.query_bytes_max, excluded.query_bytes_max),
        updated_at = excluded.updated_at
    RETURNING 1
)
SELECT (SELECT count(*) FROM logged) AS logged,
       (SELECT count(*) FROM charged) AS charged,
       (SELECT count(*) FROM released) AS released;


-- name: admission_take
-- Admits one warehouse lookup as :token, of :owner, under the cap (:cap, 0 = none) and
-- today's budget (:budget, 0 = none), fleet-wide, in one statement that takes and lets go
-- the fleet's admission lock (:lock_space) on the server: run outside a transaction, no
-- lock outlives it. Returns why it was refused ('cap', 'budget' or NULL), the bytes
-- reserved, whether that cost is known, the database time, and when the budget's day
-- resets (`enrichq.admission_take`, migration 0015, says how). It waits for the lock at
-- most its own lock_timeout (migration 0019): behind a transaction pooler a statement
-- outside a transaction runs without the session's statement timeout.
SELECT t.refused, t.reserved, t.known, t.now, t.resets_at
FROM enrichq.admission_take(
    CAST(:token AS uuid), CAST(:owner AS text), CAST(:cap AS integer), CAST(:budget AS bigint),
    CAST(:expected AS bigint), CAST(:lease_seconds AS float8), CAST(:now AS timestamptz),
    CAST(:lock_space AS integer)) AS t;


-- name: admission_reserve
-- Records the real cost of admitted lookup :token's query once it returned (:bytes), which
-- it holds until its settle charges it, and which tells the next admissions what a query
-- costs now.
UPDATE enrichq.lookups_in_flight SET reserved_bytes = :bytes, cost = :bytes
WHERE token = CAST(:token AS uuid);


-- name: admission_release
-- Releases the admission of lookups that never ran (deferred, or given back to wait).
DELETE FROM enrichq.lookups_in_flight WHERE token = ANY(CAST(:tokens AS uuid[]));


-- name: admission_extend
-- Extends the admissions :tokens of :owner's lookups in flight by :lease_seconds (its
-- heartbeat), those not expired yet (an expired slot may be someone else's by now); returns
-- the tokens it extended (a missing one was released, or expired).
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
)
UPDATE enrichq.lookups_in_flight AS f
SET expires_at = clock.now + make_interval(secs => CAST(:lease_seconds AS float8))
FROM clock
WHERE f.owner = :owner AND f.token = ANY(CAST(:tokens AS uuid[])) AND f.expires_at > clock.now
RETURNING f.token;


-- name: enrich_budget_today
-- Bytes billed so far on the current UTC day, and when that day ends.
SELECT coalesce((SELECT bytes_billed FROM enrichq.budget_ledger
                 WHERE day = CAST(timezone('UTC', coalesce(CAST(:now AS timestamptz), now()))
                                  AS date)), 0) AS bytes_billed,
       timezone('UTC', CAST(date_trunc('day', timezone('UTC',
           coalesce(CAST(:now AS timestamptz), now()))) + interval '1 day' AS timestamp))
           AS resets_at;


-- name: isolate_end_child_sessions
-- Ends the sessions of the isolated child named :name (its application_name), waiting up
-- to :timeout_ms for each to be gone; one row per session, gone true once it is.
SELECT a.pid, pg_terminate_backend(a.pid, CAST(:timeout_ms AS bigint)) AS gone
FROM pg_stat_activity AS a
WHERE a.application_name = :name AND a.pid <> pg_backend_pid();
