-- Recorded errors keep their SQLSTATE, so a reader (an operator, the chaos harness)
-- tells an expected refusal from a defect without parsing messages: a refresh
-- request's failed attempt, and a stats run's failed attempt or rejection, store the
-- code of the database error that caused them (NULL when none did).
ALTER TABLE profile_refresh_requests
    ADD COLUMN last_error_sqlstate text,
    ADD CONSTRAINT profile_refresh_requests_last_error_sqlstate CHECK (
        last_error_sqlstate IS NULL
        OR (last_error IS NOT NULL AND last_error_sqlstate ~ '^[0-9A-Z]{5}$'));
ALTER TABLE user_stats_projection_runs
    ADD COLUMN error_sqlstate text,
    ADD CONSTRAINT user_stats_projection_runs_error_sqlstate CHECK (
        error_sqlstate IS NULL
        OR (error IS NOT NULL AND error_sqlstate ~ '^[0-9A-Z]{5}$'));

-- The lease fence refuses with a code of its own (LEASE): 55P03 is a lock timeout, an
-- error callers retry, while a fence refusal is a defect no caller may pass over.
CREATE OR REPLACE FUNCTION stats_projection_run_lease_fence()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF OLD.phase IN ('claimed', 'computed')
       AND OLD.lease_until > clock_timestamp()
       AND (OLD.phase, OLD.payload, OLD.lease_token, OLD.lease_until)
           IS DISTINCT FROM (NEW.phase, NEW.payload, NEW.lease_token, NEW.lease_until)
       AND coalesce(current_setting('inventory.stats_lease_token', true), '')
           <> OLD.lease_token::text
    THEN
        RAISE EXCEPTION 'stats projection run % is leased to another worker', OLD.id
            USING ERRCODE = 'LEASE';
    END IF;
    RETURN NEW;
END
$function$;

-- The failed attempt and the rejection take the SQLSTATE that caused them.
DROP FUNCTION stats_fail_attempt(bigint, text, jsonb);
DROP FUNCTION stats_reject_run(bigint, text);
CREATE FUNCTION stats_fail_attempt(p_run_id bigint, p_error text, p_payload jsonb, p_sqlstate text DEFAULT NULL::text)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
AS $function$
DECLARE
    run record;
    v_retry timestamptz;
BEGIN
    -- After a statement timeout fired, nothing bounds this transaction's statements:
    -- its writes wait for a lock one second at most (then the stage call fails whole).
    PERFORM set_config('lock_timeout', '1s', true);
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

CREATE FUNCTION stats_reject_run(p_run_id bigint, p_reason text, p_sqlstate text DEFAULT NULL::text)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_job bigint;
    v_successor bigint;
BEGIN
    DELETE FROM stats_output_exercise o WHERE o.run_id = p_run_id;
    DELETE FROM stats_output_period o WHERE o.run_id = p_run_id;
    UPDATE user_stats_projection_runs r
    SET phase = 'rejected', error = p_reason, error_sqlstate = p_sqlstate, finished_at = now()
    WHERE r.id = p_run_id
    RETURNING r.job_id INTO v_job;
    SELECT enqueue_user_exercise_stats_refresh_job(
        j.user_id, 'manual_refresh', j.from_date, j.exercise_ids,
        'rejected payload rescheduled', 'job:' || j.id,
        CASE WHEN j.requested_version > coalesce(s.applied_version, 0) THEN j.requested_version
             ELSE bump_stats_requested_version(j.user_id) END)
    INTO v_successor
    FROM user_exercise_stats_refresh_jobs j
    LEFT JOIN user_stats_refresh_state s ON s.user_id = j.user_id
    WHERE j.id = v_job;
    UPDATE user_exercise_stats_refresh_jobs j
    SET status = 'completed', completed_at = now(), updated_at = now(),
        error_message = 'superseded: ' || p_reason,
        metadata = j.metadata || jsonb_build_object('superseded_by', v_successor)
    WHERE j.id = v_job;
    RETURN v_successor;
