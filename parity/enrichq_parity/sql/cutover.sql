-- Cutover: the consumer view enrichq_public.ticket_orders and the record of every change.
-- {source} is the table the view is pointed at, quoted by enrichq_parity.names
-- (a view definition cannot take bound parameters).

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

-- name: cutover_relation_exists
-- Whether the relation named :name (schema.table, quoted) exists.
SELECT to_regclass(:name) IS NOT NULL AS present

-- name: cutover_view_sources
-- The tables and views the view :view reads, as schema and name (one row after a swap).
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

-- name: cutover_latest_run
-- The latest finished parity run: the one the gate judges.
SELECT id, finished_at, passed, order_coverage, ticket_match_rate
FROM enrichq.parity_runs
WHERE finished_at IS NOT NULL
ORDER BY finished_at DESC, id DESC
LIMIT 1

-- name: cutover_point_view
-- Points the consumer view at {source}. The casts keep the columns' names and types the
-- same whichever table it reads, so CREATE OR REPLACE always applies and readers' cached
-- plans stay valid.
CREATE OR REPLACE VIEW enrichq_public.ticket_orders AS
SELECT CAST(src.ticket_id AS text) AS ticket_id,
       CAST(src.order_id AS text) AS order_id,
       CAST(src.looked_up_at AS timestamptz) AS looked_up_at
FROM {source} AS src

-- name: cutover_record
-- Records one cutover or rollback; returns its id and time.
INSERT INTO enrichq.cutover_events (action, target, parity_run_id, actor, at, note)
VALUES (
    :action,
    :target,
    :parity_run_id,
    :actor,
    coalesce(CAST(:now AS timestamptz), now()),
    :note
)
RETURNING id, at
