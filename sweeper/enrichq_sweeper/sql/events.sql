-- Retention of the webhook dedupe table (enrichq.seen_events): an event id older than
-- ENRICHQ_EVENT_DEDUPE_HOURS no longer makes a redelivery a duplicate, so it goes.


-- name: retention_prune_seen_events
-- Deletes up to :batch_size event ids seen before :cutoff, oldest first, found through
-- seen_events_seen_at_idx (skipping ids an ingest transaction holds); returns
-- ('seen_events', n).
WITH doomed AS (
    SELECT s.event_id
    FROM enrichq.seen_events AS s
    WHERE s.seen_at < CAST(:cutoff AS timestamptz)
    ORDER BY s.seen_at
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
),
-- by primary key, id by id: a join with doomed was planned as a hash over the whole table
deleted AS (
    DELETE FROM enrichq.seen_events AS s
    WHERE s.event_id = ANY(ARRAY(SELECT d.event_id FROM doomed AS d))
      AND s.seen_at < CAST(:cutoff AS timestamptz)
    RETURNING 1
)
SELECT 'seen_events' AS what, count(*) AS n FROM deleted;