END
$function$;

REVOKE EXECUTE ON FUNCTION
    stats_fail_attempt(p_run_id bigint, p_error text, p_payload jsonb, p_sqlstate text),
    stats_reject_run(p_run_id bigint, p_reason text, p_sqlstate text)
FROM PUBLIC;

-- The stages pass the SQLSTATE their handlers caught, and clear it with the error.
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
    v_kept jsonb;
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

    -- The step, under a savepoint: its statement budget running out, or a value it
    -- cannot compute, rolls back this step only and is a failed attempt that keeps what
    -- earlier steps committed (the run row stays locked by this stage throughout).
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
        WHEN query_canceled OR data_exception OR insufficient_resources
             OR program_limit_exceeded THEN
            IF SQLSTATE = '57014' AND NOT stats_budget_spent('compute') THEN
                RAISE;  -- a client's or operator's cancel is theirs to handle
            END IF;
            -- The payload as the step found it (its writes are undone), a batch run's
            -- retries counted in its cursor.
            v_kept := CASE WHEN run.payload ? '_batch'
                           THEN jsonb_set(run.payload, '{_batch,retry_count}', to_jsonb(
                               (run.payload #>> '{_batch,retry_count}')::integer + 1))
                           ELSE run.payload END;
            compute_reason := CASE WHEN SQLSTATE = '57014'
                                   THEN 'statement budget spent (57014)'
                                   ELSE format('compute failed (%s): %s', SQLSTATE,
                                               split_part(SQLERRM, E'\n', 1)) END;
            compute_retry_not_before := stats_fail_attempt(p_run_id, compute_reason, v_kept,
                                                           SQLSTATE);
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

CREATE OR REPLACE FUNCTION stats_claim_stage(p_lock_owner text, p_user_id uuid)
 RETURNS TABLE(claim_run_id bigint, claim_job_id bigint, claim_user_id uuid, claim_lease_token uuid, claim_target_version bigint, claim_base_applied_version bigint, claim_from_date date, claim_exercise_ids text[])
 LANGUAGE plpgsql
AS $function$
#variable_conflict use_column
DECLARE
    st record;
    v_slot integer;
    v_until timestamptz;
    v_run record;
    v_candidate record;
    v_tried uuid[] := '{}';
    v_after_at timestamptz := '-infinity';
    v_after_id bigint := 0;
    v_oldest bigint;
    v_job record;
    v_started boolean := false;
    v_owed record;
BEGIN
    SELECT s.paused, s.active_lease_cap, s.lease_seconds, s.max_attempts INTO st
    FROM stats_projection_worker_settings s WHERE s.id = 1;
    IF st.paused THEN
        RETURN;
    END IF;
    -- Two looks for a free slot: a look passes by a free slot another claim is taking,
    -- and sees only what was committed when it began, so a slot freed while it ran (its
    -- worker then taking the slot this look passed by) is found by the second.
    FOR v_look IN 1..2 LOOP
        SELECT l.slot INTO v_slot
        FROM stats_lease_slots l
        WHERE l.slot <= st.active_lease_cap AND l.lease_until <= now()
        ORDER BY l.slot
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
        EXIT WHEN v_slot IS NOT NULL;
    END LOOP;
    IF v_slot IS NULL THEN
        RETURN;
    END IF;
    v_until := now() + make_interval(secs => st.lease_seconds);

    SELECT r.id, r.lease_token,
           r.retry_not_before IS NULL AND r.lease_until <= now() AS lapsed
    INTO v_run
    FROM user_stats_projection_runs r
    WHERE r.phase IN ('claimed', 'computed')
      AND (r.retry_not_before <= now()
           OR (r.phase = 'claimed' AND r.retry_not_before IS NULL
               AND r.lease_until <= now() AND r.payload ? '_batch'))
      AND (p_user_id IS NULL OR r.user_id = p_user_id)
    ORDER BY r.id
    LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        -- Its lease may still be live while it waits out a retry: act under its token.
        PERFORM set_config('inventory.stats_lease_token', v_run.lease_token::text, true);
        UPDATE stats_lease_slots SET run_id = v_run.id, lease_until = v_until
        WHERE slot = v_slot;
        RETURN QUERY
        UPDATE user_stats_projection_runs r
        SET attempts = r.attempts + CASE WHEN v_run.lapsed THEN 1 ELSE 0 END,
            retry_not_before = NULL, lease_until = v_until, lock_owner = p_lock_owner
        WHERE r.id = v_run.id
        RETURNING r.id, r.job_id, r.user_id, r.lease_token, r.target_version,
                  r.base_applied_version, r.from_date, r.exercise_ids;
        RETURN;
    END IF;

    SELECT r.id, r.job_id INTO v_run
    FROM user_stats_projection_runs r
    WHERE r.phase IN ('claimed', 'computed') AND r.lease_until <= now()
      AND r.retry_not_before IS NULL
      AND NOT (r.phase = 'claimed' AND r.payload ? '_batch')
      AND (p_user_id IS NULL OR r.user_id = p_user_id)
    ORDER BY r.lease_until
    LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        DELETE FROM stats_output_exercise o WHERE o.run_id = v_run.id;
        DELETE FROM stats_output_period o WHERE o.run_id = v_run.id;
        UPDATE user_stats_projection_runs r
        SET phase = 'failed', error = 'lease expired', error_sqlstate = NULL,
            finished_at = now()
        WHERE r.id = v_run.id;
        UPDATE user_exercise_stats_refresh_jobs j
        SET locked_at = now(), lock_owner = p_lock_owner, attempts = j.attempts + 1,
            updated_at = now()
        WHERE j.id = v_run.job_id
        RETURNING j.id, j.user_id, j.from_date, j.exercise_ids, j.requested_version,
                  j.attempts
        INTO v_job;
        v_started := true;
    ELSE
        -- Candidates oldest first, one statement each (LIMIT 1 after the last one: the
        -- claim reads the front of the queue in its order, however long the queue is).
        LOOP
            IF p_user_id IS NULL THEN
                SELECT p.user_id, p.created_at, p.id INTO v_candidate
                FROM user_exercise_stats_refresh_jobs p
                WHERE p.status = 'pending'
                  AND (p.created_at, p.id) > (v_after_at, v_after_id)
                  AND NOT EXISTS (
                      SELECT 1 FROM user_exercise_stats_refresh_jobs q
                      WHERE q.user_id = p.user_id AND q.status = 'processing')
                ORDER BY p.created_at, p.id
                LIMIT 1;
            ELSE
                SELECT p.user_id, p.created_at, p.id INTO v_candidate
                FROM user_exercise_stats_refresh_jobs p
                WHERE p.user_id = p_user_id AND p.status = 'pending'
                  AND (p.created_at, p.id) > (v_after_at, v_after_id)
                ORDER BY p.created_at, p.id
                LIMIT 1;
            END IF;
            EXIT WHEN NOT FOUND;
            v_after_at := v_candidate.created_at;
            v_after_id := v_candidate.id;
            CONTINUE WHEN v_candidate.user_id = ANY (v_tried);
            v_tried := v_tried || v_candidate.user_id;
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(stats_user_lock(v_candidate.user_id));
            -- Under the user's lock, in statements of their own (their snapshots see what
            -- a claim that held it committed): the user's oldest pending job, unless a
            -- save holds it (then the user is passed by), and no live job.
            v_oldest := NULL;
            SELECT o.id INTO v_oldest
            FROM user_exercise_stats_refresh_jobs o
            WHERE o.user_id = v_candidate.user_id AND o.status = 'pending'
            ORDER BY o.id
            LIMIT 1;
            CONTINUE WHEN v_oldest IS NULL OR EXISTS (
                SELECT 1 FROM user_exercise_stats_refresh_jobs q
                WHERE q.user_id = v_candidate.user_id AND q.status = 'processing');
            PERFORM 1 FROM user_exercise_stats_refresh_jobs o
            WHERE o.id = v_oldest AND o.status = 'pending'
            FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
            UPDATE user_exercise_stats_refresh_jobs j
            SET status = 'processing', locked_at = now(), lock_owner = p_lock_owner,
                attempts = j.attempts + 1, updated_at = now()
            WHERE j.id = v_oldest
            RETURNING j.id, j.user_id, j.from_date, j.exercise_ids, j.requested_version,
                      j.attempts
            INTO v_job;
            v_started := true;
            EXIT;
        END LOOP;
        IF NOT v_started THEN
            RETURN;
        END IF;
    END IF;

    IF v_job.attempts > st.max_attempts THEN
        UPDATE user_exercise_stats_refresh_jobs j
        SET status = 'failed', error_message = 'attempts exhausted', updated_at = now(),
            completed_at = now()
        WHERE j.id = v_job.id;
        claim_job_id := v_job.id;
        claim_user_id := v_job.user_id;
        RETURN NEXT;
        RETURN;
    END IF;

    -- The user's owed range joins the job (a statement of its own, after the start: its
    -- snapshot sees a failure committed while the start ran).
    DELETE FROM user_stats_owed_ranges o WHERE o.user_id = v_job.user_id
    RETURNING o.from_date, o.exercise_ids, o.failed_job_ids INTO v_owed;
    IF FOUND THEN
        UPDATE user_exercise_stats_refresh_jobs j
        SET from_date = stats_merge_from_date(j.from_date, v_owed.from_date),
            exercise_ids = stats_merge_exercise_ids(j.exercise_ids, v_owed.exercise_ids),
            metadata = j.metadata || jsonb_build_object(
                'absorbed_failed_jobs',
                coalesce(j.metadata -> 'absorbed_failed_jobs', '[]')
                    || to_jsonb(v_owed.failed_job_ids)),
            updated_at = now()
        WHERE j.id = v_job.id
        RETURNING j.from_date, j.exercise_ids INTO v_job.from_date, v_job.exercise_ids;
    END IF;

    INSERT INTO user_stats_projection_runs AS r
        (job_id, user_id, phase, lease_token, lease_until, lock_owner, target_version,
         base_applied_version, from_date, exercise_ids, attempts)
    VALUES (v_job.id, v_job.user_id, 'claimed', gen_random_uuid(), v_until, p_lock_owner,
            v_job.requested_version,
            coalesce((SELECT s.applied_version FROM user_stats_refresh_state s
                      WHERE s.user_id = v_job.user_id), 0),
            v_job.from_date, v_job.exercise_ids, v_job.attempts)
    RETURNING r.id, r.job_id, r.user_id, r.lease_token, r.target_version,
              r.base_applied_version, r.from_date, r.exercise_ids
    INTO claim_run_id, claim_job_id, claim_user_id, claim_lease_token,
         claim_target_version, claim_base_applied_version, claim_from_date,
         claim_exercise_ids;
    UPDATE stats_lease_slots SET run_id = claim_run_id, lease_until = v_until
    WHERE slot = v_slot;
    RETURN NEXT;
END
$function$;

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
        WHEN query_canceled OR data_exception OR insufficient_resources
             OR program_limit_exceeded THEN
            IF SQLSTATE = '57014' AND NOT stats_budget_spent('publish') THEN
                RAISE;  -- a client's or operator's cancel is theirs to handle
            END IF;
            publish_reason := CASE WHEN SQLSTATE = '57014'
                                   THEN 'statement budget spent (57014)'
                                   ELSE format('publish failed (%s): %s', SQLSTATE,
                                               split_part(SQLERRM, E'\n', 1)) END;
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
