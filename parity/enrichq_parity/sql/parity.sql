-- Parity: shadow output (enrichq.ticket_orders, enrichq.ticket_enrichments) against the
-- legacy output, one day of tickets per statement. {tickets}, {legacy} and {orders} are the
-- configured tables, quoted by enrichq_parity.names (identifiers cannot be bound).

-- name: parity_now
-- The time parity measures against: :now when a test moves time; on a standby (a read
-- replica), the primary's commit time of the last transaction it has replayed, since what
-- it holds is the primary as of then (with nothing replayed since it started: its last
-- restartpoint), never later than its own clock; else the database clock. Judged by it, a
-- ticket whose results have not replayed yet is too young, never missing.
SELECT coalesce(
    CAST(:now AS timestamptz),
    CASE
        WHEN pg_is_in_recovery() THEN least(
            now(),
            coalesce(
                pg_last_xact_replay_timestamp(), (pg_control_checkpoint()).checkpoint_time
            )
        )
        ELSE now()
    END
) AS now


-- name: parity_read_side
-- Whether parity reads a standby, and how far its replay is behind its own clock (seconds;
-- NULL on a primary).
SELECT pg_is_in_recovery() AS standby,
       CASE
           WHEN pg_is_in_recovery() THEN extract(epoch FROM now() - coalesce(
               pg_last_xact_replay_timestamp(), (pg_control_checkpoint()).checkpoint_time
           ))
       END AS lag_seconds

-- name: parity_legacy_indexed
-- Whether the table :name can be probed by ticket id compared as text: it is not a plain
-- table (a view, whose base tables may be indexed), or it has a valid, non-partial index led
-- by CAST(ticket_id AS text), or (when :direct, a text or varchar ticket_id, whose index
-- serves text comparisons as it is) led by ticket_id itself.
SELECT c.relkind NOT IN ('r', 'p', 'm') OR EXISTS (
    SELECT 1
    FROM pg_index AS i
    LEFT JOIN pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
    WHERE i.indrelid = c.oid
      AND i.indisvalid
      AND i.indpred IS NULL
      AND (
          (CAST(:direct AS boolean) AND a.attname = 'ticket_id')
          OR (i.indkey[0] = 0 AND pg_get_indexdef(i.indexrelid, 1, false) = '((ticket_id)::text)')
      )
) AS indexed
FROM pg_class AS c
WHERE c.oid = to_regclass(:name)

-- name: parity_column_types
-- The type (pg_type.typname, the base type of a domain) of each column :columns of the
-- relation :name that exists.
SELECT a.attname AS column_name,
       CASE WHEN t.typtype = 'd' THEN b.typname ELSE t.typname END AS type_name
FROM pg_attribute AS a
JOIN pg_type AS t ON t.oid = a.atttypid
LEFT JOIN pg_type AS b ON b.oid = t.typbasetype
WHERE a.attrelid = to_regclass(:name)
  AND a.attnum > 0
  AND NOT a.attisdropped
  AND a.attname = ANY (CAST(:columns AS text[]))

-- name: parity_read_only
-- Parity never writes where it reads (the read side may be a replica).
SET TRANSACTION READ ONLY

-- name: parity_day_settings
-- For this day's transaction only: no JIT (its compile time exceeds what it saves on a
-- query made of many small index probes), room to group a day's tickets by tenant in
-- memory instead of spilling to temporary files, and (for the CSV export, which streams
-- through a server-side cursor) a plan for every row, not the cursor's fast first 10%.
SELECT set_config('jit', 'off', true), set_config('work_mem', '32MB', true),
       set_config('cursor_tuple_fraction', '1.0', true)

