-- The claim stage's lookups of live runs read only live runs, however many have
-- finished. A finished run leaves a dead entry in the live-run index until vacuum; the
-- lease count read that index as a bitmap, which never marks an entry dead, so every
-- claim read the page of every run finished within a lease time again; and the lookup
-- of a run due to resume, planned from statistics taken while the table was empty,
-- walked the primary key over every run ever made. Both grew with the queue's history
-- (several tenths of a millisecond per claim after a few thousand runs) while the
-- claim holds the turn every claim takes to count leases.
--
-- Now the resume lookup walks an index of open runs in id order (oldest first, as
-- before), the count stops at the cap (all the cap check needs), and the function plans
-- no bitmap scans (every statement in it is a point lookup or a walk of an index in
-- order): a plain index scan marks a finished run's entry dead the first time it passes
-- it, and later claims skip it.

CREATE INDEX stats_runs_open ON user_stats_projection_runs (id)
    WHERE phase IN ('claimed', 'computed');

CREATE OR REPLACE FUNCTION stats_claim_stage(p_lock_owner text, p_user_id uuid, p_wait boolean)
RETURNS TABLE (
    claim_run_id bigint, claim_job_id bigint, claim_user_id uuid, claim_lease_token uuid,
    claim_target_version bigint, claim_base_applied_version bigint, claim_from_date date,
    claim_exercise_ids text[])
LANGUAGE plpgsql
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    settings stats_projection_worker_settings%ROWTYPE;
    v_active bigint;
    candidate record;
    started record;
    owed record;
    v_job bigint;
    v_token uuid;
    tries integer := 0;
