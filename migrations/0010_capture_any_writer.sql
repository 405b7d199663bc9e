-- Change capture covers every writer, whatever its role. Other programs write
-- media_server_items and libraries under roles granted rights on those tables and
-- nothing else; the triggers those writes fire ran with the writer's rights and failed
-- on the pipeline's own tables and functions. They now run with the owner's rights
-- (SECURITY DEFINER), so a writer needs its table rights and nothing more, and still
-- cannot read or write revision state or observations itself.
--
-- The search_path is pinned to the owner's schema with pg_temp last: a writer's session
-- settings and temporary tables cannot redirect what the owner's code resolves. That is
-- only sound while writers cannot create objects in public (the default since
-- PostgreSQL 15).
--
-- EXECUTE stays revoked from PUBLIC: a trigger fires without it, but it is checked when
-- a trigger is created, so nobody can attach these functions to a table of their own
-- (and so advance libraries their rows never touched) or call them directly.
--
-- inventory_observation_of stays an invoker function without SET clauses: the planner
-- inlines only such SQL functions, and the update capture's comparison relies on it.
-- Inside the update capture it is planned as the owner, who may execute it.
ALTER FUNCTION capture_inventory_insert() SECURITY DEFINER SET search_path = public, pg_temp;
ALTER FUNCTION capture_inventory_update() SECURITY DEFINER SET search_path = public, pg_temp;
ALTER FUNCTION capture_inventory_delete() SECURITY DEFINER SET search_path = public, pg_temp;
ALTER FUNCTION capture_inventory_truncate() SECURITY DEFINER SET search_path = public, pg_temp;
ALTER FUNCTION forget_deleted_observations() SECURITY DEFINER SET search_path = public, pg_temp;
ALTER FUNCTION forget_all_observations() SECURITY DEFINER SET search_path = public, pg_temp;
ALTER FUNCTION create_inventory_state() SECURITY DEFINER SET search_path = public, pg_temp;
-- Row-level and touches no table, but it writes the generation that fences observation
-- results: it runs as the owner too, so one rule covers every trigger on these tables.
ALTER FUNCTION advance_source_generation() SECURITY DEFINER SET search_path = public, pg_temp;
