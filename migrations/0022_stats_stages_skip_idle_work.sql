-- The stage calls skip work that cannot change anything, and the claim can follow the
-- caller's previous run in the same round trip.
--
-- A worker's cycle for an account with little to do was dominated by fixed costs: each
-- statement of a stage pays its executor start-up, its locks and, for a write, every
-- index, constraint and trigger of its table, whether it finds rows or not; and each
-- plan was made again at every call, because the custom plans the plan cache keeps
-- choosing (the user filter is a parameter that may be null) look cheaper than the
-- generic one they equal. Now:
-- - every stage function plans once per session (force_generic_plan);
-- - the claim starts the oldest pending job in the statement that finds it, and takes
--   the owed range in one delete (the merge into the job only when there was one);
-- - the compute stage reads the settings with its run, writes no private output when
--   there are no candidates or no sessions, and its manifest counts the period rows;
-- - the publish stage locks the state row it will update (instead of writing it twice),
--   replaces per-exercise projections and deletes private outputs only when the
--   manifest says there are any, builds the PR window of a user with no facts as its
--   three empty headers, and finishes run and job in one statement;
-- - the claim takes p_after_run, the caller's previous run: it claims nothing while that
--   run is still claimed or computed, so a worker may send its next claim in the round
--   trip that computes and publishes the previous one and never holds two leases (a run
--   that stays open, in batches or backing off, keeps the worker's next claim for after
--   it).
-- Every check, lock and order of the stages is kept: the lease-slot turn, the count in
-- a fresh snapshot after it, resume before revive before start, the owed range taken in
-- a statement after the start, the run locked by id and token, the fence trigger, the
-- attempt cap, the publication lock, the generation and base checks, foreign keys
-- checked at once where projections are written, applied_version with the projections.

-- The value rules of the columns every stage writes are domains rather than table
-- CHECKs: a table CHECK is read from the catalog and planned again by every statement
-- that writes the table, whatever columns it sets (each stage's writes paid this for
-- the status, phase, attempt and version rules), while a domain's rule is kept
-- compiled and applies only where a value of it is written. The rules are unchanged.
-- Each column becomes its domain first without a rule (the same type underneath, so no
-- table is rewritten), then the domain takes the rule, which checks every stored value.
CREATE DOMAIN stats_job_status AS text;
CREATE DOMAIN stats_run_phase AS text;
CREATE DOMAIN stats_attempt_count AS integer;
CREATE DOMAIN stats_generation AS bigint;

-- The owed-range trigger's condition names the status column: it is dropped for the
-- type change and created again. Its condition, like a CHECK, is read and planned again
-- by every statement that updates a job's status, so it keeps only the new status; the
-- function checks the old one.
DROP TRIGGER user_exercise_stats_refresh_jobs_owe_failed ON user_exercise_stats_refresh_jobs;
ALTER TABLE user_exercise_stats_refresh_jobs
    ALTER COLUMN status TYPE stats_job_status,
    ALTER COLUMN attempts TYPE stats_attempt_count;
CREATE OR REPLACE FUNCTION stats_owe_failed_range() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF OLD.status IS DISTINCT FROM 'failed' THEN
        PERFORM stats_owe_range(NEW.user_id, NEW.from_date, NEW.exercise_ids, NEW.id);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER user_exercise_stats_refresh_jobs_owe_failed
    AFTER UPDATE OF status ON user_exercise_stats_refresh_jobs
    FOR EACH ROW
    WHEN (NEW.status = 'failed')
    EXECUTE FUNCTION stats_owe_failed_range();
ALTER TABLE user_stats_projection_runs ALTER COLUMN phase TYPE stats_run_phase;
ALTER TABLE user_stats_refresh_state
    ALTER COLUMN requested_version TYPE stats_generation,
    ALTER COLUMN applied_version TYPE stats_generation;

ALTER DOMAIN stats_job_status ADD CONSTRAINT stats_job_status_known
    CHECK (VALUE IN ('pending', 'processing', 'completed', 'failed'));
ALTER DOMAIN stats_run_phase ADD CONSTRAINT stats_run_phase_known
    CHECK (VALUE IN ('claimed', 'computed', 'published', 'failed', 'rejected'));
ALTER DOMAIN stats_attempt_count ADD CONSTRAINT stats_attempt_count_not_negative
    CHECK (VALUE >= 0);
