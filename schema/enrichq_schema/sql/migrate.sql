-- What `enrichq migrate` asks of the server around the migrations (enrichq_schema.db,
-- migrations/env.py).


-- name: migrate_lock
-- Waits for the session lock that makes concurrent migrators (an init container per
-- replica) run one after the other; held until migrate_unlock or the session ends.
SELECT pg_advisory_lock(hashtext('enrichq.migrate'));


-- name: migrate_unlock
-- Releases the migrators' session lock.
SELECT pg_advisory_unlock(hashtext('enrichq.migrate'));


-- name: migrate_lock_timeout
-- Sets lock_timeout (milliseconds, as text) for the rest of the session: a revision that
-- waits longer for a table lock fails instead of queueing every later writer behind it.
SELECT set_config('lock_timeout', :timeout_ms, false);


-- name: migrate_lock_holders
-- Sessions other than this one holding a lock on a relation of enrichq's schemas, the
-- oldest transaction first: who a migration that timed out on a lock was waiting for.
SELECT a.pid, a.application_name, a.state, a.query_start, a.xact_start,
       n.nspname || '.' || c.relname AS relation, l.mode
FROM pg_locks AS l
JOIN pg_class AS c ON c.oid = l.relation
JOIN pg_namespace AS n ON n.oid = c.relnamespace
JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND n.nspname IN ('enrichq', 'enrichq_public')
  AND l.pid <> pg_backend_pid()
ORDER BY a.xact_start NULLS LAST, a.pid, relation
LIMIT :limit;
