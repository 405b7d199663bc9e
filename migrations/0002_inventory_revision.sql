-- Seed 000: transactional per-library inventory revision, fed into the refresh outbox
-- as `inventory_change` requests and acknowledged by the claim that processed it.

-- seed 000 "a foreign key removes revision state when the library is deleted".
-- Every library has a state row (created with the library), so completion can lock
-- state before the request row: state -> request is the lock order everywhere.
CREATE TABLE library_inventory_state (
    library_id bigint PRIMARY KEY REFERENCES libraries (id) ON DELETE CASCADE,
    revision bigint NOT NULL DEFAULT 0 CHECK (revision >= 0),
    acknowledged_revision bigint NOT NULL DEFAULT 0 CHECK (acknowledged_revision >= 0),
    -- Set when the library turns dirty, cleared when acknowledged: the planner takes
    -- the oldest dirty libraries first, so a busy library cannot starve a quiet one.
    dirty_since timestamptz,
    changed_at timestamptz,
    acknowledged_at timestamptz,
    CONSTRAINT library_inventory_state_ack_not_ahead CHECK (acknowledged_revision <= revision),
    CONSTRAINT library_inventory_state_dirty_since CHECK (
        (revision > acknowledged_revision) = (dirty_since IS NOT NULL)
    )
);
CREATE INDEX library_inventory_state_dirty
    ON library_inventory_state (dirty_since, library_id) WHERE revision > acknowledged_revision;

ALTER TABLE library_profiles ADD COLUMN inventory_revision bigint NOT NULL DEFAULT 0;

