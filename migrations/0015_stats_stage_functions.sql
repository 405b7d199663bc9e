-- The stats worker's three committed stages as one server-side call each. Every stage
-- keeps its checks: the stage's statement budget and lease token are armed by the
-- caller in the same round trip, before the call (a statement timeout is armed when a
-- statement starts, so a budget set inside the call would not bound it); the lease
-- fence trigger judges every run update; the lease-slot turn, the one-live-job index,
-- the attempt cap, the generation and base checks, applied_version's GREATEST and the
-- per-user publication lock are the same statements the client used to send one by
-- one. The rare paths (a start refused by the one-live-job index, a referenced row
-- deleted during the computation, a batched account) raise or answer 'client' and the
-- caller takes its statement-by-statement path for them.

-- Claim: resume a run due to resume, revive a dead worker's job under a new lease, or
-- start the oldest pending job of a user with no live job; no row when paused, at the
-- cap of active leases, when nothing is claimable, or when the turn to count leases did
-- not come within the claim budget (at once without p_wait). A start refused by the
-- one-live-job index raises 23505 (the caller retries on its own path).
CREATE FUNCTION stats_claim_stage(p_lock_owner text, p_user_id uuid, p_wait boolean)
RETURNS TABLE (
    claim_run_id bigint, claim_job_id bigint, claim_user_id uuid, claim_lease_token uuid,
    claim_target_version bigint, claim_base_applied_version bigint, claim_from_date date,
    claim_exercise_ids text[])
