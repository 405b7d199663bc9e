-- `attempt_exhausted_failures` counted every failed job not yet retried, including jobs
-- whose range a later job of the same user took in and published: the count only grew,
-- and an operator who followed it with `stats retry` made a current user stale again.
-- It now counts what still needs an operator: failed jobs whose range is still owed and
-- that nobody retried (the runbook's retry refuses the others).
CREATE OR REPLACE FUNCTION stats_projection_worker_status()
 RETURNS jsonb
 LANGUAGE sql
 STABLE
AS $function$
    SELECT jsonb_build_object(
        'pending_users', (SELECT count(DISTINCT user_id) FROM user_exercise_stats_refresh_jobs
                          WHERE status = 'pending'),
        'pending_jobs', (SELECT count(*) FROM user_exercise_stats_refresh_jobs
                         WHERE status = 'pending'),
        'oldest_wait_seconds', (SELECT extract(epoch FROM now() - min(created_at))
                                FROM user_exercise_stats_refresh_jobs WHERE status = 'pending'),
        'active_leases', (SELECT count(*) FROM user_stats_projection_runs r
                          WHERE stats_run_is_active(r.phase, r.lease_until, r.retry_not_before)),
        'expired_leases', (SELECT count(*) FROM user_stats_projection_runs
                           WHERE phase IN ('claimed', 'computed') AND lease_until <= now()
                             AND retry_not_before IS NULL),
        'backing_off', (SELECT count(*) FROM user_stats_projection_runs
                        WHERE phase IN ('claimed', 'computed')
                          AND retry_not_before IS NOT NULL),
        -- What still needs an operator: failed jobs whose range is still owed (no later
        -- job of the user took it in) and that nobody retried.
        'attempt_exhausted_failures', (SELECT count(*)
                                       FROM user_stats_owed_ranges o
                                       CROSS JOIN unnest(o.failed_job_ids) AS f (job_id)
                                       JOIN user_exercise_stats_refresh_jobs j
                                         ON j.id = f.job_id
                                       WHERE NOT j.metadata ? 'retried_by'),
        'owed_users', (SELECT count(*) FROM user_stats_owed_ranges),
        'oldest_owed_seconds', (SELECT extract(epoch FROM now() - min(owed_since))
                                FROM user_stats_owed_ranges),
        'stale_users', (SELECT count(*) FROM (
                            SELECT user_id FROM user_stats_refresh_state
                            WHERE requested_version > applied_version
                            UNION
                            SELECT user_id FROM user_stats_owed_ranges) AS stale),
        'completed_last_hour', (SELECT count(*) FROM user_exercise_stats_refresh_jobs
                                WHERE status = 'completed'
                                  AND completed_at > now() - interval '1 hour'),
        'failed_last_hour', (SELECT count(*) FROM user_exercise_stats_refresh_jobs
                             WHERE status = 'failed' AND updated_at > now() - interval '1 hour'),
        'compute_ms_avg_last_hour', (SELECT round(avg(compute_ms)::numeric, 1)
                                     FROM user_stats_projection_runs
                                     WHERE phase = 'published'
                                       AND finished_at > now() - interval '1 hour'),
        'compute_ms_max_last_hour', (SELECT round(max(compute_ms)::numeric, 1)
                                     FROM user_stats_projection_runs
                                     WHERE phase = 'published'
                                       AND finished_at > now() - interval '1 hour'),
        'publish_ms_avg_last_hour', (SELECT round(avg(publish_ms)::numeric, 1)
                                     FROM user_stats_projection_runs
                                     WHERE phase = 'published'
                                       AND finished_at > now() - interval '1 hour'),
        'publish_ms_max_last_hour', (SELECT round(max(publish_ms)::numeric, 1)
                                     FROM user_stats_projection_runs
                                     WHERE phase = 'published'
                                       AND finished_at > now() - interval '1 hour'),
        'settings', (SELECT to_jsonb(s) - 'id' FROM stats_projection_worker_settings s)
    )
$function$;