ALTER DOMAIN stats_generation ADD CONSTRAINT stats_generation_not_negative
    CHECK (VALUE >= 0);
ALTER TABLE user_exercise_stats_refresh_jobs
    DROP CONSTRAINT user_exercise_stats_refresh_jobs_status_check,
    DROP CONSTRAINT user_exercise_stats_refresh_jobs_attempts_check;
ALTER TABLE user_stats_projection_runs DROP CONSTRAINT user_stats_projection_runs_phase_check;
ALTER TABLE user_stats_refresh_state
    DROP CONSTRAINT user_stats_refresh_state_requested_version_check,
    DROP CONSTRAINT user_stats_refresh_state_applied_version_check;

-- Lease slots: every active lease holds one of the cap's slots (numbered from 1), so
-- claims that fill different slots never wait for one another; they used to take one
-- turn, each holding it until its commit. The runs active now take the lowest slots.
ALTER TABLE user_stats_projection_runs ADD COLUMN lease_slot integer;
UPDATE user_stats_projection_runs r
SET lease_slot = numbered.slot
FROM (SELECT r2.id, row_number() OVER (ORDER BY r2.id) AS slot
      FROM user_stats_projection_runs r2
      WHERE r2.phase IN ('claimed', 'computed')
        AND stats_run_is_active(r2.phase, r2.lease_until, r2.retry_not_before)) AS numbered
WHERE r.id = numbered.id;

-- Is a slot held by an active lease? (Called in a statement of its own after the slot's
-- lock: its snapshot sees every lease committed into the slot.)
CREATE FUNCTION stats_lease_slot_held(p_slot integer) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT EXISTS (
        SELECT 1 FROM user_stats_projection_runs r
        WHERE r.phase IN ('claimed', 'computed')
          AND stats_run_is_active(r.phase, r.lease_until, r.retry_not_before)
          AND r.lease_slot = p_slot)
$$;

DROP FUNCTION stats_claim_stage(text, uuid, boolean);

CREATE FUNCTION stats_claim_stage(
    p_lock_owner text, p_user_id uuid, p_wait boolean, p_after_run bigint)
RETURNS TABLE (
    claim_run_id bigint, claim_job_id bigint, claim_user_id uuid, claim_lease_token uuid,
    claim_target_version bigint, claim_base_applied_version bigint, claim_from_date date,
    claim_exercise_ids text[])
LANGUAGE plpgsql
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    settings record;
    live record;
    candidate record;
    started record;
    owed record;
    v_job bigint;
    v_revived boolean;
    v_slot integer;
    tries integer := 0;
