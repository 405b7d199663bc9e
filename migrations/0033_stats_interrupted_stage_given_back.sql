-- A stage call that a statement timeout, a cancel, a lock timeout, a deadlock or a
-- serialization failure ends is rolled back whole, wherever it waited (a publication
-- waits for the user's state row while a save holds it, outside the stage's own error
-- handler). The run was then left claimed under a live lease, holding its slot for the
-- whole lease with nobody at work on it; two such runs filled the default cap of two and
-- no user was published until the leases ran out. Now its worker gives it back at once
-- (stats_give_back_run): a timeout, a cancel or a lock timeout is a failed attempt with
-- the backoff, a deadlock or serialization failure is due again at once, the SQLSTATE is
-- recorded, and the slot is free. The stages no longer catch 57014 themselves (the
-- give-back is the one path), so stats_budget_spent goes: the worker tells a spent budget
-- from a cancel by the time its call ran. A batch run's failed attempts count their
-- retries in the cursor wherever they fail (stats_fail_attempt).
-- A failed attempt of a run: attempt n waits n x retry_backoff_seconds with `p_payload`
-- kept (its cursor, with the batch retries counted, or its computed output); past
-- max_attempts the run and its job fail, the run's private output goes, and the job's
-- range is owed (trigger). `p_sqlstate` is the database error's code when one caused
-- the failure. Returns the retry time (NULL: failed for good).
CREATE OR REPLACE FUNCTION stats_fail_attempt(p_run_id bigint, p_error text, p_payload jsonb, p_sqlstate text DEFAULT NULL::text)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
AS $function$
DECLARE
    run record;
    v_retry timestamptz;