-- The shared observation projection (seed 000: "share the SQL metadata projection
-- with the observation reader to avoid a second field contract"). Change capture
-- compares it; the profile reader selects it. Sync timestamps, plots and anything
-- else outside it never dirty a profile.
CREATE TYPE inventory_observation AS (
    library_id bigint,
    provider text,
    provider_kind text,
    provider_id text,
    rating numeric,
    genres text[],
    primary_studio text,
    original_language text
);

CREATE FUNCTION inventory_observation_of(item media_server_items)
RETURNS inventory_observation
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ROW(
        item.library_id, item.provider, item.provider_kind, item.provider_id,
        item.rating, item.genres, item.primary_studio, item.original_language
    )::inventory_observation
$$;

-- Advance each library once, locking state rows in library-id order (seed 000
-- "stable library lock order"). Libraries deleted in the same statement (cascades)
-- are skipped: their state goes with them.
CREATE FUNCTION advance_inventory_revisions(library_ids bigint[])
RETURNS void
LANGUAGE sql
AS $$
    INSERT INTO library_inventory_state AS s (library_id, revision, dirty_since, changed_at)
    SELECT l.id, 1, now(), now()
    FROM libraries l
    WHERE l.id = ANY (library_ids)
    ORDER BY l.id
    ON CONFLICT (library_id) DO UPDATE
    SET revision = s.revision + 1,
        changed_at = now(),
        dirty_since = COALESCE(s.dirty_since, now())
$$;

CREATE FUNCTION capture_inventory_insert() RETURNS trigger
LANGUAGE plpgsql
SET jit = off
AS $$
BEGIN
    PERFORM advance_inventory_revisions(ARRAY(SELECT DISTINCT library_id FROM new_rows));
    RETURN NULL;
END
$$;

CREATE FUNCTION capture_inventory_delete() RETURNS trigger
LANGUAGE plpgsql
SET jit = off
AS $$
BEGIN
    PERFORM advance_inventory_revisions(ARRAY(SELECT DISTINCT library_id FROM old_rows));
    RETURN NULL;
END
$$;

-- Updates compare only the projection; a move dirties both libraries.
-- `ROW((f(o)).*) IS DISTINCT FROM ROW((f(n)).*)` makes the parser compare field by
-- field, and inlining turns each field into its column: the projection stays the one
-- definition while no composite value is built per row (about 3x cheaper than
-- comparing composites on a 100k-row statement). Transition tables carry no
-- statistics, so the planner wildly overestimates the join: hash join instead of two
-- sorts, and no JIT compilation (it cost more than the whole comparison).
CREATE FUNCTION capture_inventory_update() RETURNS trigger
LANGUAGE plpgsql
SET jit = off
SET enable_mergejoin = off
AS $$
BEGIN
    PERFORM advance_inventory_revisions(ARRAY(
        SELECT DISTINCT affected.library_id
        FROM old_rows o
        JOIN new_rows n ON n.id = o.id
        CROSS JOIN LATERAL (VALUES (o.library_id), (n.library_id)) AS affected (library_id)
        WHERE ROW((inventory_observation_of(o)).*) IS DISTINCT FROM ROW((inventory_observation_of(n)).*)
    ));
    RETURN NULL;
END
$$;

-- TRUNCATE has no transition table: before the rows go, advance every library that
-- still holds items.
CREATE FUNCTION capture_inventory_truncate() RETURNS trigger
LANGUAGE plpgsql
SET jit = off
AS $$
BEGIN
    PERFORM advance_inventory_revisions(ARRAY(
        SELECT l.id FROM libraries l
        WHERE EXISTS (SELECT 1 FROM media_server_items i WHERE i.library_id = l.id)
    ));
    RETURN NULL;
END
$$;

CREATE TRIGGER media_server_items_capture_insert
    AFTER INSERT ON media_server_items
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION capture_inventory_insert();
CREATE TRIGGER media_server_items_capture_update
    AFTER UPDATE ON media_server_items
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION capture_inventory_update();
CREATE TRIGGER media_server_items_capture_delete
    AFTER DELETE ON media_server_items
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION capture_inventory_delete();
CREATE TRIGGER media_server_items_capture_truncate
    BEFORE TRUNCATE ON media_server_items
    FOR EACH STATEMENT EXECUTE FUNCTION capture_inventory_truncate();

-- New libraries start clean (revision 0): nothing to refresh until an item arrives.
CREATE FUNCTION create_inventory_state() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO library_inventory_state (library_id)
    SELECT id FROM new_libraries ORDER BY id
    ON CONFLICT (library_id) DO NOTHING;
    RETURN NULL;
END
$$;
CREATE TRIGGER libraries_create_inventory_state
    AFTER INSERT ON libraries
    REFERENCING NEW TABLE AS new_libraries
    FOR EACH STATEMENT EXECUTE FUNCTION create_inventory_state();

-- seed 000: "seed existing nonempty libraries and libraries with stored profiles as
-- dirty in the migration so deployment needs no manual initialization".
INSERT INTO library_inventory_state (library_id, revision, acknowledged_revision, dirty_since, changed_at)
SELECT l.id,
       CASE WHEN dirty THEN 1 ELSE 0 END,
       0,
       CASE WHEN dirty THEN now() END,
       CASE WHEN dirty THEN now() END
FROM libraries l
CROSS JOIN LATERAL (
    SELECT EXISTS (SELECT 1 FROM media_server_items i WHERE i.library_id = l.id)
        OR EXISTS (SELECT 1 FROM library_profiles p WHERE p.library_id = l.id) AS dirty
) AS d
ORDER BY l.id;

-- The inventory request kind: a positive revision and no classification, candidate
-- or learning ids; learning/native keep their own constraints and carry no revision.
ALTER TABLE profile_refresh_requests ADD COLUMN inventory_revision bigint;
ALTER TABLE profile_refresh_requests DROP CONSTRAINT profile_refresh_requests_kind;
ALTER TABLE profile_refresh_requests ADD CONSTRAINT profile_refresh_requests_kind
    CHECK (kind IN ('learning', 'native', 'inventory_change'));
ALTER TABLE profile_refresh_requests ADD CONSTRAINT profile_refresh_requests_inventory_change
    CHECK (
        CASE WHEN kind = 'inventory_change'
            THEN inventory_revision > 0
                 AND classification_id IS NULL
                 AND candidate_id IS NULL
                 AND learning_id IS NULL
                 AND source = 'inventory_revision'
                 AND reason IN ('inventory_changed', 'analyst_backfill')
            ELSE inventory_revision IS NULL
        END
    );