BEGIN
    SELECT st.paused, st.active_lease_cap, st.lease_seconds, st.max_attempts,
           coalesce(previous.phase IN ('claimed', 'computed'), false) AS after_open,
           previous.lease_slot AS after_slot
    INTO settings
    FROM stats_projection_worker_settings st
    LEFT JOIN user_stats_projection_runs previous ON previous.id = p_after_run
    WHERE st.id = 1;
    -- Paused, or the caller's previous run still holds its lease (no second one).
    IF settings.paused OR settings.after_open THEN
        RETURN;
    END IF;
    -- Every lease holds one of the cap's slots, numbered from 1. A claim locks the slot
    -- it means to fill until its commit; a claim taking another slot never waits for
    -- it. First the slot of the caller's previous run (free now that the run ended),
    -- else the lowest slot no other claim is taking.
    IF settings.after_slot BETWEEN 1 AND settings.active_lease_cap
       AND pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), settings.after_slot) THEN
        v_slot := settings.after_slot;
    ELSE
        FOR s IN 1 .. settings.active_lease_cap LOOP
            IF pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), s) THEN
                v_slot := s;
                EXIT;
            END IF;
        END LOOP;
    END IF;
    -- In a fresh snapshot taken after that lock: the active leases (read up to the cap:
    -- below it, all of them) and the slots they hold, and whether a run is due to resume or a dead worker's run
    -- waits to be revived (`now()` is this transaction's start, so what is due cannot
    -- change while the claim runs).
    SELECT leases.active, leases.held,
           EXISTS (SELECT 1 FROM user_stats_projection_runs r
                   WHERE r.phase IN ('claimed', 'computed')
                     AND (r.retry_not_before <= now()
                          OR (r.phase = 'claimed' AND r.retry_not_before IS NULL
                              AND r.payload ? '_batch' AND r.lease_until <= now()))
                     AND (p_user_id IS NULL OR r.user_id = p_user_id)) AS resumable,
           EXISTS (SELECT 1 FROM user_stats_projection_runs r
                   WHERE r.phase IN ('claimed', 'computed') AND r.lease_until <= now()
                     AND r.retry_not_before IS NULL
                     AND NOT (r.phase = 'claimed' AND r.payload ? '_batch')
                     AND (p_user_id IS NULL OR r.user_id = p_user_id)) AS dead
    INTO live
    FROM (SELECT count(*) AS active, coalesce(array_agg(a.lease_slot), '{}') AS held
          FROM (SELECT r.lease_slot FROM user_stats_projection_runs r
                WHERE r.phase IN ('claimed', 'computed')
                  AND stats_run_is_active(r.phase, r.lease_until, r.retry_not_before)
                LIMIT settings.active_lease_cap) AS a) AS leases;
    IF live.active >= settings.active_lease_cap THEN
        RETURN;
    END IF;
    IF v_slot IS NULL OR v_slot = ANY (live.held) THEN
        -- The slot locked first is held by a lease: the lowest free one no other claim
        -- is taking, confirmed free in a snapshot after its lock (a claim that filled it
        -- since committed while holding that lock).
        v_slot := NULL;
        FOR s IN 1 .. settings.active_lease_cap LOOP
            CONTINUE WHEN s = ANY (live.held)
                OR NOT pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), s);
            IF NOT stats_lease_slot_held(s) THEN
                v_slot := s;
                EXIT;
            END IF;
        END LOOP;
    END IF;
    IF v_slot IS NULL THEN
        -- Every free slot is being taken by another claim right now: wait for the lowest
        -- (within the claim budget; without waiting, nothing is claimed).
        IF NOT p_wait THEN
            RETURN;
        END IF;
        SELECT min(s) INTO v_slot
        FROM generate_series(1, settings.active_lease_cap) AS s
        WHERE s <> ALL (live.held);
        IF v_slot IS NULL THEN
            RETURN;
        END IF;
        BEGIN
            PERFORM pg_advisory_xact_lock(hashtext('stats_lease_slots'), v_slot);
        EXCEPTION WHEN query_canceled OR deadlock_detected THEN
            RETURN;  -- the slot did not come free within the claim budget
        END;
        IF stats_lease_slot_held(v_slot) THEN
            RETURN;
        END IF;
    END IF;

    IF live.resumable THEN
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
                lock_owner = p_lock_owner, lease_slot = v_slot
            WHERE r.id = candidate.id
            RETURNING r.id, r.job_id, r.user_id, r.lease_token, r.target_version,
                      r.base_applied_version, r.from_date, r.exercise_ids;
            RETURN;
        END IF;
    END IF;

    WHILE tries < 5 LOOP
        tries := tries + 1;
        v_revived := false;
        IF live.dead THEN
            -- A dead worker's job (its run retired, never adopted).
            SELECT r.id, r.job_id INTO candidate
            FROM user_stats_projection_runs r
            WHERE r.phase IN ('claimed', 'computed') AND r.lease_until <= now()
              AND r.retry_not_before IS NULL
              AND NOT (r.phase = 'claimed' AND r.payload ? '_batch')
              AND (p_user_id IS NULL OR r.user_id = p_user_id)
            ORDER BY r.lease_until
            LIMIT 1
            FOR UPDATE SKIP LOCKED;
            v_revived := FOUND;
        END IF;
        IF v_revived THEN
            DELETE FROM stats_output_exercise o WHERE o.run_id = candidate.id;
            DELETE FROM stats_output_period o WHERE o.run_id = candidate.id;
            UPDATE user_stats_projection_runs r
            SET phase = 'failed', error = 'lease expired', finished_at = now()
            WHERE r.id = candidate.id;
            UPDATE user_exercise_stats_refresh_jobs j
            SET status = 'processing', locked_at = now(), lock_owner = p_lock_owner,
                attempts = j.attempts + 1, updated_at = now()
            WHERE j.id = candidate.job_id
            RETURNING j.id, j.user_id, j.from_date, j.exercise_ids, j.requested_version,
                      j.attempts
            INTO started;
        ELSE
            -- The oldest pending job of a user with no live job, started in the
            -- statement that finds it.
            UPDATE user_exercise_stats_refresh_jobs j
            SET status = 'processing', locked_at = now(), lock_owner = p_lock_owner,
                attempts = j.attempts + 1, updated_at = now()
            WHERE j.id = (
                SELECT p.id
                FROM user_exercise_stats_refresh_jobs p
                WHERE p.status = 'pending'
                  AND (p_user_id IS NULL OR p.user_id = p_user_id)
                  AND NOT EXISTS (
                      SELECT 1 FROM user_exercise_stats_refresh_jobs q
                      WHERE q.user_id = p.user_id AND q.status = 'processing')
                ORDER BY p.created_at, p.id
                LIMIT 1
                FOR UPDATE SKIP LOCKED)
            RETURNING j.id, j.user_id, j.from_date, j.exercise_ids, j.requested_version,
                      j.attempts
            INTO started;
            IF NOT FOUND THEN
                RETURN;
            END IF;
        END IF;
        v_job := started.id;
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
        DELETE FROM user_stats_owed_ranges o WHERE o.user_id = started.user_id
        RETURNING o.from_date, o.exercise_ids, o.failed_job_ids INTO owed;
        IF FOUND THEN
            UPDATE user_exercise_stats_refresh_jobs j
            SET from_date = stats_merge_from_date(j.from_date, owed.from_date),
                exercise_ids = stats_merge_exercise_ids(j.exercise_ids, owed.exercise_ids),
                metadata = j.metadata || jsonb_build_object(
                    'absorbed_failed_jobs',
                    coalesce(j.metadata -> 'absorbed_failed_jobs', '[]')
                        || to_jsonb(owed.failed_job_ids)),
                updated_at = now()
            WHERE j.id = v_job
            RETURNING j.from_date, j.exercise_ids INTO started.from_date, started.exercise_ids;
        END IF;

        RETURN QUERY
        INSERT INTO user_stats_projection_runs AS r
            (job_id, user_id, phase, lease_token, lease_until, lock_owner, target_version,
             base_applied_version, from_date, exercise_ids, attempts, lease_slot)
        VALUES (v_job, started.user_id, 'claimed', gen_random_uuid(),
                now() + make_interval(secs => settings.lease_seconds), p_lock_owner,
                started.requested_version,
                coalesce((SELECT s.applied_version FROM user_stats_refresh_state s
                          WHERE s.user_id = started.user_id), 0),
                started.from_date, started.exercise_ids, started.attempts, v_slot)
        RETURNING r.id, r.job_id, r.user_id, r.lease_token, r.target_version,
                  r.base_applied_version, r.from_date, r.exercise_ids;
        RETURN;
    END LOOP;
    RETURN;
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

