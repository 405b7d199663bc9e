-- The lapsed-lease ledger saw a batch run taken back only when its lock owner changed:
-- a lapsed batch run resumed by a claim of the same owner (the same worker, back from a
-- stall) consumed an attempt and left no row, so the lapse vanished from `status`. A
-- lapse is now recorded whenever a claim moves a lapsed lease's end (only the claim
-- does). And a batch run resumed past its attempt cap, whose compute then fails the job
-- for good, reads "failed", not "taken by".
CREATE OR REPLACE FUNCTION record_lapsed_lease()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
BEGIN
    -- Rows a concurrent takeover is deleting are left to it: a claim never waits here.
    DELETE FROM lapsed_leases
    WHERE id IN (SELECT id FROM lapsed_leases WHERE taken_at < now() - interval '7 days'
                 ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED);
    IF TG_TABLE_NAME = 'profile_refresh_requests' THEN
        INSERT INTO lapsed_leases (kind, work, holder, lapsed_at, outcome)
        VALUES ('profile request', NEW.id || ' for library ' || NEW.library_id,
                'token ' || left(OLD.lease_token::text, 8), OLD.lease_expires_at,
                CASE WHEN NEW.status = 'failed' THEN 'failed' ELSE 'requeued' END);
    ELSIF TG_TABLE_NAME = 'user_stats_projection_runs' THEN
        INSERT INTO lapsed_leases (kind, work, holder, lapsed_at, taken_by, outcome)
        SELECT 'stats run', NEW.id || ' for user ' || NEW.user_id, OLD.lock_owner,
               OLD.lease_until, CASE WHEN NOT taken.exhausted THEN taken.owner END,
               CASE WHEN taken.exhausted THEN 'failed'
                    WHEN taken.owner IS NOT NULL THEN 'taken' ELSE 'restarted' END
        FROM (SELECT CASE WHEN NEW.phase IN ('claimed', 'computed')
                          THEN NEW.lock_owner END AS owner,
                     -- Resumed (a batch run, by any owner, its own holder included): its
                     -- compute fails the job for good once the resume passed the attempt
                     -- cap. Retired: its job starts again, unless that was the job's last
                     -- attempt (the claim counts one more and fails the job after this).
                     CASE WHEN NEW.phase IN ('claimed', 'computed')
                          THEN NEW.attempts > s.max_attempts
                          ELSE (SELECT j.attempts + 1 > s.max_attempts
                                FROM user_exercise_stats_refresh_jobs j
                                WHERE j.id = NEW.job_id) END AS exhausted
              FROM stats_projection_worker_settings s WHERE s.id = 1) AS taken;
    ELSIF TG_TABLE_NAME = 'media_server_items' THEN
        INSERT INTO lapsed_leases (kind, work, holder, lapsed_at, taken_by, outcome)
        VALUES ('observation', 'of item ' || NEW.id,
                'token ' || left(OLD.observation_lease_token::text, 8),
                OLD.observation_lease_expires_at,
                'token ' || left(NEW.observation_lease_token::text, 8), 'taken');
    ELSE
        INSERT INTO lapsed_leases (kind, work, holder, lapsed_at, taken_by, outcome)
        VALUES ('credential probe', 'of key generation ' || OLD.probe_generation,
                'token ' || left(OLD.probe_lease_token::text, 8), OLD.probe_lease_expires_at,
                'token ' || left(NEW.probe_lease_token::text, 8), 'taken');
    END IF;
    RETURN NULL;
END
$function$;

DROP TRIGGER user_stats_projection_runs_lapsed_lease ON user_stats_projection_runs;
-- A claimed or computed run whose lease ran out (not one waiting out a retry, which
-- keeps its claim) taken back under a new lease (a batch run resumed, by another owner or
-- by its own, back from a stall: only the claim moves a lapsed lease's end), or retired
-- so that its job starts again.
CREATE TRIGGER user_stats_projection_runs_lapsed_lease
    AFTER UPDATE OF lease_until, phase ON user_stats_projection_runs
    FOR EACH ROW WHEN (OLD.phase IN ('claimed', 'computed') AND OLD.retry_not_before IS NULL
                       AND OLD.lease_until <= now()
                       AND (NEW.lease_until > OLD.lease_until
                            OR (NEW.phase = 'failed' AND NEW.error = 'lease expired')))
    EXECUTE FUNCTION record_lapsed_lease();