BEGIN
    IF p_payload ? '_batch' THEN
        p_payload := jsonb_set(p_payload, '{_batch,retry_count}',
                               to_jsonb((p_payload #>> '{_batch,retry_count}')::integer + 1));
    END IF;
    SELECT r.job_id, r.attempts, st.max_attempts, st.retry_backoff_seconds INTO run
    FROM user_stats_projection_runs r
    JOIN stats_projection_worker_settings st ON st.id = 1
    WHERE r.id = p_run_id;
    IF run.attempts >= run.max_attempts THEN
        DELETE FROM stats_output_exercise o WHERE o.run_id = p_run_id;
        DELETE FROM stats_output_period o WHERE o.run_id = p_run_id;
        UPDATE user_stats_projection_runs r
        SET phase = 'failed', payload = p_payload, error = p_error,
            error_sqlstate = p_sqlstate, finished_at = now()
        WHERE r.id = p_run_id;
        UPDATE user_exercise_stats_refresh_jobs j
        SET status = 'failed', error_message = p_error, updated_at = now(),
            completed_at = now()
        WHERE j.id = run.job_id;
        RETURN NULL;
    END IF;
    v_retry := now() + make_interval(secs => run.attempts * run.retry_backoff_seconds);
    UPDATE user_stats_projection_runs r
    SET attempts = r.attempts + 1, retry_not_before = v_retry, payload = p_payload,
        error = p_error, error_sqlstate = p_sqlstate
    WHERE r.id = p_run_id;
    RETURN v_retry;
END
$function$;

-- A stage call that a statement timeout, a cancel, a lock timeout, a deadlock or a
-- serialization failure ended was rolled back whole: its run is as the call found it,
-- claimed under a live lease and holding its slot, with nobody at work on it. Its worker
-- gives it back at once, in a transaction of its own, so the slot is free and the next
-- claim can take the run: a statement timeout, a cancel or a lock timeout (57014, 55P03)
-- is a failed attempt (stats_fail_attempt: the backoff, the cursor or the computed
-- output kept; past max_attempts the job fails and its range is owed); a deadlock or a
-- serialization failure (40P01, 40001) leaves the run due again at once, no attempt
-- counted (the same call may succeed now). The reason and SQLSTATE are recorded either
-- way. Only the worker still holding the lease gives the run back: under its token and
-- lock owner, not waiting out a retry, its slot live and not being taken; otherwise the
-- answer is lost (the claim's recovery owns the run) and nothing is written.
CREATE OR REPLACE FUNCTION stats_give_back_run(p_run_id bigint, p_lease_token uuid, p_lock_owner text, p_stage text, p_sqlstate text, p_budget_spent boolean)
 RETURNS TABLE(give_back_status text, give_back_reason text, give_back_retry_not_before timestamp with time zone)
 LANGUAGE plpgsql
AS $function$
#variable_conflict use_column
DECLARE
    v_payload jsonb;
    v_held boolean := false;
BEGIN
    give_back_reason := format('%s: %s (%s)', p_stage,
                               CASE WHEN p_sqlstate = '57014' AND p_budget_spent
                                    THEN 'statement budget spent'
                                    WHEN p_sqlstate = '57014' THEN 'canceled'
                                    WHEN p_sqlstate = '55P03' THEN 'lock wait timed out'
                                    WHEN p_sqlstate = '40P01' THEN 'deadlock'
                                    WHEN p_sqlstate = '40001' THEN 'serialization failure'
                                    ELSE 'interrupted' END,
                               p_sqlstate);
    SELECT r.payload INTO v_payload
    FROM user_stats_projection_runs r
    WHERE r.id = p_run_id AND r.lease_token = p_lease_token AND r.lock_owner = p_lock_owner
      AND r.phase IN ('claimed', 'computed') AND r.retry_not_before IS NULL
    FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        PERFORM 1 FROM stats_lease_slots l
        WHERE l.run_id = p_run_id AND l.lease_until > now()
        FOR UPDATE SKIP LOCKED;
        v_held := FOUND;
    END IF;
    IF NOT v_held THEN
        give_back_status := 'lost';
    ELSIF p_sqlstate IN ('40P01', '40001') THEN
        UPDATE user_stats_projection_runs r
        SET retry_not_before = now(), error = give_back_reason, error_sqlstate = p_sqlstate
        WHERE r.id = p_run_id;
        give_back_status := 'retry_pending';
        give_back_retry_not_before := now();
    ELSE
        give_back_retry_not_before := stats_fail_attempt(p_run_id, give_back_reason,
                                                         v_payload, p_sqlstate);
        give_back_status := CASE WHEN give_back_retry_not_before IS NULL THEN 'failed'
                                 ELSE 'retry_pending' END;
    END IF;
    RETURN NEXT;
END
$function$;

-- The second committed stage, one step per call, each its own transaction. An account
-- with at most `p_batch_size` candidate exercises computes in one step; a larger one is
-- prepared (its exercise list frozen in the run's payload._batch), then computed in
-- batches of at most `p_batch_size`, then finalized (the periods and the manifest).
-- Answers: computed (publish may follow), batch_pending (commit and call again; with
-- reason transaction_boundary_required for a second call in one transaction),
-- retry_pending (wait for retry_not_before), failed (attempts spent, range owed), lost
-- (no live lease under this token: the claim's recovery owns the run).
CREATE OR REPLACE FUNCTION stats_compute_stage(p_run_id bigint, p_lease_token uuid, p_batch_size integer)
 RETURNS TABLE(compute_status text, compute_stage text, compute_next_offset integer, compute_total integer, compute_reason text, compute_retry_not_before timestamp with time zone)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    st record;
    run record;
    v_cursor jsonb;
    v_candidates text[];
    v_chunk text[];
    v_sessions boolean;
    v_total integer;
    v_offset integer;
    v_applied bigint;
    v_periods bigint := 0;
BEGIN
    SELECT s.lease_seconds, s.max_attempts INTO st
    FROM stats_projection_worker_settings s WHERE s.id = 1;
    SELECT r.id, r.job_id, r.user_id, r.phase, r.lease_until, r.retry_not_before,
           r.attempts, r.base_applied_version, r.target_version, r.from_date,
           r.exercise_ids, r.payload, txid_current() AS xid
    INTO run
    FROM user_stats_projection_runs r
    WHERE r.id = p_run_id AND r.lease_token = p_lease_token
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        compute_status := 'lost';
        compute_reason := 'no run under this lease, or another worker is on it';
        RETURN NEXT;
        RETURN;
    END IF;
    v_cursor := run.payload -> '_batch';
    -- The answers that need no work (each one row; unset columns are null).
    IF run.phase = 'computed' THEN
        compute_status := 'computed';
    ELSIF run.phase <> 'claimed' THEN
        compute_status := 'lost';
        compute_reason := 'run is ' || run.phase;
    ELSIF run.retry_not_before IS NOT NULL THEN
        compute_status := 'retry_pending';
        compute_retry_not_before := run.retry_not_before;
    ELSIF run.lease_until <= now() THEN
        compute_status := 'lost';
        compute_reason := 'lease lapsed';
    ELSIF (v_cursor ->> 'xid')::bigint = run.xid THEN
        compute_status := 'batch_pending';
        compute_stage := v_cursor ->> 'stage';
        compute_next_offset := (v_cursor ->> 'next_offset')::integer;
        compute_total := (v_cursor ->> 'total')::integer;
        compute_reason := 'transaction_boundary_required';
    END IF;
    IF compute_status IS NOT NULL THEN
        RETURN NEXT;
        RETURN;
    END IF;

    -- The step, under a savepoint: a value it cannot compute (a data exception, a
    -- resource or program limit) rolls back this step only and is a failed attempt that
    -- keeps what earlier steps committed (the run row stays locked by this stage
    -- throughout). A timeout, a cancel, a lock timeout or a deadlock ends the whole call
    -- instead, and its worker gives the run back (stats_give_back_run).
    BEGIN
        IF NOT stats_renew_lease(p_run_id, st.lease_seconds) THEN
            compute_status := 'lost';
            compute_reason := 'lease slot taken';
            RETURN NEXT;
            RETURN;
        ELSIF run.attempts > st.max_attempts THEN
            PERFORM stats_fail_attempt(p_run_id, 'attempts exhausted', run.payload);
            compute_status := 'failed';
            compute_reason := 'attempts exhausted';
            RETURN NEXT;
            RETURN;
        END IF;
        IF v_cursor IS NULL THEN
            -- Candidates: exercises in scope the user has sets for, those in scope already
            -- projected (an exercise whose last set went away must disappear), and those
            -- named; and whether the user has any session (no session, no period rows).
            SELECT coalesce(array_agg(c.exercise_id ORDER BY c.exercise_id), '{}'),
                   EXISTS (SELECT 1 FROM training_sessions s WHERE s.user_id = run.user_id)
            INTO v_candidates, v_sessions
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
                -- Preparation: the exercise list frozen, with the inputs the batches check.
                v_cursor := jsonb_build_object(
                    'stage', 'batches', 'next_offset', 0, 'exercises', to_jsonb(v_candidates),
                    'total', v_total, 'source', run.target_version, 'anchor', run.from_date,
                    'base', run.base_applied_version, 'output_revision', 0, 'retry_count', 0,
                    'sessions', v_sessions, 'xid', run.xid);
                UPDATE user_stats_projection_runs r
                SET payload = jsonb_build_object('_batch', v_cursor),
                    error = NULL, error_sqlstate = NULL,
                    compute_ms = r.compute_ms
                        + extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000
                WHERE r.id = p_run_id;
                compute_status := 'batch_pending';
                compute_stage := 'batches';
                compute_next_offset := 0;
                compute_total := v_total;
                RETURN NEXT;
                RETURN;
            END IF;
        ELSE
            -- A batch step checks the inputs its cursor was prepared on: the run fixes its
            -- target and anchor, so the published base is the one that can move. A save
            -- meanwhile does not: its writes stay a pending successor.
            SELECT coalesce(s.applied_version, 0) INTO v_applied
            FROM (SELECT 1) AS one
            LEFT JOIN user_stats_refresh_state s ON s.user_id = run.user_id;
            IF v_applied <> (v_cursor ->> 'base')::bigint THEN
                DELETE FROM stats_output_exercise o WHERE o.run_id = p_run_id;
                DELETE FROM stats_output_period o WHERE o.run_id = p_run_id;
                compute_reason := 'inputs changed: the published base moved';
                compute_retry_not_before := stats_fail_attempt(p_run_id, compute_reason,
                                                               run.payload - '_batch');
                compute_status := CASE WHEN compute_retry_not_before IS NULL THEN 'failed'
                                       ELSE 'retry_pending' END;
                RETURN NEXT;
                RETURN;
            END IF;
            v_candidates := ARRAY(SELECT jsonb_array_elements_text(v_cursor -> 'exercises'));
            v_total := cardinality(v_candidates);
            v_sessions := coalesce((v_cursor ->> 'sessions')::boolean, true);
            v_offset := (v_cursor ->> 'next_offset')::integer;
        END IF;

        IF v_cursor IS NULL OR v_cursor ->> 'stage' = 'batches' THEN
            v_chunk := CASE WHEN v_cursor IS NULL THEN v_candidates
                            ELSE v_candidates[v_offset + 1 : v_offset + p_batch_size] END;
            -- Per exercise: sessions, working sets, reps, volume, heaviest, best Epley
            -- estimate, first and last date.
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
            WHERE s.user_id = run.user_id AND ts.exercise_id = ANY (v_chunk)
            GROUP BY ts.exercise_id;
        END IF;
        IF v_cursor IS NOT NULL AND v_cursor ->> 'stage' = 'batches' THEN
            v_offset := v_offset + cardinality(v_chunk);
            v_cursor := v_cursor || jsonb_build_object(
                'stage', CASE WHEN v_offset >= v_total THEN 'finalize' ELSE 'batches' END,
                'next_offset', v_offset,
                'output_revision', (v_cursor ->> 'output_revision')::integer + 1,
                'xid', run.xid);
            UPDATE user_stats_projection_runs r
            SET payload = jsonb_build_object('_batch', v_cursor),
                error = NULL, error_sqlstate = NULL,
                compute_ms = r.compute_ms
                    + extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000
            WHERE r.id = p_run_id;
            compute_status := 'batch_pending';
            compute_stage := v_cursor ->> 'stage';
            compute_next_offset := v_offset;
            compute_total := v_total;
            RETURN NEXT;
            RETURN;
        END IF;
        -- Per user per period (day, ISO week from Monday, month, quarter, year) from
        -- the period holding from_date (NULL: all history).
        IF v_sessions THEN
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
            GET DIAGNOSTICS v_periods = ROW_COUNT;
        END IF;
    EXCEPTION
        WHEN data_exception OR insufficient_resources OR program_limit_exceeded THEN
            -- The payload as the step found it (its writes are undone).
            compute_reason := format('compute failed (%s): %s', SQLSTATE,
                                     split_part(SQLERRM, E'\n', 1));
            compute_retry_not_before := stats_fail_attempt(p_run_id, compute_reason,
                                                           run.payload, SQLSTATE);
            compute_status := CASE WHEN compute_retry_not_before IS NULL THEN 'failed'
                                   ELSE 'retry_pending' END;
            compute_stage := NULL;
            compute_next_offset := NULL;
            RETURN NEXT;
            RETURN;
    END;
    UPDATE user_stats_projection_runs r
    SET phase = 'computed', error = NULL, error_sqlstate = NULL,
        payload = jsonb_build_object('manifest', jsonb_build_object(
            'exercises', to_jsonb(v_candidates),
            'mode', CASE WHEN v_cursor IS NULL THEN 'single' ELSE 'batched' END,
            'batches', CASE WHEN v_cursor IS NULL THEN 1
                            ELSE (v_cursor ->> 'output_revision')::integer END,
            'periods', v_periods)),
        compute_ms = r.compute_ms
            + extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000
    WHERE r.id = p_run_id;
    compute_status := 'computed';
    compute_total := v_total;
    RETURN NEXT;
END
$function$;

-- The third committed stage: under a live lease, the user's lock and state row, the
-- public projections replaced and applied_version advanced with the PR overview window,
-- or the run rejected into a successor (an older generation, a moved base, a deleted
-- referenced row), or a failed attempt (a value it cannot publish). A wait that runs out
-- (for the user's lock or state row, held by a save in progress), a cancel or a deadlock
-- ends the whole call, and its worker gives the run back (stats_give_back_run).
CREATE OR REPLACE FUNCTION stats_publish_stage(p_run_id bigint, p_lease_token uuid)
 RETURNS TABLE(publish_status text, publish_applied_version bigint, publish_reason text, publish_retry_not_before timestamp with time zone)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
#variable_conflict use_column
DECLARE
    run record;
    v_state record;
    v_applied bigint;
    v_exercises text[];
    v_windowed integer;
BEGIN
    SELECT r.id, r.job_id, r.user_id, r.target_version, r.base_applied_version,
           r.from_date, r.payload
    INTO run
    FROM user_stats_projection_runs r
    WHERE r.id = p_run_id AND r.lease_token = p_lease_token
      AND r.phase = 'computed' AND r.lease_until > now() AND r.retry_not_before IS NULL
    FOR UPDATE;
    IF NOT FOUND OR NOT stats_renew_lease(p_run_id, (
        SELECT st.lease_seconds FROM stats_projection_worker_settings st WHERE st.id = 1))
    THEN
        publish_status := 'lost';
        RETURN NEXT;
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(stats_user_lock(run.user_id));
    INSERT INTO user_stats_refresh_state AS s (user_id) VALUES (run.user_id)
    ON CONFLICT (user_id) DO UPDATE SET user_id = EXCLUDED.user_id
    RETURNING s.requested_version, s.applied_version INTO v_state;
    IF run.target_version <= v_state.applied_version THEN
        publish_reason := format('generation %s is not newer than applied %s',
                                 run.target_version, v_state.applied_version);
    ELSIF v_state.applied_version <> run.base_applied_version THEN
        publish_reason := 'the published base moved';
    END IF;
    IF publish_reason IS NOT NULL THEN
        PERFORM stats_reject_run(p_run_id, publish_reason);
        publish_status := 'rejected';
        publish_applied_version := v_state.applied_version;
        RETURN NEXT;
        RETURN;
    END IF;

    BEGIN
        SET CONSTRAINTS ALL IMMEDIATE;
        UPDATE user_stats_refresh_state s
        SET applied_version = run.target_version, updated_at = now()
        WHERE s.user_id = run.user_id
        RETURNING s.applied_version INTO v_applied;

        v_exercises := ARRAY(
            SELECT jsonb_array_elements_text(run.payload -> 'manifest' -> 'exercises'));
        IF cardinality(v_exercises) > 0 THEN
            DELETE FROM user_exercise_stats e
            WHERE e.user_id = run.user_id AND e.exercise_id = ANY (v_exercises);
            INSERT INTO user_exercise_stats
                (user_id, exercise_id, sessions, working_sets, reps, volume, heaviest_kg,
                 best_e1rm_kg, first_date, last_date, generation)
            SELECT run.user_id, o.exercise_id, o.sessions, o.working_sets, o.reps, o.volume,
                   o.heaviest_kg, o.best_e1rm_kg, o.first_date, o.last_date,
                   run.target_version
            FROM stats_output_exercise o
            WHERE o.run_id = p_run_id;
            DELETE FROM stats_output_exercise o WHERE o.run_id = p_run_id;
        END IF;
        DELETE FROM user_training_period_stats p
        WHERE p.user_id = run.user_id
          AND (run.from_date IS NULL
               OR p.period_start >= date_trunc(p.period, run.from_date)::date);
        IF coalesce((run.payload -> 'manifest' ->> 'periods')::bigint, 1) > 0 THEN
            INSERT INTO user_training_period_stats
                (user_id, period, period_start, sessions, working_sets, reps, volume,
                 generation)
            SELECT run.user_id, o.period, o.period_start, o.sessions, o.working_sets, o.reps,
                   o.volume, run.target_version
            FROM stats_output_period o
            WHERE o.run_id = p_run_id;
            DELETE FROM stats_output_period o WHERE o.run_id = p_run_id;
        END IF;

        -- The generation's PR overview window (database date -1, 0 and +1), built whole,
        -- replacing the older generations' windows; applied_version itself is its
        -- publication fence. Per exercise as of each date: the all-time best Epley
        -- estimate (manual PR records included), the best in the 30 days ending on it,
        -- the same window a year earlier, and the heaviest weight. A user with no facts
        -- has three headers counting no exercise.
        DELETE FROM user_pr_overview_snapshot_headers h
        WHERE h.user_id = run.user_id AND h.generation <= run.target_version;
        INSERT INTO user_pr_overview_snapshot_headers
            (user_id, generation, as_of_date, catalog_epoch, exercise_count)
        SELECT run.user_id, run.target_version, (stats_clock_date() + d)::date,
               (SELECT c.catalog_epoch FROM pr_overview_projection_control c WHERE c.id = 1), 0
        FROM generate_series(-1, 1) AS d
        WHERE NOT EXISTS (SELECT 1 FROM training_sessions s WHERE s.user_id = run.user_id)
          AND NOT EXISTS (SELECT 1 FROM user_manual_pr_records m
                          WHERE m.user_id = run.user_id);
        GET DIAGNOSTICS v_windowed = ROW_COUNT;
        IF v_windowed = 0 THEN
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
                       (SELECT c.catalog_epoch FROM pr_overview_projection_control c
                        WHERE c.id = 1),
                       (SELECT count(DISTINCT f.exercise_id) FROM facts f
                        WHERE f.day <= days.as_of)
                FROM days
                RETURNING as_of_date
            )
            INSERT INTO user_pr_exercise_summary_snapshots
                (user_id, generation, as_of_date, exercise_id, best_e1rm_all_time,
                 best_e1rm_30d, best_e1rm_30d_prior_year, heaviest_kg)
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
        END IF;
        -- The window is fresh: the next rollover is due when the database date moves on.
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
    EXCEPTION
        WHEN foreign_key_violation THEN
            publish_reason := 'a referenced canonical row was deleted (23503)';
            PERFORM stats_reject_run(p_run_id, publish_reason, SQLSTATE);
            publish_status := 'rejected';
            publish_applied_version := v_state.applied_version;
            RETURN NEXT;
            RETURN;
        WHEN data_exception OR insufficient_resources OR program_limit_exceeded THEN
            publish_reason := format('publish failed (%s): %s', SQLSTATE,
                                     split_part(SQLERRM, E'\n', 1));
            publish_retry_not_before := stats_fail_attempt(p_run_id, publish_reason,
                                                           run.payload, SQLSTATE);
            publish_status := CASE WHEN publish_retry_not_before IS NULL THEN 'failed'
                                   ELSE 'retry_pending' END;
            publish_applied_version := v_state.applied_version;
            RETURN NEXT;
            RETURN;
    END;

    UPDATE user_stats_projection_runs r
    SET phase = 'published',
        publish_ms = extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
        finished_at = now()
    WHERE r.id = p_run_id;
    UPDATE user_exercise_stats_refresh_jobs j
    SET status = 'completed', completed_at = now(), updated_at = now(), error_message = NULL
    WHERE j.id = run.job_id;
    publish_status := 'published';
    publish_applied_version := v_applied;
    RETURN NEXT;
END
$function$;

DROP FUNCTION stats_budget_spent(text);

REVOKE ALL ON FUNCTION
    stats_give_back_run(p_run_id bigint, p_lease_token uuid, p_lock_owner text, p_stage text, p_sqlstate text, p_budget_spent boolean)
FROM PUBLIC;
