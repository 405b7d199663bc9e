-- A kept-alive drain holds a session lock while it lives, so the database tells a live
-- drain from one whose worker died unseen: Dagster's default run launcher cannot, and
-- such a run stayed STARTED, holding one of the stats queue's two places and counted by
-- the sensor as in flight, until its maximum runtime (65 minutes).
-- The session lock a kept-alive drain holds while it lives, taken in its own connection
-- (pg_try_advisory_lock): the database tells a live drain from one whose worker died
-- unseen, which Dagster's run state cannot (such a run stays STARTED until its maximum
-- runtime). The server ends a dead host's session, and the lock with it, within the
-- connection bounds (docs/deployment.md#failure-guarantees).
CREATE OR REPLACE FUNCTION stats_drain_lock(p_owner text)
 RETURNS bigint
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT hashtextextended('stats_drain:' || p_owner, 0) $function$;

REVOKE ALL ON FUNCTION stats_drain_lock(p_owner text) FROM PUBLIC;
