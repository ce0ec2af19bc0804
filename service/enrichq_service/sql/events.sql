-- Webhook redelivery dedupe (DESIGN §6, POST /v1/events): the help desk's event ids seen
-- within ENRICHQ_EVENT_DEDUPE_HOURS, in enrichq.seen_events. Every statement takes :now
-- (NULL = the database clock). The caller runs them in the transaction that enqueues the
-- events, so an id counts as seen exactly when its events are in the queue.


-- name: events_mark_seen
-- Marks the ids :ids seen now and returns those that were not seen within :window_seconds
-- (never seen, or last seen before the window and not yet pruned): the events to enqueue.
-- Ids are inserted in byte order, so two requests sharing ids wait for each other in one
-- order and never deadlock. A redelivery racing the first delivery waits on the first
-- one's row until it commits, then finds the id seen (and enqueues nothing), or, if the
-- first rolled back, inserts it itself.
WITH clock AS (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
)
INSERT INTO enrichq.seen_events AS s (event_id, seen_at)
SELECT i.event_id, clock.now
FROM unnest(CAST(:ids AS text[])) AS i(event_id)
CROSS JOIN clock
ORDER BY i.event_id COLLATE "C"
ON CONFLICT (event_id) DO UPDATE
SET seen_at = excluded.seen_at, queue_id = NULL
WHERE s.seen_at < excluded.seen_at - make_interval(secs => CAST(:window_seconds AS float8))
RETURNING s.event_id;


-- name: events_remember
-- Stores the queue row each new event id (:ids[i]) went into (:queue_ids[i]).
UPDATE enrichq.seen_events AS s
SET queue_id = r.queue_id
FROM unnest(CAST(:ids AS text[]), CAST(:queue_ids AS bigint[])) AS r(event_id, queue_id)
WHERE s.event_id = r.event_id;


-- name: events_queue_ids
-- The queue row each of :ids went into when it was first delivered (NULL: unknown).
SELECT s.event_id, s.queue_id
FROM enrichq.seen_events AS s
WHERE s.event_id = ANY(CAST(:ids AS text[]));
