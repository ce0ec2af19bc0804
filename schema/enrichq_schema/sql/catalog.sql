-- Questions about the database's catalog that several packages ask.

-- name: catalog_relation_exists
-- Whether the relation named :name (schema.table, quoted) exists.
SELECT to_regclass(:name) IS NOT NULL AS present