-- name: parity_day
-- One day of tickets (created in [:day_start, :day_end)): a 'class' row per (tenant, class)
-- with ticket, accepted-ticket and order counts, an 'excluded' row per (tenant, reason), a
-- 'rule' row per accept rule that matched (its ticket count and first :rule_sample ids),
-- 'sample' rows (up to :sample_size tickets per class other than exact, the most differing
-- orders first) and, when :export, a 'ticket' row for every such ticket, by ticket id.
-- :rules is the accept file's rules as a JSON array (AcceptRule.as_sql).
WITH
-- tickets with open queue rows (any kind) are still being processed. One branch per open
-- state, each implying its partial index's predicate; open rows are few, so the set is
-- hashed once per day rather than probed per ticket.
open_keys AS (
    SELECT q.key FROM enrichq.queue AS q WHERE q.state = 'queued'
    UNION
    SELECT q.key FROM enrichq.queue AS q WHERE q.state = 'leased'
),
-- one streaming pass over the day's tickets, per tenant: the tickets left out and why, the
-- exact matches and their orders, and the ids of the (few) tickets whose order sets differ
summary AS MATERIALIZED (
    SELECT d.tenant,
           count(*) FILTER (WHERE d.excluded = 'too_young') AS too_young,
           count(*) FILTER (WHERE d.excluded = 'open_queue_rows') AS open_queue_rows,
           count(*) FILTER (WHERE d.excluded = 'not_enriched') AS not_enriched,
           count(*) FILTER (WHERE d.excluded IS NULL AND d.same) AS exact,
           coalesce(sum(d.shadow_orders) FILTER (WHERE d.excluded IS NULL AND d.same), 0)
               AS exact_orders,
           array_agg(d.ticket_id) FILTER (WHERE d.excluded IS NULL AND NOT d.same)
               AS differing_ids,
           array_agg(d.created_at) FILTER (WHERE d.excluded IS NULL AND NOT d.same)
               AS differing_created_at,
           array_agg(d.requester_email) FILTER (WHERE d.excluded IS NULL AND NOT d.same)
               AS differing_emails
    FROM (
        -- the day's tickets, each with the reason it is left out (NULL: compared) and
        -- whether its two order sets are equal. OFFSET 0: each ticket's reason is worked
        -- out once, not once per aggregate that filters on it.
        SELECT p.ticket_id,
               p.tenant,
               p.requester_email,
               p.created_at,
               CASE
                   WHEN p.young THEN 'too_young'
                   WHEN p.open THEN 'open_queue_rows'
                   -- never looked up by enrichq, no legacy order: two empty sides are no
                   -- match, nothing was compared
                   -- (a scalar subquery, one row at most, probed only when reached: NOT
                   -- EXISTS could be planned as a hash of every enrichment row)
                   WHEN cardinality(c.legacy_ids) = 0
                        AND (
                            SELECT true FROM enrichq.ticket_enrichments AS e
                            WHERE e.ticket_id = p.ticket_id
                        ) IS NULL
                       THEN 'not_enriched'
               END AS excluded,
               -- equal as sets: each holds the other (a legacy order written twice too)
               c.legacy_ids @> c.shadow_ids AND c.shadow_ids @> c.legacy_ids AS same,
               cardinality(c.shadow_ids) AS shadow_orders
        FROM (
            SELECT CAST(t.id AS text) AS ticket_id,
                   coalesce(CAST(t.tenant AS text), '') AS tenant,
                   CAST(t.requester_email AS text) AS requester_email,
                   t.created_at,
                   t.created_at > CAST(:young_after AS timestamptz) AS young,
                   o.key IS NOT NULL AS open
            FROM {tickets} AS t
            LEFT JOIN open_keys AS o ON o.key = CAST(t.id AS text)
            WHERE t.created_at >= CAST(:day_start AS timestamptz)
              AND t.created_at < CAST(:day_end AS timestamptz)
        ) AS p
        -- each ticket old enough and not in the queue: its two order sets, two index
        -- probes (enrichment is probed for only when legacy has no order), reduced above to
        -- whether they are equal (so only a boolean and a count reach the grouping). The
        -- arrays are not sorted: a sort per ticket would cost more than the comparison.
        -- Ids compare as text whatever the legacy columns' types (as the worker and the
        -- consumer view compare them). OFFSET 0 builds each array once.
        LEFT JOIN LATERAL (
            SELECT ARRAY(
                       SELECT CAST(l.order_id AS text) FROM {legacy} AS l
                       WHERE CAST(l.ticket_id AS text) = p.ticket_id
                         AND l.order_id IS NOT NULL
                   ) AS legacy_ids,
                   ARRAY(
                       SELECT s.order_id FROM enrichq.ticket_orders AS s
                       WHERE s.ticket_id = p.ticket_id
                   ) AS shadow_ids
            OFFSET 0
        ) AS c ON NOT p.young AND NOT p.open
        OFFSET 0
    ) AS d
    GROUP BY d.tenant
),
-- the differing tickets: the orders on one side only (sorted), when legacy looked the
-- ticket up, and when (whether) enrichq enriched it
differing AS MATERIALIZED (
    SELECT x.ticket_id,
           x.tenant,
           x.created_at,
           x.requester_email,
           cardinality(x.legacy_ids) AS legacy_orders,
           cardinality(x.shadow_ids) AS shadow_orders,
           ARRAY(
               SELECT unnest(x.legacy_ids) EXCEPT SELECT unnest(x.shadow_ids) ORDER BY 1
           ) AS missing_ids,
           ARRAY(
               SELECT unnest(x.shadow_ids) EXCEPT SELECT unnest(x.legacy_ids) ORDER BY 1
           ) AS shadow_only_ids,
           (
               SELECT max(l.looked_up_at) FROM {legacy} AS l
               WHERE CAST(l.ticket_id AS text) = x.ticket_id
           ) AS legacy_looked_up_at,
           (
               SELECT e.enriched_at FROM enrichq.ticket_enrichments AS e
               WHERE e.ticket_id = x.ticket_id
           ) AS enriched_at
    FROM (
        SELECT u.ticket_id,
               s.tenant,
               u.created_at,
               u.requester_email,
               ARRAY(
                   SELECT DISTINCT CAST(l.order_id AS text) FROM {legacy} AS l
                   WHERE CAST(l.ticket_id AS text) = u.ticket_id AND l.order_id IS NOT NULL
               ) AS legacy_ids,
               ARRAY(
                   SELECT o.order_id FROM enrichq.ticket_orders AS o
                   WHERE o.ticket_id = u.ticket_id
               ) AS shadow_ids
        FROM summary AS s,
             unnest(s.differing_ids, s.differing_created_at, s.differing_emails)
                 AS u (ticket_id, created_at, requester_email)
        OFFSET 0
    ) AS x
),
-- every shadow-only order checked against the warehouse. Verified: an order of the ticket's
-- customer (found by the requester's e-mail, as enrichq's lookup finds it) placed no later
-- than enrichq's lookup of the ticket. A verified order placed after the legacy lookup is
-- drift, another is an extra; an order the warehouse does not confirm is unverified.
checked AS MATERIALIZED (
    SELECT d.*, v.extra_ids, v.drift_ids, v.unverified_ids
    FROM differing AS d
    CROSS JOIN LATERAL (
        SELECT coalesce(
                   array_agg(o.order_id ORDER BY o.order_id) FILTER (WHERE o.verified AND NOT o.drift),
                   CAST('{}' AS text[])
               ) AS extra_ids,
               coalesce(
                   array_agg(o.order_id ORDER BY o.order_id) FILTER (WHERE o.verified AND o.drift),
                   CAST('{}' AS text[])
               ) AS drift_ids,
               coalesce(
                   array_agg(o.order_id ORDER BY o.order_id) FILTER (WHERE NOT o.verified),
                   CAST('{}' AS text[])
               ) AS unverified_ids
        FROM (
            SELECT u.order_id,
                   w.placed_at IS NOT NULL AS verified,
                   coalesce(w.placed_at > d.legacy_looked_up_at, false) AS drift
            FROM unnest(d.shadow_only_ids) AS u (order_id)
            LEFT JOIN LATERAL (
                SELECT w.placed_at
                FROM {orders} AS w
                JOIN {customers} AS k ON k.customer_id = w.customer_id
                JOIN enrichq.ticket_orders AS s
                  ON s.ticket_id = d.ticket_id AND s.order_id = u.order_id
                WHERE CAST(w.order_id AS text) = u.order_id
                  AND lower(k.email) = lower(d.requester_email)
                  AND w.placed_at <= s.looked_up_at
                ORDER BY w.placed_at
                LIMIT 1
            ) AS w ON true
        ) AS o
    ) AS v
),
-- every differing ticket with its counts and its class (the summary already counted a
-- ticket whose sets are equal exact; the last branch is kept for completeness)
classified AS MATERIALIZED (
    SELECT ticket_id,
           tenant,
           created_at,
           enriched_at,
           legacy_looked_up_at,
           legacy_orders,
           legacy_orders - cardinality(missing_ids) AS matched_orders,
           cardinality(missing_ids) AS missing_orders,
           cardinality(extra_ids) AS extra_orders,
           cardinality(drift_ids) AS drift_orders,
           cardinality(unverified_ids) AS unverified_orders,
           cardinality(missing_ids) + cardinality(shadow_only_ids) AS differing_orders,
           missing_ids,
           extra_ids,
           drift_ids,
           unverified_ids,
           CASE
               WHEN legacy_orders > 0 AND shadow_orders = 0 AND enriched_at IS NULL
                   THEN 'shadow_missing'
               WHEN cardinality(missing_ids) > 0 THEN 'partial'
               WHEN cardinality(unverified_ids) > 0 THEN 'unverified'
               -- the legacy flow found none of the orders that existed when it looked;
               -- orders placed after its lookup alone are drift (below), not its fault
               WHEN legacy_orders = 0 AND cardinality(extra_ids) > 0 THEN 'legacy_missing'
               WHEN cardinality(extra_ids) > 0 THEN 'extra_only'
               WHEN cardinality(drift_ids) > 0 THEN 'drift_only'
               ELSE 'exact'
           END AS ticket_class
    FROM checked
),
-- the accept file's rules; a rule scoped by ticket ids lists them in rule_tickets
rules AS (
    SELECT r.rule, r.ticket_class, r.tenant, r.tickets, r.first_day, r.last_day
    FROM jsonb_to_recordset(CAST(:rules AS jsonb)) AS r (
        rule int, ticket_class text, tenant text, tickets text[], first_day date, last_day date
    )
),
rule_tickets AS (
    SELECT r.rule, u.ticket_id FROM rules AS r, unnest(r.tickets) AS u (ticket_id)
),
-- every (rule, ticket) an accept rule covers (a ticket may match several rules); the ids a
-- rule lists are one hashed set, not a scan of the list per ticket
matches AS MATERIALIZED (
    SELECT r.rule, c.ticket_id
    FROM classified AS c
    JOIN rules AS r
      ON r.ticket_class = c.ticket_class
     AND (r.tenant IS NULL OR r.tenant = c.tenant)
     AND (
         r.first_day IS NULL
         OR CAST(timezone('UTC', c.created_at) AS date) BETWEEN r.first_day AND r.last_day
     )
    WHERE r.tickets IS NULL
       OR (r.rule, c.ticket_id) IN (SELECT rt.rule, rt.ticket_id FROM rule_tickets AS rt)
),
-- each differing ticket with the rules that accept it (NULL: none)
marked AS MATERIALIZED (
    SELECT c.*, a.accepted_by
    FROM classified AS c
    LEFT JOIN (
        SELECT m.ticket_id, array_agg(m.rule ORDER BY m.rule) AS accepted_by
        FROM matches AS m
        GROUP BY m.ticket_id
    ) AS a ON a.ticket_id = c.ticket_id
)
SELECT 'class' AS row_kind, tenant, 'exact' AS ticket_class, CAST(NULL AS int) AS rule,
       exact AS tickets,
       CAST(0 AS bigint) AS accepted,
       exact_orders AS legacy_orders,
       exact_orders AS matched_orders,
       CAST(0 AS bigint) AS missing_orders,
       CAST(0 AS bigint) AS extra_orders,
       CAST(0 AS bigint) AS drift_orders,
       CAST(0 AS bigint) AS unverified_orders,
       CAST(NULL AS text) AS ticket_id,
       CAST(NULL AS timestamptz) AS created_at,
       CAST(NULL AS timestamptz) AS enriched_at,
       CAST(NULL AS timestamptz) AS legacy_looked_up_at,
       CAST(NULL AS text[]) AS missing_ids,
       CAST(NULL AS text[]) AS extra_ids,
       CAST(NULL AS text[]) AS drift_ids,
       CAST(NULL AS text[]) AS unverified_ids,
       CAST(NULL AS int[]) AS accepted_by,
       CAST(NULL AS text[]) AS matched_ids
