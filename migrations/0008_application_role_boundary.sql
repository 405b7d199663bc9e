-- Issue 8: the application role reaches the write surface (save/delete session, manual
-- PRs, refresh requests), the PR overview reader and its own projections, nothing else.
-- PostgreSQL grants EXECUTE on every new function to PUBLIC; the pipeline's internal
-- functions (change capture, revisions, recovery and release, the lease fence, catalog
-- tokens, the worker's estimate) are taken back here. Trigger functions keep firing:
-- EXECUTE is checked when a trigger is created, not when it fires.
-- stats_current_user_id() stays executable: the row-level policies call it as the
-- querying role.
REVOKE ALL ON FUNCTION
    advance_credential_generation(),
    advance_inventory_revisions(bigint[]),
    advance_source_generation(),
    authentication_case_releasable(
        media_server_items, libraries, media_servers, timestamptz, uuid),
    capture_inventory_delete(),
    capture_inventory_insert(),
    capture_inventory_truncate(),
    capture_inventory_update(),
    create_inventory_state(),
    estimated_one_rep_max(numeric, integer),
    forget_all_observations(),
    forget_deleted_observations(),
    inventory_observation_of(media_server_items),
    log_exercise_change(),
    record_catalog_token(),
    stats_projection_run_lease_fence()
FROM PUBLIC;
