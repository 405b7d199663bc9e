-- Capture inserts one change row per library and statement instead of advancing the
-- library's state row: a writer never waits for another writer through a state row,
-- and a REPEATABLE READ or SERIALIZABLE writer is never aborted because the worker
-- acknowledged its library meanwhile. Readers of revisions fold the rows first.
CREATE TABLE library_inventory_changes (
    library_id bigint NOT NULL,
    changed_at timestamp with time zone DEFAULT now() NOT NULL
);
-- A library's rows, for the readers that count them (`read_revision`, `profile_status`).
CREATE INDEX library_inventory_changes_library ON library_inventory_changes USING btree (library_id);

CREATE OR REPLACE FUNCTION advance_inventory_revisions(library_ids bigint[])
 RETURNS void
 LANGUAGE sql
AS $function$
    INSERT INTO library_inventory_changes (library_id)
    SELECT DISTINCT changed.library_id FROM unnest(library_ids) AS changed (library_id)
$function$;

CREATE FUNCTION fold_inventory_changes()
 RETURNS bigint
 LANGUAGE sql
AS $function$
    WITH pending AS (
        SELECT DISTINCT library_id FROM library_inventory_changes
    ),
    held_states AS (
        SELECT s.library_id
        FROM library_inventory_state s
        JOIN libraries l ON l.id = s.library_id
        WHERE s.library_id IN (SELECT library_id FROM pending)
        ORDER BY s.library_id
        FOR KEY SHARE OF l SKIP LOCKED
        FOR UPDATE OF s SKIP LOCKED
    ),
    held_without_state AS (
        SELECT l.id AS library_id
        FROM libraries l
        WHERE l.id IN (SELECT library_id FROM pending)
          AND NOT EXISTS (SELECT 1 FROM library_inventory_state s WHERE s.library_id = l.id)
        ORDER BY l.id
        FOR KEY SHARE SKIP LOCKED
    ),
    held AS (
        SELECT library_id FROM held_states
        UNION ALL
        SELECT library_id FROM held_without_state
    ),
    gone AS (
        DELETE FROM library_inventory_changes c
        USING (
            SELECT x.ctid
            FROM library_inventory_changes x
            WHERE x.library_id IN (SELECT library_id FROM held)
               OR NOT EXISTS (SELECT 1 FROM libraries l WHERE l.id = x.library_id)
            FOR UPDATE SKIP LOCKED
        ) AS taken
        WHERE c.ctid = taken.ctid
        RETURNING c.library_id, c.changed_at
    ),
    folded AS (
        INSERT INTO library_inventory_state AS s (library_id, revision, dirty_since, changed_at)
        SELECT g.library_id, count(*), min(g.changed_at), max(g.changed_at)
        FROM gone g
        WHERE g.library_id IN (SELECT library_id FROM held)
        GROUP BY g.library_id
        ORDER BY g.library_id
        ON CONFLICT (library_id) DO UPDATE
        SET revision = s.revision + EXCLUDED.revision,
            changed_at = GREATEST(s.changed_at, EXCLUDED.changed_at),
            dirty_since = COALESCE(s.dirty_since, EXCLUDED.dirty_since)
        RETURNING 1
    )
    SELECT count(*) FROM folded
$function$;

REVOKE ALL ON FUNCTION fold_inventory_changes() FROM PUBLIC;