FROM summary
WHERE exact > 0
UNION ALL
SELECT 'excluded', tenant, 'too_young', NULL, too_young, 0, 0, 0, 0, 0, 0, 0,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM summary
WHERE too_young > 0
UNION ALL
SELECT 'excluded', tenant, 'open_queue_rows', NULL, open_queue_rows, 0, 0, 0, 0, 0, 0, 0,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM summary
WHERE open_queue_rows > 0
UNION ALL
SELECT 'excluded', tenant, 'not_enriched', NULL, not_enriched, 0, 0, 0, 0, 0, 0, 0,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM summary
WHERE not_enriched > 0
UNION ALL
SELECT 'class', tenant, ticket_class, NULL, count(*), count(accepted_by),
       sum(legacy_orders), sum(matched_orders), sum(missing_orders), sum(extra_orders),
       sum(drift_orders), sum(unverified_orders),
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM marked
GROUP BY tenant, ticket_class
UNION ALL
-- per rule: the tickets it matched, and the first few by id
SELECT 'rule', '', NULL, m.rule, count(*), count(*), 0, 0, 0, 0, 0, 0,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       (array_agg(m.ticket_id ORDER BY m.ticket_id))[1:CAST(:rule_sample AS int)]
FROM matches AS m
GROUP BY m.rule
UNION ALL
-- the sample: per class other than exact, the tickets with the most differing orders
SELECT 'sample', tenant, ticket_class, NULL, 1, 0, legacy_orders, matched_orders,
       missing_orders, extra_orders, drift_orders, unverified_orders, ticket_id, created_at,
       enriched_at, legacy_looked_up_at, missing_ids, extra_ids, drift_ids, unverified_ids,
       accepted_by, NULL
