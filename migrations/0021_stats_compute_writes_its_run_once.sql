-- The compute stage writes its run once. It renewed the lease in an update of its own
-- before the work and wrote the outcome (computed, a batch cursor, or failed past the
-- attempt cap) in a second: two new versions of the run row, each with an entry in
-- every index of the runs table. The run is locked from the stage's first statement to
-- its commit and the two updates committed together, so one update carrying both the
-- renewed lease and the outcome leaves every committed state as it was.

CREATE OR REPLACE FUNCTION stats_compute_stage(p_run_id bigint, p_lease_token uuid, p_batch_size integer)
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

    -- The lease renewed at the stage boundary is written with the stage's outcome, in
    -- the one update of the run below (the run is locked until commit either way).
    v_renewed := run.attempts + CASE WHEN run.expired THEN 1 ELSE 0 END;
    IF v_renewed > settings.max_attempts THEN
        -- Past the attempt cap: the run and its job fail; the job's range stays owed.
        UPDATE user_stats_projection_runs r
        SET phase = 'failed', payload = run.payload,
            lease_until = now() + make_interval(secs => settings.lease_seconds),
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
            lease_until = now() + make_interval(secs => settings.lease_seconds),
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
        lease_until = now() + make_interval(secs => settings.lease_seconds),
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

