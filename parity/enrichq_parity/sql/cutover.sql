-- Cutover: the consumer view enrichq_public.ticket_orders, the tenants a staged cutover has
-- moved, and the record of every step. {source}, {legacy} and {tickets} are tables the view
-- reads, quoted by enrichq_parity.names (a view definition cannot take bound parameters).

-- name: cutover_lock
-- Serializes cutovers, rollbacks and view creation; released when the transaction ends.
SELECT pg_advisory_xact_lock(hashtext('enrichq.cutover'))

-- name: cutover_lock_timeout
-- Stop waiting for the view's lock after :timeout: a long reader must not make every other
-- reader queue behind the swap (local to the transaction).
SELECT set_config('lock_timeout', :timeout, true)

-- name: cutover_now
-- The time the gate measures against: :now when a test moves time, else the database clock.
SELECT coalesce(CAST(:now AS timestamptz), now()) AS now

-- name: cutover_schema_exists
-- Whether the schema :name exists.
SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = :name) AS present

-- name: cutover_view_sources
-- The tables and views the view :view reads, as schema and name.
SELECT DISTINCT n.nspname AS schema_name, c.relname AS table_name
FROM pg_rewrite AS r
JOIN pg_depend AS d
  ON d.classid = CAST('pg_rewrite' AS regclass)
 AND d.objid = r.oid
 AND d.refclassid = CAST('pg_class' AS regclass)
JOIN pg_class AS c ON c.oid = d.refobjid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE r.ev_class = to_regclass(:view)
  AND d.refobjid <> r.ev_class
ORDER BY 1, 2

-- name: cutover_gate_run
-- The latest finished parity run, as the gate judges it: its bars, its counts over every
-- ticket and per tenant (not its samples), its window, what it read and when.
SELECT id, finished_at, min_order_coverage, max_shadow_fault_rate, min_ticket_match_rate,
       window_since, window_until, data_at, replica_lag_seconds, coverage,
       report -> 'total' AS total, report -> 'tenants' AS tenants
FROM enrichq.parity_runs
WHERE finished_at IS NOT NULL
ORDER BY finished_at DESC, id DESC
LIMIT 1

-- name: cutover_point_view
-- Points the consumer view at {source} alone. The casts keep the columns' names and types
-- the same whatever it reads, so CREATE OR REPLACE always applies and readers' cached plans
-- stay valid.
CREATE OR REPLACE VIEW enrichq_public.ticket_orders AS
SELECT CAST(src.ticket_id AS text) AS ticket_id,
       CAST(src.order_id AS text) AS order_id,
       CAST(src.looked_up_at AS timestamptz) AS looked_up_at
FROM {source} AS src

-- name: cutover_point_view_staged
-- Points the consumer view at both tables: a ticket of a tenant listed in
-- enrichq_public.cutover_tenants reads enrichq's rows, any other ticket (a ticket missing
-- from {tickets} included) the legacy rows. The tenant is found by the ticket's id, so a
-- read of one ticket stays index lookups on every table; moving a tenant is a row in
-- cutover_tenants, committed with its event, and needs no lock on the view.
CREATE OR REPLACE VIEW enrichq_public.ticket_orders AS
SELECT CAST(l.ticket_id AS text) AS ticket_id,
       CAST(l.order_id AS text) AS order_id,
       CAST(l.looked_up_at AS timestamptz) AS looked_up_at
FROM {legacy} AS l
WHERE NOT EXISTS (
    SELECT 1
    FROM {tickets} AS t
    JOIN enrichq_public.cutover_tenants AS c ON c.tenant = coalesce(CAST(t.tenant AS text), '')
    WHERE CAST(t.id AS text) = CAST(l.ticket_id AS text)
)
UNION ALL
SELECT s.ticket_id, s.order_id, s.looked_up_at
FROM enrichq.ticket_orders AS s
WHERE EXISTS (
    SELECT 1
    FROM {tickets} AS t
    JOIN enrichq_public.cutover_tenants AS c ON c.tenant = coalesce(CAST(t.tenant AS text), '')
    WHERE CAST(t.id AS text) = s.ticket_id
)

-- name: cutover_staged_tenants
-- The tenants whose consumers read enrichq's rows while a cutover is staged.
SELECT tenant FROM enrichq_public.cutover_tenants ORDER BY tenant

-- name: cutover_stage_tenant
-- Moves tenant :tenant to enrichq's rows, by cutover event :event_id.
INSERT INTO enrichq_public.cutover_tenants (tenant, event_id)
VALUES (:tenant, :event_id)
ON CONFLICT (tenant) DO UPDATE SET event_id = excluded.event_id

-- name: cutover_unstage_tenants
-- Moves the tenants :tenants back to the legacy rows.
DELETE FROM enrichq_public.cutover_tenants WHERE tenant = ANY(CAST(:tenants AS text[]))

-- name: cutover_unstage_all
-- Empties the staged set (the view reads one table again).
DELETE FROM enrichq_public.cutover_tenants

-- name: cutover_record
-- Records one cutover or rollback step (:tenant NULL: every tenant); returns its id and time.
INSERT INTO enrichq.cutover_events (action, target, parity_run_id, actor, at, note, tenant)
VALUES (
    :action,
    :target,
    :parity_run_id,
    :actor,
    coalesce(CAST(:now AS timestamptz), now()),
    :note,
    :tenant
)
RETURNING id, at

-- name: cutover_status_events
-- The latest step per tenant (tenant NULL: a step that moved every tenant), newest first.
SELECT DISTINCT ON (tenant) id, action, target, parity_run_id, actor, at, tenant
FROM enrichq.cutover_events
ORDER BY tenant, id DESC