CREATE OR REPLACE FUNCTION stats_publish_stage(p_run_id bigint, p_lease_token uuid)
RETURNS TABLE (publish_status text, publish_applied_version bigint, publish_reason text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    run record;
    v_state record;
    v_successor bigint;
    v_applied bigint;
    v_exercises text[];
    v_periods boolean;
    v_windowed integer;
BEGIN
    SELECT r.id, r.job_id, r.user_id, r.target_version, r.base_applied_version,
           r.from_date, r.payload
    INTO run
    FROM user_stats_projection_runs r
    WHERE r.id = p_run_id AND r.lease_token = p_lease_token
      AND r.phase = 'computed' AND r.lease_until > now()
    FOR UPDATE;
    IF NOT FOUND THEN
        publish_status := 'lease_lost';
        RETURN NEXT;
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('stats_publish:' || run.user_id::text, 0));

    -- Public projections and applied_version change together: applied_version moves to
    -- the run's generation when it is newer than the applied one and the published base
    -- has not moved (the state row stays locked to the end).
    UPDATE user_stats_refresh_state s
    SET applied_version = run.target_version, updated_at = now()
    WHERE s.user_id = run.user_id
      AND s.applied_version = run.base_applied_version
      AND s.applied_version < run.target_version
    RETURNING s.applied_version INTO v_applied;
    IF NOT FOUND THEN
        -- The state row, created when the user has none, then why the run cannot publish.
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
            -- Not published: the run ends and the successor absorbs the job's range.
            DELETE FROM stats_output_exercise o WHERE o.run_id = p_run_id;
            DELETE FROM stats_output_period o WHERE o.run_id = p_run_id;
            UPDATE user_stats_projection_runs r
            SET phase = 'rejected', error = publish_reason, finished_at = now()
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
                error_message = 'superseded: ' || publish_reason,
                metadata = j.metadata || jsonb_build_object('superseded_by', v_successor)
            WHERE j.id = run.job_id;
            publish_status := 'rejected';
            RETURN NEXT;
            RETURN;
        END IF;
        -- A state row created just now (applied 0, the run's base).
        UPDATE user_stats_refresh_state s
        SET applied_version = greatest(s.applied_version, run.target_version),
            updated_at = now()
        WHERE s.user_id = run.user_id
        RETURNING s.applied_version INTO v_applied;
    END IF;

    -- The manifest's exercises, and whether the run has private period rows (a manifest
    -- that does not count them may have some).
    v_periods := coalesce((run.payload -> 'manifest' ->> 'periods')::bigint, 1) > 0;
    IF jsonb_array_length(run.payload -> 'manifest' -> 'exercises') > 0 THEN
        v_exercises := ARRAY(
            SELECT jsonb_array_elements_text(run.payload -> 'manifest' -> 'exercises'));
        SET CONSTRAINTS ALL IMMEDIATE;
        DELETE FROM user_exercise_stats e
        WHERE e.user_id = run.user_id AND e.exercise_id = ANY (v_exercises);
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
        DELETE FROM stats_output_exercise o WHERE o.run_id = p_run_id;
    END IF;
    DELETE FROM user_training_period_stats p
    WHERE p.user_id = run.user_id
      AND (run.from_date IS NULL
           OR p.period_start >= date_trunc(p.period, run.from_date)::date);
    IF v_periods THEN
        INSERT INTO user_training_period_stats
            (user_id, period, period_start, sessions, working_sets, reps, volume, generation)
        SELECT run.user_id, o.period, o.period_start, o.sessions, o.working_sets, o.reps,
               o.volume, run.target_version
        FROM stats_output_period o
        WHERE o.run_id = p_run_id
        ON CONFLICT (user_id, period, period_start) DO UPDATE
        SET sessions = EXCLUDED.sessions, working_sets = EXCLUDED.working_sets,
            reps = EXCLUDED.reps, volume = EXCLUDED.volume, generation = EXCLUDED.generation;
        DELETE FROM stats_output_period o WHERE o.run_id = p_run_id;
    END IF;

    -- The generation's PR overview window (database date -1, 0 and +1), built whole,
    -- replacing the older generations' windows; applied_version itself is its
    -- publication fence. A user with no facts has three headers counting no exercise
    -- and no summary; otherwise the headers count and the summaries hold the facts up
    -- to each date.
    WITH older AS (
        DELETE FROM user_pr_overview_snapshot_headers h
        WHERE h.user_id = run.user_id AND h.generation <= run.target_version
    )
    INSERT INTO user_pr_overview_snapshot_headers
        (user_id, generation, as_of_date, catalog_epoch, exercise_count)
    SELECT run.user_id, run.target_version, (stats_clock_date() + d)::date,
           (SELECT c.catalog_epoch FROM pr_overview_projection_control c WHERE c.id = 1), 0
    FROM generate_series(-1, 1) AS d
    WHERE NOT EXISTS (SELECT 1 FROM training_sessions s WHERE s.user_id = run.user_id)
      AND NOT EXISTS (SELECT 1 FROM user_manual_pr_records m WHERE m.user_id = run.user_id);
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
    END IF;
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

    WITH finished AS (
        UPDATE user_stats_projection_runs r
        SET phase = 'published',
            publish_ms = extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000,
            finished_at = now()
        WHERE r.id = p_run_id
    )
    UPDATE user_exercise_stats_refresh_jobs j
    SET status = 'completed', completed_at = now(), updated_at = now(), error_message = NULL
    WHERE j.id = run.job_id;
    publish_status := 'published';
    publish_applied_version := v_applied;
    RETURN NEXT;
END
$$;

REVOKE ALL ON FUNCTION
    stats_claim_stage(text, uuid, boolean, bigint),
    stats_lease_slot_held(integer)
FROM PUBLIC;
