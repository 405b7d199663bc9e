-- name: create_ledger
-- The migrator's own ledger; it must exist before any numbered migration runs.
CREATE TABLE IF NOT EXISTS schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: lock
-- Session advisory lock: concurrent migrators apply files one process at a time.
SELECT pg_advisory_lock(hashtext('inventory_pipeline.migrations'));

-- name: unlock
SELECT pg_advisory_unlock(hashtext('inventory_pipeline.migrations'));

-- name: ledger_exists
-- Has anything ever migrated this database? (Reading, never creating, the ledger.)
SELECT to_regclass('schema_migrations') IS NOT NULL AS present;

-- name: applied
SELECT version, name, checksum FROM schema_migrations ORDER BY version;

-- name: record
INSERT INTO schema_migrations (version, name, checksum) VALUES (%(version)s, %(name)s, %(checksum)s);