LANGUAGE plpgsql
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
    SELECT count(*) INTO v_active FROM user_stats_projection_runs r
    WHERE r.phase IN ('claimed', 'computed')
      AND stats_run_is_active(r.phase, r.lease_until, r.retry_not_before);
    IF v_active >= settings.active_lease_cap THEN
        RETURN;
    END IF;

    -- A run whose retry time has come, or a batch run a dead worker left: same token.
    SELECT r.id, r.lease_token INTO candidate
    FROM user_stats_projection_runs r
    WHERE ((r.phase IN ('claimed', 'computed') AND r.retry_not_before <= now())
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

-- Compute for an account of at most p_batch_size candidate exercises: lock the run
-- under its token, answer what needs no work, renew the lease at the stage boundary
-- (an expired lease resumed under the same token consumes a retry), fail past the
-- attempt cap, compute the private output and record the manifest. A larger account
-- gets its frozen exercise list and inputs (the batch cursor) and 'batch_pending'; a
-- run already in batches answers 'client' untouched (its caller computes the batches,
-- each in its own transaction).
CREATE FUNCTION stats_compute_stage(p_run_id bigint, p_lease_token uuid, p_batch_size integer)
RETURNS TABLE (
    compute_status text, compute_stage text, compute_next_offset integer,
    compute_total integer, compute_reason text, compute_retry_not_before timestamptz)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    settings stats_projection_worker_settings%ROWTYPE;
    run record;
    v_renewed integer;
    v_candidates text[];
    v_total integer;
    v_versions record;
    elapsed double precision;
    v_cursor jsonb;
BEGIN
    SELECT * INTO settings FROM stats_projection_worker_settings st WHERE st.id = 1;
    SELECT r.id, r.job_id, r.user_id, r.phase, r.lease_until <= now() AS expired,
           r.retry_not_before > now() AS backing_off, r.retry_not_before, r.attempts,
           r.from_date, r.exercise_ids, r.payload, txid_current() AS xid
    INTO run
    FROM user_stats_projection_runs r
    WHERE r.id = p_run_id AND r.lease_token = p_lease_token
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'failed', NULL::text, NULL::integer, NULL::integer,
                            'lease lost or run busy', NULL::timestamptz;
        RETURN;
    END IF;
    IF run.payload ? '_batch' THEN
        RETURN QUERY SELECT 'client', NULL::text, NULL::integer, NULL::integer,
                            NULL::text, NULL::timestamptz;
        RETURN;
    END IF;
    IF run.phase = 'computed' THEN
        RETURN QUERY SELECT 'computed', NULL::text, NULL::integer, NULL::integer,
                            NULL::text, NULL::timestamptz;
        RETURN;
    END IF;
    IF run.phase <> 'claimed' THEN
        RETURN QUERY SELECT 'failed', NULL::text, NULL::integer, NULL::integer,
                            'run is ' || run.phase, NULL::timestamptz;
        RETURN;
    END IF;
    IF run.backing_off THEN
        RETURN QUERY SELECT 'retry_pending', NULL::text, NULL::integer, NULL::integer,
                            NULL::text, run.retry_not_before;
        RETURN;
    END IF;

    UPDATE user_stats_projection_runs r
    SET lease_until = now() + make_interval(secs => settings.lease_seconds),
        attempts = r.attempts + CASE WHEN run.expired THEN 1 ELSE 0 END
    WHERE r.id = p_run_id
    RETURNING r.attempts INTO v_renewed;
    IF v_renewed > settings.max_attempts THEN
        -- Past the attempt cap: the run and its job fail; the job's range stays owed.
        UPDATE user_stats_projection_runs r
        SET phase = 'failed', payload = run.payload,
            compute_ms = r.compute_ms
                + extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
            retry_not_before = NULL, attempts = v_renewed, error = 'attempts exhausted',
            finished_at = now()
        WHERE r.id = p_run_id;
        UPDATE user_exercise_stats_refresh_jobs j
        SET status = 'failed', error_message = 'attempts exhausted', updated_at = now(),
            completed_at = now()
        WHERE j.id = run.job_id;
        RETURN QUERY SELECT 'failed', NULL::text, NULL::integer, NULL::integer,
                            'attempts exhausted', NULL::timestamptz;
        RETURN;
    END IF;

    -- Candidates: exercises in scope the user has sets for, those in scope already
    -- projected (an exercise whose last set went away must disappear), and those named.
    SELECT coalesce(array_agg(c.exercise_id ORDER BY c.exercise_id), '{}') INTO v_candidates
    FROM (
        SELECT ts.exercise_id
        FROM training_sessions s
        JOIN training_sets ts ON ts.session_id = s.id
        WHERE s.user_id = run.user_id
          AND (cardinality(run.exercise_ids) = 0 OR ts.exercise_id = ANY (run.exercise_ids))
        UNION
        SELECT e.exercise_id FROM user_exercise_stats e
        WHERE e.user_id = run.user_id
          AND (cardinality(run.exercise_ids) = 0 OR e.exercise_id = ANY (run.exercise_ids))
        UNION
        SELECT unnest(run.exercise_ids)
    ) AS c (exercise_id);
    v_total := cardinality(v_candidates);

    IF v_total > p_batch_size THEN
        SELECT coalesce(s.requested_version, 0) AS requested,
               coalesce(s.applied_version, 0) AS applied
        INTO v_versions
        FROM (SELECT 1) AS one
        LEFT JOIN user_stats_refresh_state s ON s.user_id = run.user_id;
        v_cursor := jsonb_build_object(
            'stage', 'batches', 'next_offset', 0, 'exercises', to_jsonb(v_candidates),
            'total', v_total, 'source_revision', v_versions.requested, 'base', v_versions.applied,
            'output_revision', 1, 'retry_count', 0, 'xid', run.xid);
        UPDATE user_stats_projection_runs r
        SET phase = 'claimed', payload = jsonb_build_object('_batch', v_cursor),
            compute_ms = r.compute_ms
                + extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
            retry_not_before = NULL, attempts = v_renewed, error = NULL, finished_at = NULL
        WHERE r.id = p_run_id;
        RETURN QUERY SELECT 'batch_pending', 'batches', 0, v_total, NULL::text,
                            NULL::timestamptz;
        RETURN;
    END IF;

    -- Per exercise: sessions, working sets, reps, volume, heaviest, best Epley estimate,
    -- first and last date; then per period from the period holding from_date.
    INSERT INTO stats_output_exercise
        (run_id, exercise_id, sessions, working_sets, reps, volume, heaviest_kg,
         best_e1rm_kg, first_date, last_date)
    SELECT p_run_id, ts.exercise_id,
           count(DISTINCT s.id),
           count(*) FILTER (WHERE NOT ts.warmup),
           coalesce(sum(ts.reps) FILTER (WHERE NOT ts.warmup), 0),
           coalesce(sum(ts.weight_kg * ts.reps) FILTER (WHERE NOT ts.warmup), 0),
           max(ts.weight_kg) FILTER (WHERE NOT ts.warmup),
           max(estimated_one_rep_max(ts.weight_kg, ts.reps)) FILTER (WHERE NOT ts.warmup),
           min(s.session_date),
           max(s.session_date)
    FROM training_sessions s
    JOIN training_sets ts ON ts.session_id = s.id
    WHERE s.user_id = run.user_id AND ts.exercise_id = ANY (v_candidates)
    GROUP BY ts.exercise_id;
    INSERT INTO stats_output_period
        (run_id, period, period_start, sessions, working_sets, reps, volume)
    SELECT p_run_id, p.period, date_trunc(p.period, s.session_date)::date,
           count(DISTINCT s.id),
           count(ts.id) FILTER (WHERE ts.warmup IS FALSE),
           coalesce(sum(ts.reps) FILTER (WHERE ts.warmup IS FALSE), 0),
           coalesce(sum(ts.weight_kg * ts.reps) FILTER (WHERE ts.warmup IS FALSE), 0)
    FROM training_sessions s
    LEFT JOIN training_sets ts ON ts.session_id = s.id
    CROSS JOIN (VALUES ('day'), ('week'), ('month'), ('quarter'), ('year')) AS p (period)
    WHERE s.user_id = run.user_id
      AND (run.from_date IS NULL
           OR s.session_date >= date_trunc(p.period, run.from_date)::date)
    GROUP BY 2, 3;
    UPDATE user_stats_projection_runs r
    SET phase = 'computed',
        payload = jsonb_build_object('manifest', jsonb_build_object(
            'exercises', to_jsonb(v_candidates), 'mode', 'single', 'batches', 1)),
        compute_ms = r.compute_ms
            + extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
        retry_not_before = NULL, attempts = v_renewed, error = NULL, finished_at = NULL
    WHERE r.id = p_run_id;
    RETURN QUERY SELECT 'computed', NULL::text, NULL::integer, v_total, NULL::text,
                        NULL::timestamptz;
END
$$;

-- Publish: the computed run under its live lease, then (per-user publication lock) the
-- user's state row; a generation not newer than the applied one, or a moved base,
-- rejects into the successor; otherwise the public projections are replaced (foreign
-- keys checked at once: a deleted referenced row raises 23503 and the caller takes its
-- own path), applied_version advances by GREATEST, the generation's PR overview window
-- is built and its rollover scheduled, and run and job finish.
CREATE FUNCTION stats_publish_stage(p_run_id bigint, p_lease_token uuid)
RETURNS TABLE (publish_status text, publish_applied_version bigint, publish_reason text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    run record;
    v_state record;
    v_reason text;
    v_successor bigint;
    v_applied bigint;
BEGIN
    SELECT r.id, r.job_id, r.user_id, r.target_version, r.base_applied_version,
           r.from_date, r.payload
    INTO run
    FROM user_stats_projection_runs r
    WHERE r.id = p_run_id AND r.lease_token = p_lease_token
      AND r.phase = 'computed' AND r.lease_until > now()
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'lease_lost', NULL::bigint, NULL::text;
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('stats_publish:' || run.user_id::text, 0));
    INSERT INTO user_stats_refresh_state AS s (user_id) VALUES (run.user_id)
    ON CONFLICT (user_id) DO UPDATE SET user_id = EXCLUDED.user_id
    RETURNING s.requested_version, s.applied_version INTO v_state;

    IF run.target_version <= v_state.applied_version THEN
        v_reason := format('generation %s is not newer than applied %s',
                         run.target_version, v_state.applied_version);
    ELSIF v_state.applied_version <> run.base_applied_version THEN
        v_reason := 'the published base moved';
    END IF;
    IF v_reason IS NOT NULL THEN
        -- Not published: the run ends and the successor absorbs the job's range.
        DELETE FROM stats_output_exercise o WHERE o.run_id = p_run_id;
        DELETE FROM stats_output_period o WHERE o.run_id = p_run_id;
        UPDATE user_stats_projection_runs r
        SET phase = 'rejected', error = v_reason, finished_at = now()
        WHERE r.id = p_run_id;
        WITH job AS (
            SELECT j.id, j.user_id, j.from_date, j.exercise_ids, j.requested_version,
                   coalesce(s.applied_version, 0) AS applied_version
            FROM user_exercise_stats_refresh_jobs j
            LEFT JOIN user_stats_refresh_state s ON s.user_id = j.user_id
            WHERE j.id = run.job_id
        )
        SELECT enqueue_user_exercise_stats_refresh_job(
            job.user_id, 'manual_refresh', job.from_date, job.exercise_ids,
            'rejected payload rescheduled', 'job:' || job.id,
            CASE WHEN job.requested_version > job.applied_version THEN job.requested_version
                 ELSE bump_stats_requested_version(job.user_id) END)
        INTO v_successor
        FROM job;
        UPDATE user_exercise_stats_refresh_jobs j
        SET status = 'completed', completed_at = now(), updated_at = now(),
            error_message = 'superseded: ' || v_reason,
            metadata = j.metadata || jsonb_build_object('superseded_by', v_successor)
        WHERE j.id = run.job_id;
        RETURN QUERY SELECT 'rejected', NULL::bigint, v_reason;
        RETURN;
    END IF;

    SET CONSTRAINTS ALL IMMEDIATE;
    DELETE FROM user_exercise_stats e
    WHERE e.user_id = run.user_id
      AND e.exercise_id IN (
          SELECT jsonb_array_elements_text(run.payload -> 'manifest' -> 'exercises'));
    INSERT INTO user_exercise_stats
        (user_id, exercise_id, sessions, working_sets, reps, volume, heaviest_kg,
         best_e1rm_kg, first_date, last_date, generation)
    SELECT run.user_id, o.exercise_id, o.sessions, o.working_sets, o.reps, o.volume,
           o.heaviest_kg, o.best_e1rm_kg, o.first_date, o.last_date, run.target_version
    FROM stats_output_exercise o
    WHERE o.run_id = p_run_id
    ON CONFLICT (user_id, exercise_id) DO UPDATE
    SET sessions = EXCLUDED.sessions, working_sets = EXCLUDED.working_sets,
        reps = EXCLUDED.reps, volume = EXCLUDED.volume, heaviest_kg = EXCLUDED.heaviest_kg,
        best_e1rm_kg = EXCLUDED.best_e1rm_kg, first_date = EXCLUDED.first_date,
        last_date = EXCLUDED.last_date, generation = EXCLUDED.generation;
    DELETE FROM user_training_period_stats p
    WHERE p.user_id = run.user_id
      AND (run.from_date IS NULL
           OR p.period_start >= date_trunc(p.period, run.from_date)::date);
    INSERT INTO user_training_period_stats
        (user_id, period, period_start, sessions, working_sets, reps, volume, generation)
    SELECT run.user_id, o.period, o.period_start, o.sessions, o.working_sets, o.reps,
           o.volume, run.target_version
    FROM stats_output_period o
    WHERE o.run_id = p_run_id
    ON CONFLICT (user_id, period, period_start) DO UPDATE
    SET sessions = EXCLUDED.sessions, working_sets = EXCLUDED.working_sets,
        reps = EXCLUDED.reps, volume = EXCLUDED.volume, generation = EXCLUDED.generation;

    -- Public projections and applied_version change together.
    UPDATE user_stats_refresh_state s
    SET applied_version = greatest(s.applied_version, run.target_version), updated_at = now()
    WHERE s.user_id = run.user_id
    RETURNING s.applied_version INTO v_applied;

    -- The generation's PR overview window (database date -1, 0 and +1), built whole;
    -- applied_version itself is its publication fence.
    DELETE FROM user_pr_overview_snapshot_headers h
    WHERE h.user_id = run.user_id AND h.generation <= run.target_version;
    WITH days AS (
        SELECT (stats_clock_date() + d)::date AS as_of FROM generate_series(-1, 1) AS d
    ),
    facts AS (
        SELECT ts.exercise_id, s.session_date AS day, ts.weight_kg,
               estimated_one_rep_max(ts.weight_kg, ts.reps) AS e1rm
        FROM training_sessions s
        JOIN training_sets ts ON ts.session_id = s.id
        WHERE s.user_id = run.user_id AND NOT ts.warmup
        UNION ALL
        SELECT m.exercise_id, m.recorded_on, m.weight_kg,
               estimated_one_rep_max(m.weight_kg, m.reps)
        FROM user_manual_pr_records m
        WHERE m.user_id = run.user_id
    ),
    headers AS (
        INSERT INTO user_pr_overview_snapshot_headers
            (user_id, generation, as_of_date, catalog_epoch, exercise_count)
        SELECT run.user_id, run.target_version, days.as_of,
               (SELECT c.catalog_epoch FROM pr_overview_projection_control c WHERE c.id = 1),
               (SELECT count(DISTINCT f.exercise_id) FROM facts f WHERE f.day <= days.as_of)
        FROM days
        RETURNING as_of_date
    )
    INSERT INTO user_pr_exercise_summary_snapshots
        (user_id, generation, as_of_date, exercise_id, best_e1rm_all_time, best_e1rm_30d,
         best_e1rm_30d_prior_year, heaviest_kg)
    SELECT run.user_id, run.target_version, h.as_of_date, f.exercise_id,
           max(f.e1rm),
           max(f.e1rm) FILTER (WHERE f.day > h.as_of_date - 30),
           max(f.e1rm) FILTER (
               WHERE f.day > (h.as_of_date - interval '1 year')::date - 30
                 AND f.day <= (h.as_of_date - interval '1 year')::date),
           max(f.weight_kg)
    FROM headers h
    JOIN facts f ON f.day <= h.as_of_date
    GROUP BY h.as_of_date, f.exercise_id;
    INSERT INTO user_pr_overview_rollover_state AS o
        (user_id, due_at, snapshot_generation, applied_catalog_epoch, window_end,
         last_success_at)
    SELECT run.user_id, (stats_clock_date() + 1)::timestamptz, run.target_version,
           (SELECT c.catalog_epoch FROM pr_overview_projection_control c WHERE c.id = 1),
           stats_clock_date() + 1, now()
    ON CONFLICT (user_id) DO UPDATE
    SET due_at = EXCLUDED.due_at,
        snapshot_generation = EXCLUDED.snapshot_generation,
        applied_catalog_epoch = EXCLUDED.applied_catalog_epoch,
        window_end = EXCLUDED.window_end,
        attempt_count = 0,
        next_retry_at = NULL,
        last_error = NULL,
        last_success_at = now(),
        updated_at = now();

    DELETE FROM stats_output_exercise o WHERE o.run_id = p_run_id;
    DELETE FROM stats_output_period o WHERE o.run_id = p_run_id;
    UPDATE user_stats_projection_runs r
    SET phase = 'published',
        publish_ms = extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
        finished_at = now()
    WHERE r.id = p_run_id;
    UPDATE user_exercise_stats_refresh_jobs j
    SET status = 'completed', completed_at = now(), updated_at = now(), error_message = NULL
    WHERE j.id = run.job_id;
    RETURN QUERY SELECT 'published', v_applied, NULL::text;
END
$$;

-- The PR overview rollover of the next due user after (p_after_due, p_after_user) in
-- due order, in the caller's one transaction: the user's rollover row locked (users
-- another rollover holds are skipped), its state row locked without waiting (busy: a
-- failed attempt with p_busy_error), a user whose newer generation is pending deferred,
-- else the applied generation's window moved in place and the next rollover scheduled;
-- an error there rolls back the move only and is recorded as a failed attempt. Lock
-- waits are bounded by a 1 s lock timeout; the transaction commits asynchronously (a
-- window is derived data: a roll a crash loses is due again). No row: nobody is due.
CREATE FUNCTION stats_roll_one(p_after_due timestamptz, p_after_user uuid, p_busy_error text)
RETURNS TABLE (roll_due_at timestamptz, roll_user_id uuid, roll_outcome text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_user uuid;
    v_due timestamptz;
    v_requested bigint;
    v_generation bigint;
    v_error text;
    v_built bigint;
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT r.user_id, r.due_at INTO v_user, v_due
    FROM user_pr_overview_rollover_state r
    WHERE r.due_at <= now()
      AND (r.due_at, r.user_id) > (coalesce(p_after_due, '-infinity'),
                                   coalesce(p_after_user,
                                            '00000000-0000-0000-0000-000000000000'))
    ORDER BY r.due_at, r.user_id
    LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT s.requested_version, s.applied_version INTO v_requested, v_generation
    FROM user_stats_refresh_state s
    WHERE s.user_id = v_user
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        v_error := p_busy_error;
        UPDATE user_pr_overview_rollover_state
        SET attempt_count = attempt_count + 1,
            last_error = v_error,
            next_retry_at = now()
                + make_interval(mins => least(60, power(2, attempt_count)::integer)),
            due_at = now() + make_interval(mins => least(60, power(2, attempt_count)::integer)),
            updated_at = now()
        WHERE user_id = v_user;
        RETURN QUERY SELECT v_due, v_user, 'failed';
        RETURN;
    END IF;
    IF v_requested <> v_generation THEN
        UPDATE user_pr_overview_rollover_state
        SET due_at = now() + interval '5 minutes', next_retry_at = now() + interval '5 minutes',
            updated_at = now()
        WHERE user_id = v_user;
        RETURN QUERY SELECT v_due, v_user, 'deferred';
        RETURN;
    END IF;
    BEGIN
        WITH days AS (
            SELECT (stats_clock_date() + d)::date AS as_of FROM generate_series(-1, 1) AS d
        ),
        missing AS (
            SELECT days.as_of FROM days
            WHERE NOT EXISTS (
                SELECT 1 FROM user_pr_overview_snapshot_headers h
                WHERE h.user_id = v_user AND h.generation = v_generation
                  AND h.as_of_date = days.as_of)
        ),
        bounds AS (
            SELECT min(as_of) AS first_day, max(as_of) AS last_day,
                   (SELECT max(h.as_of_date) FROM user_pr_overview_snapshot_headers h
                    WHERE h.user_id = v_user AND h.generation = v_generation
                      AND h.as_of_date < min(missing.as_of)) AS base_day
            FROM missing
            HAVING count(*) > 0
        ),
        base_rows AS (
            SELECT s.exercise_id, s.best_e1rm_all_time, s.heaviest_kg
            FROM bounds b
            JOIN user_pr_exercise_summary_snapshots s
              ON s.user_id = v_user AND s.generation = v_generation
             AND s.as_of_date = b.base_day
        ),
        ranges AS (
            -- After the base (or all history without one) and the 30 days before the first
            -- missing date, through the last; and the same 30-day windows a year earlier.
            SELECT CASE WHEN b.base_day IS NULL THEN '-infinity'::date
                        ELSE least(b.base_day, b.first_day - 30) END AS after_day,
                   b.last_day AS through_day
            FROM bounds b
            UNION ALL
            SELECT (b.first_day - interval '1 year')::date - 31,
                   (b.last_day - interval '1 year')::date
            FROM bounds b
        ),
        facts AS (
            SELECT ts.exercise_id, s.session_date AS day, ts.weight_kg,
                   estimated_one_rep_max(ts.weight_kg, ts.reps) AS e1rm
            FROM ranges r
            JOIN training_sessions s
              ON s.user_id = v_user AND s.session_date > r.after_day
             AND s.session_date <= r.through_day
            JOIN training_sets ts ON ts.session_id = s.id
            WHERE NOT ts.warmup
            UNION ALL
            SELECT m.exercise_id, m.recorded_on, m.weight_kg,
                   estimated_one_rep_max(m.weight_kg, m.reps)
            FROM ranges r
            JOIN user_manual_pr_records m
              ON m.user_id = v_user AND m.recorded_on > r.after_day
             AND m.recorded_on <= r.through_day
        ),
        fresh AS (
            -- Per missing date and exercise (a fact read twice changes no maximum).
            SELECT m.as_of, f.exercise_id,
                   max(f.e1rm) FILTER (WHERE b.base_day IS NULL OR f.day > b.base_day)
                       AS e1rm_since,
                   max(f.weight_kg) FILTER (WHERE b.base_day IS NULL OR f.day > b.base_day)
                       AS heaviest_since,
                   bool_or(b.base_day IS NULL OR f.day > b.base_day) AS seen_since,
                   max(f.e1rm) FILTER (WHERE f.day > m.as_of - 30) AS best_30d,
                   max(f.e1rm) FILTER (
                       WHERE f.day > (m.as_of - interval '1 year')::date - 30
                         AND f.day <= (m.as_of - interval '1 year')::date) AS best_prior_year
            FROM missing m
            CROSS JOIN bounds b
            JOIN facts f ON f.day <= m.as_of
            GROUP BY m.as_of, f.exercise_id
        ),
        keys AS (
            SELECT m.as_of, r.exercise_id FROM missing m CROSS JOIN base_rows r
            UNION
            SELECT as_of, exercise_id FROM fresh WHERE seen_since
        ),
        summary AS (
            SELECT k.as_of, k.exercise_id,
                   greatest(r.best_e1rm_all_time, n.e1rm_since) AS best_e1rm_all_time,
                   n.best_30d, n.best_prior_year,
                   greatest(r.heaviest_kg, n.heaviest_since) AS heaviest_kg
            FROM keys k
            LEFT JOIN base_rows r ON r.exercise_id = k.exercise_id
            LEFT JOIN fresh n ON n.as_of = k.as_of AND n.exercise_id = k.exercise_id
        ),
        headers AS (
            INSERT INTO user_pr_overview_snapshot_headers
                (user_id, generation, as_of_date, catalog_epoch, exercise_count)
            SELECT v_user, v_generation, m.as_of,
                   (SELECT catalog_epoch FROM pr_overview_projection_control WHERE id = 1),
                   (SELECT count(*) FROM summary s WHERE s.as_of = m.as_of)
            FROM missing m
            RETURNING as_of_date
        ),
        summaries AS (
            INSERT INTO user_pr_exercise_summary_snapshots
                (user_id, generation, as_of_date, exercise_id, best_e1rm_all_time, best_e1rm_30d,
                 best_e1rm_30d_prior_year, heaviest_kg)
            SELECT v_user, v_generation, s.as_of, s.exercise_id, s.best_e1rm_all_time,
                   s.best_30d, s.best_prior_year, s.heaviest_kg
            FROM summary s
        ),
        behind AS (
            DELETE FROM user_pr_overview_snapshot_headers h
            WHERE h.user_id = v_user AND h.generation = v_generation
              AND h.as_of_date < stats_clock_date() - 1
        )
        SELECT count(*) INTO v_built FROM headers;
        INSERT INTO user_pr_overview_rollover_state AS r
            (user_id, due_at, snapshot_generation, applied_catalog_epoch, window_end,
             last_success_at)
        SELECT v_user, (stats_clock_date() + 1)::timestamptz, v_generation,
               (SELECT catalog_epoch FROM pr_overview_projection_control WHERE id = 1),
               stats_clock_date() + 1, now()
        ON CONFLICT (user_id) DO UPDATE
        SET due_at = EXCLUDED.due_at,
            snapshot_generation = EXCLUDED.snapshot_generation,
            applied_catalog_epoch = EXCLUDED.applied_catalog_epoch,
            window_end = EXCLUDED.window_end,
            attempt_count = 0,
            next_retry_at = NULL,
            last_error = NULL,
            last_success_at = now(),
            updated_at = now();
    EXCEPTION WHEN query_canceled OR others THEN
        v_error := left(split_part(SQLERRM, E'\n', 1), 200);
        UPDATE user_pr_overview_rollover_state
        SET attempt_count = attempt_count + 1,
            last_error = v_error,
            next_retry_at = now()
                + make_interval(mins => least(60, power(2, attempt_count)::integer)),
            due_at = now() + make_interval(mins => least(60, power(2, attempt_count)::integer)),
            updated_at = now()
        WHERE user_id = v_user;
        RETURN QUERY SELECT v_due, v_user, 'failed';
        RETURN;
    END;
    RETURN QUERY SELECT v_due, v_user, 'rolled';
END
$$;

REVOKE ALL ON FUNCTION
    stats_claim_stage(text, uuid, boolean),
    stats_compute_stage(bigint, uuid, integer),
    stats_publish_stage(bigint, uuid),
    stats_roll_one(timestamptz, uuid, text)
FROM PUBLIC;
