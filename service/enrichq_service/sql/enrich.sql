-- Enrichment reads and writes (DESIGN §4). Table names of the help desk mirror and the
-- warehouse come from settings; they are validated schema.table identifiers that the
-- loader's caller quotes into {tickets}, {customers} and {orders}, since a table name
-- cannot be a bound parameter. Everything else is bound.


-- name: enrich_read_tickets
-- The mirrored tickets with these ids (a missing id is not mirrored yet).
SELECT id, requester_email, tenant, created_at, updated_at
FROM {tickets}
WHERE id = ANY(CAST(:ids AS text[]));


-- name: enrich_warehouse_orders
-- Orders of the customer(s) with this e-mail, newest first (case-insensitive match).
SELECT o.order_id, o.customer_id, o.placed_at, o.total
FROM {customers} AS c
JOIN {orders} AS o ON o.customer_id = c.customer_id
WHERE lower(c.email) = lower(:email)
ORDER BY o.placed_at DESC, o.order_id;


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


-- name: enrich_insert_lookup_log
-- One row per warehouse lookup, whether or not its result was written.
INSERT INTO enrichq.lookup_log
    (queue_id, ticket_id, attempt, job_id, bytes_billed, rows, duration_ms, status, error)
SELECT *
FROM unnest(
    CAST(:queue_ids AS bigint[]), CAST(:tickets AS text[]), CAST(:attempts AS int[]),
    CAST(:job_ids AS text[]), CAST(:bytes AS bigint[]), CAST(:rows AS int[]),
    CAST(:durations AS float8[]), CAST(:statuses AS text[]), CAST(:errors AS text[])
);


-- name: enrich_add_to_budget
-- Add bytes billed and lookups to today's (UTC) ledger row.
INSERT INTO enrichq.budget_ledger AS b (day, bytes_billed, lookups, updated_at)
VALUES (CAST(timezone('UTC', coalesce(CAST(:now AS timestamptz), now())) AS date),
        :bytes, :lookups, coalesce(CAST(:now AS timestamptz), now()))
ON CONFLICT (day) DO UPDATE
SET bytes_billed = b.bytes_billed + excluded.bytes_billed,
    lookups = b.lookups + excluded.lookups, updated_at = excluded.updated_at;


-- name: enrich_budget_today
-- Bytes billed so far on the current UTC day, and when that day ends.
SELECT coalesce((SELECT bytes_billed FROM enrichq.budget_ledger
                 WHERE day = CAST(timezone('UTC', coalesce(CAST(:now AS timestamptz), now()))
                                  AS date)), 0) AS bytes_billed,
       timezone('UTC', CAST(date_trunc('day', timezone('UTC',
           coalesce(CAST(:now AS timestamptz), now()))) + interval '1 day' AS timestamp))
           AS resets_at;
