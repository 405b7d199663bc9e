-- Lapsed leases (docs/deployment.md#failure-guarantees): every lease that ran out
-- before its holder finished is recorded as the database takes the work back: the
-- work, the holder (a stats run's lock owner; for other leases "token" and the start of
-- the lease token), when the lease ran out, who took the work, and how it ended:
-- taken (by `taken_by`, which is the holder itself when a worker back from a stall
-- resumes its own batch run), requeued (a profile request back to pending), restarted (a
-- stats run retired so that its job starts again under a new run) or failed (a profile
-- request or a stats job whose lease ran out on its last attempt). Triggers on
-- the four kinds of lease write it, so no code path can take lapsed work back
-- unrecorded; the late holder's own writes record nothing (refused once its work was
-- taken). `inventory-pipeline status` lists the last hour's; rows older than a week are
-- deleted as new ones arrive.
CREATE TABLE lapsed_leases (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind text NOT NULL,
    work text NOT NULL,
    holder text,
    lapsed_at timestamptz NOT NULL,
    taken_by text,
    taken_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    outcome text NOT NULL CHECK (outcome IN ('taken', 'requeued', 'restarted', 'failed')),
    CONSTRAINT lapsed_leases_taken CHECK ((outcome = 'taken') = (taken_by IS NOT NULL))
);
CREATE INDEX lapsed_leases_taken_at ON lapsed_leases (taken_at);

CREATE FUNCTION record_lapsed_lease()
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

-- A running request whose lease ran out, taken back by the planner's expiry (back to
-- the queue, or failed on its last attempt). Its holder's own failure report, which its
-- token still allows until the expiry runs, is not a lapse.
CREATE TRIGGER profile_refresh_requests_lapsed_lease
    AFTER UPDATE OF lease_token ON profile_refresh_requests
    FOR EACH ROW WHEN (OLD.status = 'running' AND OLD.lease_expires_at <= now()
                       AND NEW.lease_token IS NULL AND NEW.last_error = 'lease_expired')
    EXECUTE FUNCTION record_lapsed_lease();
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
CREATE TRIGGER media_server_items_lapsed_lease
    AFTER UPDATE OF observation_lease_token ON media_server_items
    FOR EACH ROW WHEN (OLD.observation_lease_token IS NOT NULL
                       AND OLD.observation_lease_expires_at <= now()
                       AND NEW.observation_lease_token IS NOT NULL
                       AND NEW.observation_lease_token <> OLD.observation_lease_token)
    EXECUTE FUNCTION record_lapsed_lease();
CREATE TRIGGER credential_wakeups_lapsed_lease
    AFTER UPDATE OF probe_lease_token ON credential_wakeups
    FOR EACH ROW WHEN (OLD.probe_lease_token IS NOT NULL
                       AND OLD.probe_lease_expires_at <= now()
                       AND NEW.probe_lease_token IS NOT NULL
                       AND NEW.probe_lease_token <> OLD.probe_lease_token)
    EXECUTE FUNCTION record_lapsed_lease();

REVOKE ALL ON FUNCTION record_lapsed_lease() FROM PUBLIC;
