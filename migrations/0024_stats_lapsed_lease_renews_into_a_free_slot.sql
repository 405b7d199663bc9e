-- A lapsed lease is renewed only into a free lease slot.
--
-- Every active lease holds a distinct slot numbered 1 to the cap, which bounds the
-- leases by the cap. A lease that lapsed holds none, nor does a run waiting out a retry
-- time: a claim may fill its slot (a claim scoped to another user does not take the run
-- back). The compute stage, and a run's next batch, renewed such a lease without a slot
-- (once a retry time had passed, the run was simply active again), so the run became
-- active beside the claim's lease and the cap was passed by one. Such a lease is now
-- renewed only into a slot taken as a claim takes one: never a slot seen held; its own
-- first, else the lowest free one, locked, then confirmed free in a snapshot after the
-- lock; when an active lease holds no slot of the cap (the cap was lowered under it),
-- every slot; and the leases counted below the cap after that. With no slot free the
-- stage answers without writing, and the run stays as it is until a claim takes it back.

-- Is a slot held by an active lease other than the given run's? (Called in a statement
-- of its own after the slot's lock, as stats_lease_slot_held.)
CREATE FUNCTION stats_lease_slot_held_by_another(p_slot integer, p_run_id bigint)
RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT EXISTS (
        SELECT 1 FROM user_stats_projection_runs r
        WHERE r.phase IN ('claimed', 'computed') AND r.id <> p_run_id
          AND stats_run_is_active(r.phase, r.lease_until, r.retry_not_before)
          AND r.lease_slot = p_slot)
$$;

CREATE FUNCTION stats_renew_lapsed_lease(p_run_id bigint) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_cap integer;
    v_own integer;
    v_held integer[];
    v_slot integer;
    v_try integer;
BEGIN
    -- The cap, the run's own slot and the slots active leases hold now, read before any
    -- lock (a slot seen held is never locked: its lock would be kept to this commit).
    SELECT st.active_lease_cap, r.lease_slot,
           ARRAY(SELECT a.lease_slot FROM user_stats_projection_runs a
                 WHERE a.phase IN ('claimed', 'computed') AND a.id <> p_run_id
                   AND stats_run_is_active(a.phase, a.lease_until, a.retry_not_before))
    INTO v_cap, v_own, v_held
    FROM stats_projection_worker_settings st
    CROSS JOIN user_stats_projection_runs r
    WHERE st.id = 1 AND r.id = p_run_id;
    IF EXISTS (SELECT 1 FROM unnest(v_held) AS h (slot)
               WHERE h.slot IS NULL OR h.slot NOT BETWEEN 1 AND v_cap) THEN
        -- An active lease outside the slots (the cap was lowered under it): distinct
        -- slots no longer bound the count, so, as a claim does, every slot, then the
        -- count and a free slot (its own first) in a snapshot after those locks.
        FOR v_slot IN 1 .. v_cap LOOP
            IF NOT pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), v_slot) THEN
                RETURN false;
            END IF;
        END LOOP;
        SELECT s INTO v_slot
        FROM generate_series(1, v_cap) AS s
        WHERE NOT stats_lease_slot_held_by_another(s, p_run_id)
        ORDER BY s IS DISTINCT FROM v_own, s
        LIMIT 1;
    ELSE
        FOR v_try IN
            SELECT t.s
            FROM unnest(array_prepend(v_own, ARRAY(SELECT generate_series(1, v_cap))))
                WITH ORDINALITY AS t (s, n)
            WHERE t.s BETWEEN 1 AND v_cap AND t.s <> ALL (array_remove(v_held, NULL))
            ORDER BY t.n
        LOOP
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), v_try);
            -- After the lock, a statement of its own: its snapshot sees every lease
            -- committed into the slot.
            IF NOT stats_lease_slot_held_by_another(v_try, p_run_id) THEN
                v_slot := v_try;
                EXIT;
            END IF;
        END LOOP;
    END IF;
    -- Counted after the lock too: a lease a lowered cap left outside the slots since the
    -- first read bounds nothing.
    IF v_slot IS NULL OR (SELECT count(*) FROM (
            SELECT 1 FROM user_stats_projection_runs r
            WHERE r.phase IN ('claimed', 'computed') AND r.id <> p_run_id
              AND stats_run_is_active(r.phase, r.lease_until, r.retry_not_before)
            LIMIT v_cap) AS active) >= v_cap THEN
        RETURN false;
    END IF;
    UPDATE user_stats_projection_runs r SET lease_slot = v_slot
    WHERE r.id = p_run_id AND r.lease_slot IS DISTINCT FROM v_slot;
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION stats_compute_stage(p_run_id bigint, p_lease_token uuid, p_batch_size integer)
RETURNS TABLE (
    compute_status text, compute_stage text, compute_next_offset integer,
    compute_total integer, compute_reason text, compute_retry_not_before timestamptz)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    run record;
    v_renewed integer;
    v_candidates text[];
    v_sessions boolean;
    v_total integer;
    v_periods bigint := 0;
    v_versions record;
    v_cursor jsonb;
