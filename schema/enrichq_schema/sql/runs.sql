-- The run log: one enrichq.runs row per worker, sweeper or parity invocation.


-- name: runs_start
-- A new run of :component by :owner, started now, with the :counts it starts with (JSON,
-- e.g. which sweeper task); returns its id.
INSERT INTO enrichq.runs (component, owner, started_at, counts)
VALUES (:component, :owner, coalesce(CAST(:now AS timestamptz), now()),
        CAST(:counts AS jsonb))
RETURNING id;


-- name: runs_finish
-- Close run :id with its stop reason, counts and error (if any).
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
