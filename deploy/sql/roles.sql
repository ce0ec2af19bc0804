-- The database role of the enrichq service in shadow mode (DESIGN §5).
--
-- enrichq_service may do anything inside schema enrichq and may only READ the help desk
-- mirror, the warehouse and the legacy output. A shadow deployment that tried to write the
-- legacy tables is refused by the database itself (permission denied), whatever the code does.
-- It gets nothing on enrichq_public: only `enrichq cutover`, run by the owner of that schema,
-- changes what consumers read.
--
-- Run it as the owner of the schemas (the role that runs `enrichq migrate`), after the
-- migration, whenever a new table appears in helpdesk, warehouse or legacy:
--     psql "$ADMIN_URL" -v ON_ERROR_STOP=1 -f deploy/sql/roles.sql
-- It is idempotent. The schema names are the defaults of ENRICHQ_TICKETS_TABLE,
-- ENRICHQ_ORDERS_TABLE and ENRICHQ_LEGACY_TABLE; edit them here if you configured others.
--
-- enrichq_service is NOLOGIN: a template that login users join. To make the service's user:
--     CREATE ROLE enrichq_app LOGIN PASSWORD '...' IN ROLE enrichq_service;
--     ALTER ROLE enrichq_app SET statement_timeout = '60s';
-- and give the service ENRICHQ_DATABASE_URL=postgresql://enrichq_app:...@host/db. A member
-- inherits the template's rights (INHERIT is the default).

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'enrichq_service') THEN
        CREATE ROLE enrichq_service NOLOGIN;
    END IF;
END
$$;

-- Its own schema: everything, on what exists now and on what later migrations create.
GRANT USAGE ON SCHEMA enrichq TO enrichq_service;
GRANT ALL PRIVILEGES ON ALL TABLES IN SCHEMA enrichq TO enrichq_service;
GRANT ALL PRIVILEGES ON ALL SEQUENCES IN SCHEMA enrichq TO enrichq_service;
ALTER DEFAULT PRIVILEGES IN SCHEMA enrichq
    GRANT ALL PRIVILEGES ON TABLES TO enrichq_service;
ALTER DEFAULT PRIVILEGES IN SCHEMA enrichq
    GRANT ALL PRIVILEGES ON SEQUENCES TO enrichq_service;

-- The worlds it reads: the help desk mirror, the warehouse, the legacy output.
GRANT USAGE ON SCHEMA helpdesk, warehouse, legacy TO enrichq_service;
GRANT SELECT ON ALL TABLES IN SCHEMA helpdesk, warehouse, legacy TO enrichq_service;
ALTER DEFAULT PRIVILEGES IN SCHEMA helpdesk, warehouse, legacy
    GRANT SELECT ON TABLES TO enrichq_service;

-- Never a write on legacy, even if someone granted one earlier: the shadow guarantee.
REVOKE INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER
    ON ALL TABLES IN SCHEMA legacy FROM enrichq_service;
REVOKE CREATE ON SCHEMA legacy FROM enrichq_service;