BEGIN
    -- Each answer is one row of the output columns (all null unless set below).
    SELECT r.id, r.job_id, r.user_id, r.phase, r.lease_until <= now() AS expired,
           r.lease_until <= now() + make_interval(secs => st.compute_budget_ms / 1000.0 + 1)
               AS ending,
           r.retry_not_before > now() AS backing_off, r.retry_not_before, r.attempts,
           r.from_date, r.exercise_ids, r.payload, txid_current() AS xid,
           st.lease_seconds, st.max_attempts
    INTO run
    FROM user_stats_projection_runs r
    CROSS JOIN stats_projection_worker_settings st
    WHERE r.id = p_run_id AND r.lease_token = p_lease_token AND st.id = 1
    FOR UPDATE OF r SKIP LOCKED;
    IF NOT FOUND THEN
        compute_status := 'failed';
        compute_reason := 'lease lost or run busy';
    ELSIF run.payload ? '_batch' THEN
        compute_status := 'client';
    ELSIF run.phase = 'computed' THEN
        compute_status := 'computed';
    ELSIF run.phase <> 'claimed' THEN
        compute_status := 'failed';
        compute_reason := 'run is ' || run.phase;
    ELSIF run.backing_off THEN
        compute_status := 'retry_pending';
        compute_retry_not_before := run.retry_not_before;
    END IF;
    IF compute_status IS NOT NULL THEN
        RETURN NEXT;
        RETURN;
    END IF;

    -- A lease that holds no slot (it lapsed, or its run waited out a retry time, which
    -- has now passed), or may lapse before this stage commits (a claim could then fill
    -- its slot while the stage runs), is renewed only into a slot of the cap it takes
    -- and keeps locked to its commit (see stats_renew_lapsed_lease); with none free the
    -- run stays as it is, for a claim to take back.
    IF (run.ending OR run.retry_not_before IS NOT NULL)
       AND NOT stats_renew_lapsed_lease(p_run_id) THEN
        compute_status := 'failed';
        compute_reason := 'lease lapsed and no slot is free';
        RETURN NEXT;
        RETURN;
    END IF;

    -- The lease renewed at the stage boundary is written with the stage's outcome, in
    -- the one update of the run below (the run is locked until commit either way).
    v_renewed := run.attempts + CASE WHEN run.expired THEN 1 ELSE 0 END;
    IF v_renewed > run.max_attempts THEN
        -- Past the attempt cap: the run and its job fail; the job's range stays owed.
        UPDATE user_stats_projection_runs r
        SET phase = 'failed', payload = run.payload,
            lease_until = now() + make_interval(secs => run.lease_seconds),
            compute_ms = r.compute_ms
                + extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
            retry_not_before = NULL, attempts = v_renewed, error = 'attempts exhausted',
            finished_at = now()
        WHERE r.id = p_run_id;
        UPDATE user_exercise_stats_refresh_jobs j
        SET status = 'failed', error_message = 'attempts exhausted', updated_at = now(),
            completed_at = now()
        WHERE j.id = run.job_id;
        compute_status := 'failed';
        compute_reason := 'attempts exhausted';
        RETURN NEXT;
        RETURN;
    END IF;

    -- Candidates: exercises in scope the user has sets for, those in scope already
    -- projected (an exercise whose last set went away must disappear), and those named;
    -- and whether the user has any session (no session, no period rows).
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
            lease_until = now() + make_interval(secs => run.lease_seconds),
            compute_ms = r.compute_ms
                + extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
            retry_not_before = NULL, attempts = v_renewed, error = NULL, finished_at = NULL
        WHERE r.id = p_run_id;
        compute_status := 'batch_pending';
        compute_stage := 'batches';
        compute_next_offset := 0;
        compute_total := v_total;
        RETURN NEXT;
        RETURN;
    END IF;

    -- Per exercise: sessions, working sets, reps, volume, heaviest, best Epley estimate,
    -- first and last date; then per period from the period holding from_date.
    IF v_total > 0 THEN
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
    END IF;
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
    UPDATE user_stats_projection_runs r
    SET phase = 'computed',
        lease_until = now() + make_interval(secs => run.lease_seconds),
        payload = jsonb_build_object('manifest', jsonb_build_object(
            'exercises', to_jsonb(v_candidates), 'mode', 'single', 'batches', 1,
            'periods', v_periods)),
        compute_ms = r.compute_ms
            + extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
        retry_not_before = NULL, attempts = v_renewed, error = NULL, finished_at = NULL
    WHERE r.id = p_run_id;
    compute_status := 'computed';
    compute_total := v_total;
    RETURN NEXT;
END
$$;

REVOKE ALL ON FUNCTION
    stats_renew_lapsed_lease(bigint),
    stats_lease_slot_held_by_another(integer, bigint)
FROM PUBLIC;
