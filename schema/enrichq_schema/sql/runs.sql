-- The run log: one enrichq.runs row per worker, sweeper or parity invocation.


-- name: runs_start
-- A new run of :component by :owner, started now, with the :counts it starts with (JSON,
-- e.g. which sweeper task); returns its id.
INSERT INTO enrichq.runs (component, owner, started_at, seen_at, counts)
VALUES (:component, :owner, coalesce(CAST(:now AS timestamptz), now()),
        coalesce(CAST(:now AS timestamptz), now()), CAST(:counts AS jsonb))
RETURNING id;


-- name: runs_seen
-- Stamps open run :id with a sign of life (its worker's heartbeat); no-op once closed.
UPDATE enrichq.runs
SET seen_at = coalesce(CAST(:now AS timestamptz), now())
WHERE id = :id AND finished_at IS NULL;


-- name: runs_close_silent
-- Closes up to :limit open runs that gave no sign of life for :worker_silent_seconds (a
-- worker's, stamped by its heartbeat) or :other_silent_seconds (the others', stamped only
-- when they start), with stop reason 'lost' and finished_at = their last sign of life, so
-- retention ages them from then; through runs_open_seen_at_idx, skipping rows a run is
-- closing itself. Returns (component, how many) per component.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
),
silent AS (
    SELECT r.id
    FROM enrichq.runs AS r
    CROSS JOIN clock
    WHERE r.finished_at IS NULL
      AND r.seen_at < clock.now - make_interval(secs => CAST(:worker_silent_seconds AS float8))
      AND (r.component = 'worker'
           OR r.seen_at < clock.now - make_interval(secs => CAST(:other_silent_seconds AS float8)))
    ORDER BY r.seen_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
),
closed AS (
    UPDATE enrichq.runs AS r
    SET finished_at = r.seen_at,
        stop_reason = 'lost',
        error = :error
    FROM silent AS s
    WHERE r.id = s.id AND r.finished_at IS NULL
    RETURNING r.component
)
SELECT component, count(*) AS n FROM closed GROUP BY component;


-- name: runs_finish
-- Close run :id with its stop reason, counts and error (if any); a run the sweeper closed
-- as lost meanwhile gets its real end instead.
UPDATE enrichq.runs
SET finished_at = coalesce(CAST(:now AS timestamptz), now()),
    stop_reason = :stop_reason,
    counts = CAST(:counts AS jsonb),
    error = :error
WHERE id = :id;


-- name: runs_latest
-- The newest finished run of :component.
SELECT id, component, owner, started_at, finished_at, stop_reason, counts, error
FROM enrichq.runs
WHERE component = :component AND finished_at IS NOT NULL
ORDER BY started_at DESC
LIMIT 1;