FROM (
    SELECT marked.*,
           row_number() OVER (
               PARTITION BY ticket_class ORDER BY differing_orders DESC, ticket_id
           ) AS rank_in_class
    FROM marked
    WHERE ticket_class <> 'exact'
) AS ranked
WHERE rank_in_class <= :sample_size
UNION ALL
-- the export: every ticket of a class other than exact (only when asked for)
SELECT 'ticket', tenant, ticket_class, NULL, 1, 0, legacy_orders, matched_orders,
       missing_orders, extra_orders, drift_orders, unverified_orders, ticket_id, created_at,
       enriched_at, legacy_looked_up_at, missing_ids, extra_ids, drift_ids, unverified_ids,
       accepted_by, NULL
FROM marked
WHERE ticket_class <> 'exact' AND CAST(:export AS boolean)
ORDER BY row_kind, ticket_id

-- name: parity_coverage
-- Every ticket consumers can read through the view, all time: per tenant of {tickets}
-- ('' = none) its tickets, those created before :young_after that enrichq never enriched,
-- the tickets enrichq enriched and its order rows; then one row (tenant NULL) for the
-- tickets with rows in {legacy} that {tickets} lacks, and how many of them enrichq never
-- enriched (only when :legacy_only: the costliest pass, which only a whole cutover needs;
-- else that row says 0). Once per parity run and cutover, hashed passes: the mirror's
-- tickets counted per tenant; the mirror hashed once, probed by both shadow tables' rows.
WITH mirror AS (
    SELECT coalesce(CAST(t.tenant AS text), '') AS tenant,
           count(*) AS tickets,
           count(*) FILTER (WHERE t.created_at <= CAST(:young_after AS timestamptz)) AS old
    FROM {tickets} AS t
    GROUP BY 1
),
-- per tenant, the tickets enrichq enriched (and of them those created before
-- :young_after) and enrichq's order rows; a ticket not enriched is an old one without
-- an enrichment row (ticket_enrichments holds one row per ticket)
shadow AS (
    SELECT coalesce(CAST(t.tenant AS text), '') AS tenant,
           count(*) FILTER (WHERE s.enrichment) AS enriched,
           count(*) FILTER (
               WHERE s.enrichment AND t.created_at <= CAST(:young_after AS timestamptz)
           ) AS enriched_old,
           count(*) FILTER (WHERE NOT s.enrichment) AS shadow_orders
    FROM (
        SELECT e.ticket_id, true AS enrichment FROM enrichq.ticket_enrichments AS e
        UNION ALL
        SELECT o.ticket_id, false FROM enrichq.ticket_orders AS o
    ) AS s
    JOIN {tickets} AS t ON CAST(t.id AS text) = s.ticket_id
    GROUP BY 1
),
-- the mirror's lack is found row by row first (an anti join), then the few ticket ids it
-- leaves are made distinct: distinct first would hash every legacy ticket id
legacy_only AS (
    SELECT l.ticket_id,
           EXISTS (
               SELECT 1 FROM enrichq.ticket_enrichments AS e WHERE e.ticket_id = l.ticket_id
           ) AS enriched
    FROM (
        SELECT DISTINCT CAST(x.ticket_id AS text) AS ticket_id
        FROM {legacy} AS x
        WHERE CAST(:legacy_only AS boolean)
          AND NOT EXISTS (
              SELECT 1 FROM {tickets} AS t
              WHERE CAST(t.id AS text) = CAST(x.ticket_id AS text)
          )
    ) AS l
)
SELECT m.tenant,
       m.tickets,
       m.old - coalesce(s.enriched_old, 0) AS not_enriched,
       coalesce(s.enriched, 0) AS enriched,
       coalesce(s.shadow_orders, 0) AS shadow_orders
