-- Revalidation records and replacement proposals end with their item. They are matched
-- to an item by (item_id, source_generation) and hold no foreign key (other programs
-- TRUNCATE media_server_items, which a referencing table would forbid), so a deleted
-- item's approved proposal would otherwise stand for a new item that reuses its id (an
-- explicit id, or a TRUNCATE ... RESTART IDENTITY) and starts at the same generation:
-- the new item would be observed, and published for adoption, under the old item's
-- replacement.
--
-- A deleted item's revalidation records are deleted and its proposals, whatever their
-- state, are stored as superseded (kept, with who decided, for the retention period
-- the sweep prunes after), so nothing of the old item is ever applied to, listed for or
-- refused for another.
-- The functions run as the owner with the search path pinned, like the other triggers
-- on this table (migration 0010): a writer needs its table rights and nothing more.

CREATE FUNCTION forget_deleted_replacements() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
SET jit = off
AS $$
BEGIN
    DELETE FROM identity_revalidations r USING old_rows d WHERE r.item_id = d.id;
    UPDATE replacement_proposals p
    SET state = 'superseded', superseded_at = now()
    FROM old_rows d
    WHERE p.item_id = d.id AND p.state <> 'superseded';
    RETURN NULL;
END
$$;
CREATE TRIGGER media_server_items_forget_replacements
    AFTER DELETE ON media_server_items
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION forget_deleted_replacements();

CREATE FUNCTION forget_all_replacements() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
BEGIN
    DELETE FROM identity_revalidations;
    UPDATE replacement_proposals
    SET state = 'superseded', superseded_at = now()
    WHERE state <> 'superseded';
    RETURN NULL;
END
$$;
CREATE TRIGGER media_server_items_forget_all_replacements
    BEFORE TRUNCATE ON media_server_items
    FOR EACH STATEMENT EXECUTE FUNCTION forget_all_replacements();

-- EXECUTE is checked when a trigger is created, not when it fires: nobody else may
-- attach these to a table of their own or call them.
REVOKE ALL ON FUNCTION forget_deleted_replacements(), forget_all_replacements() FROM PUBLIC;
