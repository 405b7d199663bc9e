-- Every job ending notified stats_work, and every notifying commit takes PostgreSQL's
-- notify queue lock. A job ending now notifies only when its user has a pending
-- successor, which becomes claimable then; one with no successor frees only a lease
-- slot, which a drain waiting for one finds at its recheck.
-- A job's change wakes a waiting drain only when it can have made work claimable: a
-- merge into a pending job (a claim may have passed the job by while the merge held its
-- row), or a live job ending while its user has a pending successor (claimable from
-- now). A job ending with no successor frees only a lease slot, which a drain waiting
-- for one finds at its recheck: its commit takes no notify queue lock.
CREATE OR REPLACE FUNCTION stats_notify_job_change()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF NEW.status = 'pending' OR EXISTS (
        SELECT 1 FROM user_exercise_stats_refresh_jobs j
        WHERE j.user_id = NEW.user_id AND j.status = 'pending'
    ) THEN
        PERFORM pg_notify('stats_work', '');
    END IF;
    RETURN NULL;
END
$function$;

DROP TRIGGER user_exercise_stats_refresh_jobs_notify_changed ON user_exercise_stats_refresh_jobs;
CREATE TRIGGER user_exercise_stats_refresh_jobs_notify_changed
    AFTER UPDATE ON user_exercise_stats_refresh_jobs
    FOR EACH ROW WHEN (NEW.status = 'pending'
                       OR (OLD.status = 'processing' AND NEW.status <> 'processing'))
    EXECUTE FUNCTION stats_notify_job_change();

REVOKE ALL ON FUNCTION stats_notify_job_change() FROM PUBLIC;
