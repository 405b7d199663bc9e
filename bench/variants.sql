-- Comparison triggers for bench/change_capture.py only (never installed by migrations).

-- name: install_noop
-- The mechanism's floor: statement triggers that only declare transition tables.
CREATE OR REPLACE FUNCTION bench_noop_capture() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NULL;
END
$$;
CREATE TRIGGER bench_noop_insert AFTER INSERT ON media_server_items
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION bench_noop_capture();
CREATE TRIGGER bench_noop_update AFTER UPDATE ON media_server_items
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION bench_noop_capture();

-- name: install_row
-- The naive row-level variant: compare each row's projection, advance its library.
CREATE OR REPLACE FUNCTION bench_row_capture() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM advance_inventory_revisions(ARRAY[NEW.library_id]);
    ELSIF inventory_observation_of(OLD) IS DISTINCT FROM inventory_observation_of(NEW) THEN
        PERFORM advance_inventory_revisions(ARRAY[OLD.library_id, NEW.library_id]);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER bench_row_insert AFTER INSERT ON media_server_items
    FOR EACH ROW EXECUTE FUNCTION bench_row_capture();
CREATE TRIGGER bench_row_update AFTER UPDATE ON media_server_items
    FOR EACH ROW EXECUTE FUNCTION bench_row_capture();

-- name: drop_variants
DROP TRIGGER IF EXISTS bench_noop_insert ON media_server_items;
DROP TRIGGER IF EXISTS bench_noop_update ON media_server_items;
DROP TRIGGER IF EXISTS bench_row_insert ON media_server_items;
DROP TRIGGER IF EXISTS bench_row_update ON media_server_items;

-- name: disable_capture
ALTER TABLE media_server_items DISABLE TRIGGER media_server_items_capture_insert;
ALTER TABLE media_server_items DISABLE TRIGGER media_server_items_capture_update;
ALTER TABLE media_server_items DISABLE TRIGGER media_server_items_capture_delete;

-- name: enable_capture
ALTER TABLE media_server_items ENABLE TRIGGER media_server_items_capture_insert;
ALTER TABLE media_server_items ENABLE TRIGGER media_server_items_capture_update;
ALTER TABLE media_server_items ENABLE TRIGGER media_server_items_capture_delete;

-- name: setup_libraries
INSERT INTO media_servers (id, name, kind) VALUES (1, 'bench', 'plex');
INSERT INTO libraries (id, server_id, name, media_kind)
SELECT g, 1, 'library ' || g, 'movie' FROM generate_series(1, 10) g;

-- name: sync_insert
-- A 100k-item initial sync across ten libraries.
INSERT INTO media_server_items (library_id, title, year, provider, provider_kind, provider_id,
                                rating, genres, primary_studio, original_language, plot)
SELECT 1 + mod(g, 10), 'Title ' || g, 1950 + mod(g, 75), 'tmdb', 'movie', g::text,
       (mod(g, 100)) / 10.0, ARRAY['Drama', 'Comedy'], 'Studio ' || mod(g, 40), 'en',
       'A plot long enough to look like a plot, item ' || g
FROM generate_series(1, %(items)s) g;

-- name: sync_relevant_update
-- Enrichment changes a projected field on every item.
UPDATE media_server_items SET rating = 10 - rating, synced_at = now();

-- name: sync_unchanged
-- A re-sync that touches only sync timestamps and plots.
UPDATE media_server_items SET synced_at = now(), plot = plot || '.';

-- name: truncate_items
TRUNCATE media_server_items;

-- name: revisions
SELECT (SELECT coalesce(sum(revision), 0) FROM library_inventory_state)
       + (SELECT count(*) FROM library_inventory_changes) AS total;
