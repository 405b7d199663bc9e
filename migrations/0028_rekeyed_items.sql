-- An UPDATE that changes an item's id is a delete of the old row and an insert of the
-- new one, as a MERGE doing the same is. Change capture paired old and new rows by id,
-- so such an UPDATE dirtied neither library; and the item's observation, revalidation
-- records and proposals stayed under the old id, where an item reusing it could match
-- them (deletion and TRUNCATE already forget them).

-- Capture: a row whose id has no partner on the other side is a delete (old) or an
-- insert (new) and dirties its library; pairs are compared by projection as before.
-- The function keeps the owner's rights and pinned path (migration 0010).
CREATE OR REPLACE FUNCTION capture_inventory_update() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
SET jit = off
SET enable_mergejoin = off
AS $$
BEGIN
    PERFORM advance_inventory_revisions(ARRAY(
        SELECT DISTINCT affected.library_id
        FROM old_rows o
        FULL JOIN new_rows n ON n.id = o.id
        CROSS JOIN LATERAL (VALUES (o.library_id), (n.library_id)) AS affected (library_id)
        WHERE affected.library_id IS NOT NULL
          AND (o.id IS NULL OR n.id IS NULL
               OR ROW((inventory_observation_of(o)).*)
                  IS DISTINCT FROM ROW((inventory_observation_of(n)).*))
    ));
    RETURN NULL;
END
$$;

-- The re-keyed row starts over as a new item: a new source generation (which fences a
-- completion in flight), due now, no lease, no recovery case (advance_source_generation,
-- the source change's own reset).
DROP TRIGGER media_server_items_source_change ON media_server_items;
CREATE TRIGGER media_server_items_source_change
    BEFORE UPDATE ON media_server_items
    FOR EACH ROW
    WHEN ((OLD.id, OLD.provider, OLD.provider_kind, OLD.provider_id, OLD.title, OLD.year)
          IS DISTINCT FROM
          (NEW.id, NEW.provider, NEW.provider_kind, NEW.provider_id, NEW.title, NEW.year))
    EXECUTE FUNCTION advance_source_generation();

-- What is kept by item id goes with both ids a re-keyed row touched (its old id, and its
-- new one, which in a swap another row held): the observation and revalidation records
-- are deleted, the proposals stored as superseded (migration 0019's rule for a deleted
-- item). Row-level, only for rows whose id changed: a transition table cannot tell
-- which new row an old one became.
CREATE FUNCTION forget_rekeyed_item() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
BEGIN
    DELETE FROM provider_observations o WHERE o.item_id IN (OLD.id, NEW.id);
    DELETE FROM identity_revalidations r WHERE r.item_id IN (OLD.id, NEW.id);
    UPDATE replacement_proposals p
    SET state = 'superseded', superseded_at = now()
    WHERE p.item_id IN (OLD.id, NEW.id) AND p.state <> 'superseded';
    RETURN NULL;
END
$$;
CREATE TRIGGER media_server_items_forget_rekeyed
    AFTER UPDATE OF id ON media_server_items
    FOR EACH ROW
    WHEN (OLD.id IS DISTINCT FROM NEW.id)
    EXECUTE FUNCTION forget_rekeyed_item();

-- EXECUTE is checked when a trigger is created, not when it fires.
REVOKE ALL ON FUNCTION forget_rekeyed_item() FROM PUBLIC;
