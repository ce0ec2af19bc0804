-- The audit log: one enrichq.audit_log row per operator action (cancel, dlq discard,
-- dlq redrive, pause, resume). Every statement takes :now (NULL = the database clock).


-- name: audit_record
-- A new audit row; finished now when :finished, else open (a batched action adds its rows
-- with audit_add_rows and closes it with audit_finish). Returns its id.
INSERT INTO enrichq.audit_log
    (at, finished_at, actor, origin, command, filter, rows_affected, detail, note)
SELECT clock.now, CASE WHEN CAST(:finished AS boolean) THEN clock.now END, :actor, :origin,
       :command, CAST(:filter AS jsonb), :rows_affected, CAST(:detail AS jsonb), :note
FROM (SELECT coalesce(CAST(:now AS timestamptz), now()) AS now) AS clock
RETURNING id;


-- name: audit_add_rows
-- Adds :rows to audit row :id and replaces its detail (the action's running totals).
UPDATE enrichq.audit_log
SET rows_affected = rows_affected + :rows, detail = CAST(:detail AS jsonb)
WHERE id = :id;


-- name: audit_finish
-- Closes audit row :id.
UPDATE enrichq.audit_log
SET finished_at = greatest(at, coalesce(CAST(:now AS timestamptz), now()))
WHERE id = :id;


-- name: audit_recent
-- The newest :limit audit rows, newest first, all commands or only :command.
SELECT a.id, a.at, a.finished_at, a.actor, a.origin, a.command, a.filter, a.rows_affected,
       a.detail, a.note
FROM enrichq.audit_log AS a
WHERE CAST(:command AS text) IS NULL OR a.command = CAST(:command AS text)
ORDER BY a.id DESC
LIMIT :limit;