BEGIN
    SELECT * INTO settings FROM stats_projection_worker_settings st WHERE st.id = 1;
    IF settings.paused THEN
        RETURN;
    END IF;
    -- Claims that may start a lease take turns until their commit; the count that
    -- follows (a statement of its own: a fresh snapshot) sees every committed lease.
    IF NOT pg_try_advisory_xact_lock(hashtextextended('stats_lease_slots', 0)) THEN
        IF NOT p_wait THEN
            RETURN;
        END IF;
        BEGIN
            PERFORM pg_advisory_xact_lock(hashtextextended('stats_lease_slots', 0));
        EXCEPTION WHEN query_canceled THEN
            RETURN;  -- the turn did not come within the claim budget
        END;
    END IF;
    SELECT count(*) INTO v_active
    FROM (SELECT FROM user_stats_projection_runs r
          WHERE r.phase IN ('claimed', 'computed')
            AND stats_run_is_active(r.phase, r.lease_until, r.retry_not_before)
          LIMIT settings.active_lease_cap) AS live;
    IF v_active >= settings.active_lease_cap THEN
        RETURN;
    END IF;

    -- A run whose retry time has come, or a batch run a dead worker left: same token.
    SELECT r.id, r.lease_token INTO candidate
    FROM user_stats_projection_runs r
    WHERE r.phase IN ('claimed', 'computed')
      AND (r.retry_not_before <= now()
           OR (r.phase = 'claimed' AND r.retry_not_before IS NULL AND r.payload ? '_batch'
               AND r.lease_until <= now()))
      AND (p_user_id IS NULL OR r.user_id = p_user_id)
    ORDER BY r.id
    LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        PERFORM set_config('inventory.stats_lease_token', candidate.lease_token::text, true);
        RETURN QUERY
        UPDATE user_stats_projection_runs r
        SET attempts = r.attempts + CASE WHEN r.retry_not_before IS NULL
                                              AND r.lease_until <= now() THEN 1 ELSE 0 END,
            retry_not_before = NULL,
            lease_until = now() + make_interval(secs => settings.lease_seconds),
            lock_owner = p_lock_owner
        WHERE r.id = candidate.id
        RETURNING r.id, r.job_id, r.user_id, r.lease_token, r.target_version,
                  r.base_applied_version, r.from_date, r.exercise_ids;
        RETURN;
    END IF;

    WHILE tries < 5 LOOP
        tries := tries + 1;
        -- A dead worker's job (its run retired, never adopted), else the oldest pending.
        SELECT r.id, r.job_id INTO candidate
        FROM user_stats_projection_runs r
        WHERE r.phase IN ('claimed', 'computed') AND r.lease_until <= now()
          AND r.retry_not_before IS NULL
          AND NOT (r.phase = 'claimed' AND r.payload ? '_batch')
          AND (p_user_id IS NULL OR r.user_id = p_user_id)
        ORDER BY r.lease_until
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            DELETE FROM stats_output_exercise o WHERE o.run_id = candidate.id;
            DELETE FROM stats_output_period o WHERE o.run_id = candidate.id;
            UPDATE user_stats_projection_runs r
            SET phase = 'failed', error = 'lease expired', finished_at = now()
            WHERE r.id = candidate.id;
            v_job := candidate.job_id;
        ELSE
            SELECT j.id INTO v_job
            FROM user_exercise_stats_refresh_jobs j
            WHERE j.status = 'pending'
              AND (p_user_id IS NULL OR j.user_id = p_user_id)
              AND NOT EXISTS (
                  SELECT 1 FROM user_exercise_stats_refresh_jobs p
                  WHERE p.user_id = j.user_id AND p.status = 'processing')
            ORDER BY j.created_at, j.id
            LIMIT 1
            FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                RETURN;
            END IF;
        END IF;

        UPDATE user_exercise_stats_refresh_jobs j
        SET status = 'processing', locked_at = now(), lock_owner = p_lock_owner,
            attempts = j.attempts + 1, updated_at = now()
        WHERE j.id = v_job
        RETURNING j.id, j.user_id, j.from_date, j.exercise_ids, j.requested_version,
                  j.attempts
        INTO started;
        IF started.attempts > settings.max_attempts THEN
            -- Exhausted: the job fails and the database owes its range (trigger).
            UPDATE user_exercise_stats_refresh_jobs j
            SET status = 'failed', error_message = 'attempts exhausted', updated_at = now(),
                completed_at = now()
            WHERE j.id = v_job;
            CONTINUE;
        END IF;

        -- The user's owed range joins the job (a statement of its own, after the start:
        -- its snapshot sees a failure committed while the start waited).
        WITH taken AS (
            DELETE FROM user_stats_owed_ranges o WHERE o.user_id = started.user_id
            RETURNING o.from_date, o.exercise_ids, o.failed_job_ids
        )
        UPDATE user_exercise_stats_refresh_jobs j
        SET from_date = stats_merge_from_date(j.from_date, taken.from_date),
            exercise_ids = stats_merge_exercise_ids(j.exercise_ids, taken.exercise_ids),
            metadata = j.metadata || jsonb_build_object(
                'absorbed_failed_jobs',
                coalesce(j.metadata -> 'absorbed_failed_jobs', '[]')
                    || to_jsonb(taken.failed_job_ids)),
            updated_at = now()
        FROM taken
        WHERE j.id = v_job
        RETURNING j.from_date, j.exercise_ids INTO owed;
        IF FOUND THEN
            started.from_date := owed.from_date;
            started.exercise_ids := owed.exercise_ids;
        END IF;

        v_token := gen_random_uuid();
        RETURN QUERY
        INSERT INTO user_stats_projection_runs AS r
            (job_id, user_id, phase, lease_token, lease_until, lock_owner, target_version,
             base_applied_version, from_date, exercise_ids, attempts)
        SELECT v_job, started.user_id, 'claimed', v_token,
               now() + make_interval(secs => settings.lease_seconds), p_lock_owner,
               started.requested_version, coalesce(s.applied_version, 0),
               started.from_date, started.exercise_ids, started.attempts
        FROM (SELECT 1) AS one
        LEFT JOIN user_stats_refresh_state s ON s.user_id = started.user_id
        RETURNING r.id, r.job_id, r.user_id, r.lease_token, r.target_version,
                  r.base_applied_version, r.from_date, r.exercise_ids;
        RETURN;
    END LOOP;
    RETURN;
END
$$;

