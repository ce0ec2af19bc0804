-- Session settings and what a connection can tell about the server session behind it
-- (enrichq_schema.pooling).


-- name: session_apply
-- Sets each :names[i] to :values[i], for the rest of the session (:local false) or of the
-- current transaction only (:local true); returns how many were set. One round trip for
-- all of an engine's settings. A parameter the server does not know is left out (an
-- older server's: client_connection_check_interval came with PostgreSQL 14).
SELECT count(set_config(s.name, s.value, CAST(:local AS boolean))) AS applied
FROM unnest(CAST(:names AS text[]), CAST(:values AS text[])) AS s (name, value)
WHERE current_setting(s.name, true) IS NOT NULL;


-- name: session_backend
-- The server process serving this statement: under a transaction pooler two statements of
-- one client connection may get different ones, and two client connections the same one.
SELECT pg_backend_pid() AS pid;
