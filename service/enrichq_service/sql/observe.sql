-- Read-only questions about the queue for `enrichq status` and the /metrics gauges.
-- Open rows are counted live through their partial indexes. A scrape reads terminal rows
-- from enrichq.queue_counts (the sweeper leader's count, once a pass), so it never walks
-- the history; `enrichq status`, on demand, counts them exactly.


-- name: observe_open_counts
-- Queued and leased rows by kind and state (index-only over the open-row partial indexes).
SELECT kind, 'queued' AS state, count(*) AS n
FROM enrichq.queue WHERE state = 'queued' GROUP BY kind
UNION ALL
SELECT kind, 'leased' AS state, count(*) AS n
FROM enrichq.queue WHERE state = 'leased' GROUP BY kind;


-- name: observe_counted
-- The sweeper's last count of terminal rows: kind, state, dead reason ('' when none), rows,
-- and when it was counted (unix seconds).
SELECT kind, state, dead_reason, rows, extract(epoch FROM counted_at) AS counted_at
FROM enrichq.queue_counts;


-- name: observe_terminal_counts
-- Done, failed and dead-letter rows by kind and state (exact; for `status`, not for scrapes).
SELECT kind, state, count(*) AS n
FROM enrichq.queue
WHERE state IN ('done', 'failed', 'dead_letter')
GROUP BY kind, state;


-- name: observe_dead_letters_by_reason
-- Dead letters by reason, through the dead-letter partial index (exact; for `status`).
SELECT kind, dead_reason AS reason, count(*) AS n
FROM enrichq.queue WHERE state = 'dead_letter'
GROUP BY kind, dead_reason;


-- name: observe_oldest_visible
-- Per kind, seconds since the oldest queued row became visible (0 when none is visible).
SELECT kind,
       extract(epoch FROM coalesce(CAST(:now AS timestamptz), now()) - min(visible_at))
           AS age_seconds
FROM enrichq.queue
WHERE state = 'queued' AND visible_at <= coalesce(CAST(:now AS timestamptz), now())
GROUP BY kind;


-- name: observe_next_visible
-- Per kind, the queued rows not visible yet (a visibility delay or a backoff): how many, and
-- in how many seconds the first of them becomes visible.
SELECT kind,
       count(*) AS waiting,
       extract(epoch FROM min(visible_at) - coalesce(CAST(:now AS timestamptz), now()))
           AS in_seconds
FROM enrichq.queue
WHERE state = 'queued' AND visible_at > coalesce(CAST(:now AS timestamptz), now())
GROUP BY kind;


-- name: observe_leases
-- Live and expired leases.
SELECT count(*) FILTER (WHERE lease_expires_at > coalesce(CAST(:now AS timestamptz), now()))
           AS live,
       count(*) FILTER (WHERE lease_expires_at <= coalesce(CAST(:now AS timestamptz), now()))
           AS expired
FROM enrichq.queue WHERE state = 'leased';


-- name: observe_vacuum
-- Dead tuples and the last autovacuum of the queue table.
SELECT n_dead_tup AS dead_tuples,
       extract(epoch FROM greatest(last_autovacuum, last_vacuum)) AS last_vacuum_epoch
FROM pg_stat_user_tables
WHERE schemaname = 'enrichq' AND relname = 'queue';


-- name: observe_oldest_transaction
-- Age in seconds of the oldest open transaction in this database: it holds back vacuum.
SELECT coalesce(extract(epoch FROM now() - min(xact_start)), 0) AS age_seconds
FROM pg_stat_activity
WHERE datname = current_database() AND xact_start IS NOT NULL
  AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
  AND pid <> pg_backend_pid();


-- name: observe_budget_today
-- Warehouse bytes billed on the current UTC day.
SELECT coalesce(sum(bytes_billed), 0) AS bytes_billed
FROM enrichq.budget_ledger
WHERE day = CAST(timezone('UTC', coalesce(CAST(:now AS timestamptz), now())) AS date);


-- name: observe_statement_timeout
-- Caps every statement of this transaction at :timeout (e.g. '2s') so a scrape never hangs.
SELECT set_config('statement_timeout', :timeout, true);

