-- A drain with nothing to do waits on LISTEN stats_work instead of polling; every
-- statement that can make stats work claimable wakes it when it commits: a job enqueued
-- (a save, a delete, a manual PR, a rebuild, a rollover, a retry) or merged into a
-- pending one (a claim may have passed that job by while the merge held its row), a
-- live job ending (its lease slot frees, its user's pending successor becomes
-- claimable), a settings change (the pause lifted, the cap raised). Work that becomes
-- claimable only with time (a retry's backoff ending, a dead worker's lease lapsing)
-- sends nothing: a waiting drain also looks again on a clock. A notification only wakes;
-- the claim decides, so a lost or extra one changes nothing but when a claim is tried.
CREATE FUNCTION stats_notify_work()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM pg_notify('stats_work', '');
    RETURN NULL;
END
$function$;

CREATE TRIGGER user_exercise_stats_refresh_jobs_notify_enqueued
    AFTER INSERT ON user_exercise_stats_refresh_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION stats_notify_work();
CREATE TRIGGER user_exercise_stats_refresh_jobs_notify_changed
    AFTER UPDATE ON user_exercise_stats_refresh_jobs
    FOR EACH ROW WHEN (NEW.status = 'pending'
                       OR (OLD.status = 'processing' AND NEW.status <> 'processing'))
    EXECUTE FUNCTION stats_notify_work();
CREATE TRIGGER stats_projection_worker_settings_notify
    AFTER UPDATE ON stats_projection_worker_settings
    FOR EACH STATEMENT EXECUTE FUNCTION stats_notify_work();

REVOKE ALL ON FUNCTION stats_notify_work() FROM PUBLIC;