FROM mirror AS m
LEFT JOIN shadow AS s ON s.tenant = m.tenant
UNION ALL
SELECT NULL, count(*), count(*) FILTER (WHERE NOT enriched), count(*) FILTER (WHERE enriched), 0
FROM legacy_only
ORDER BY 1 NULLS LAST

-- name: parity_run_start
-- Opens an enrichq.parity_runs row (finished_at NULL until the run ends); returns its id.
INSERT INTO enrichq.parity_runs (
    started_at, window_since, window_until, min_order_coverage, min_ticket_match_rate,
    max_shadow_fault_rate, accept_rules, accept_sha256
) VALUES (
    coalesce(CAST(:now AS timestamptz), now()),
    CAST(:since AS timestamptz),
    CAST(:until AS timestamptz),
    :min_order_coverage,
    :min_ticket_match_rate,
    :max_shadow_fault_rate,
    :accept_rules,
    :accept_sha256
)
RETURNING id, started_at

-- name: parity_run_finish
-- Closes a parity run with its results and the full report; returns finished_at.
UPDATE enrichq.parity_runs
SET finished_at = coalesce(CAST(:now AS timestamptz), clock_timestamp()),
    tickets_compared = :tickets_compared,
    tickets_excluded = :tickets_excluded,
    exact_matches = :exact_matches,
    order_coverage = :order_coverage,
    ticket_match_rate = :ticket_match_rate,
    shadow_faults = :shadow_faults,
    shadow_fault_rate = :shadow_fault_rate,
    legacy_faults = :legacy_faults,
    accepted_legacy_faults = :accepted_legacy_faults,
    passed = :passed,
    data_at = :data_at,
    replica_lag_seconds = :replica_lag_seconds,
    coverage = CAST(:coverage AS jsonb),
    report = CAST(:report AS jsonb)
WHERE id = :id
RETURNING finished_at

-- name: parity_run_abandon
-- Leaves an errored parity run unfinished (never "the latest run") with the error kept; a
-- run already finished keeps its report (the error came after it was recorded).
UPDATE enrichq.parity_runs
SET report = jsonb_build_object('error', CAST(:error AS text))
WHERE id = :id AND finished_at IS NULL

-- name: parity_latest
-- The latest finished parity run: what the gauges show and what cutover is gated on.
SELECT id, finished_at, order_coverage, ticket_match_rate, passed
FROM enrichq.parity_runs
WHERE finished_at IS NOT NULL
ORDER BY finished_at DESC, id DESC
LIMIT 1
