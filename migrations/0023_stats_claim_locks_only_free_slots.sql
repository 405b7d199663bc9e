-- A claim locks no lease slot it can see is held, and a lease outside the slots (the
-- cap lowered under it) cannot let claims pass the cap.
--
-- Every active lease holds a distinct slot numbered 1 to the cap, which bounds the
-- leases by the cap while claims filling different slots run at once. Two gaps:
-- - a claim try-locked the lowest unlocked slot before reading which slots leases
--   hold, so it kept (to its commit) the lock of a slot a live lease held; a scoped
--   claim held uncommitted through its compute then kept that lease's worker from
--   taking its own slot back when the lease ended. The slots active leases hold are now
--   read with the settings, before any lock, and the claim locks only slots it sees
--   free (still confirmed free in a snapshot after the lock);
-- - a lease whose slot is above the cap (the cap was lowered under it) holds none of
--   the slots claims lock, so claims filling each free slot could together pass the
--   cap. A claim that sees such a lease now takes every slot before it counts again.
-- And a transaction carries one owner: a claim that fails a job past the attempt cap
-- no longer goes on to start another user's job in the same transaction (with claims
-- running side by side, two such claims could wait on each other's users); it answers
-- the failed job alone (no run), and the caller claims again.

CREATE OR REPLACE FUNCTION stats_claim_stage(
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
    recount record;
    candidate record;
    started record;
    owed record;
    v_job bigint;
    v_revived boolean;
    v_slot integer;
BEGIN
    -- The settings, the caller's previous run, and the slots active leases hold now (read
    -- before any slot is locked, so that no claim locks a slot it can see is held).
    SELECT st.paused, st.active_lease_cap, st.lease_seconds, st.max_attempts,
           coalesce(previous.phase IN ('claimed', 'computed'), false) AS after_open,
           previous.lease_slot AS after_slot,
           ARRAY(SELECT r.lease_slot FROM user_stats_projection_runs r
                 WHERE r.phase IN ('claimed', 'computed')
                   AND stats_run_is_active(r.phase, r.lease_until, r.retry_not_before)
                   AND r.lease_slot IS NOT NULL) AS held
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
    -- it. First the slot of the caller's previous run, else the lowest slot no lease
    -- holds and no other claim is taking.
    IF settings.after_slot BETWEEN 1 AND settings.active_lease_cap
       AND settings.after_slot <> ALL (settings.held)
       AND pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), settings.after_slot) THEN
        v_slot := settings.after_slot;
    ELSE
        FOR s IN 1 .. settings.active_lease_cap LOOP
            CONTINUE WHEN s = ANY (settings.held);
            IF pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), s) THEN
                v_slot := s;
                EXIT;
            END IF;
        END LOOP;
    END IF;
    -- In a fresh snapshot taken after that lock: the active leases (read up to the cap:
    -- below it, all of them) and the slots they hold, whether one of them holds no slot
    -- of the cap (the cap was lowered under it), and whether a run is due to resume or a
    -- dead worker's run waits to be revived (`now()` is this transaction's start, so what
    -- is due cannot change while the claim runs).
    SELECT leases.active, leases.held,
           EXISTS (SELECT 1 FROM unnest(leases.held) AS h (slot)
                   WHERE h.slot IS NULL
                      OR h.slot NOT BETWEEN 1 AND settings.active_lease_cap) AS unslotted,
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
    IF live.unslotted THEN
        -- An active lease outside the slots: distinct slots no longer bound the count, so
        -- this claim takes every slot (no other claim can fill one meanwhile), counts
        -- again in a snapshot after that, and fills the lowest slot no lease holds.
        FOR s IN 1 .. settings.active_lease_cap LOOP
            IF NOT pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), s) THEN
                IF NOT p_wait THEN
                    RETURN;
                END IF;
                BEGIN
                    PERFORM pg_advisory_xact_lock(hashtext('stats_lease_slots'), s);
                EXCEPTION WHEN query_canceled OR deadlock_detected THEN
                    RETURN;  -- not every slot came free within the claim budget
                END;
            END IF;
        END LOOP;
        SELECT count(*) AS active, coalesce(array_agg(a.lease_slot), '{}') AS held
        INTO recount
        FROM (SELECT r.lease_slot FROM user_stats_projection_runs r
              WHERE r.phase IN ('claimed', 'computed')
                AND stats_run_is_active(r.phase, r.lease_until, r.retry_not_before)
              LIMIT settings.active_lease_cap) AS a;
        IF recount.active >= settings.active_lease_cap THEN
            RETURN;
        END IF;
        SELECT min(s) INTO v_slot
        FROM generate_series(1, settings.active_lease_cap) AS s
        WHERE s <> ALL (array_remove(recount.held, NULL));
    ELSIF v_slot IS NULL OR v_slot = ANY (live.held) THEN
        -- The slot locked first was filled meanwhile (or none could be locked): the
        -- lowest free one no other claim is taking, confirmed free in a snapshot after
        -- its lock (a claim that filled it since committed while holding that lock).
        v_slot := NULL;
        FOR s IN 1 .. settings.active_lease_cap LOOP
            CONTINUE WHEN s = ANY (live.held)
                OR NOT pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), s);
            IF NOT stats_lease_slot_held(s) THEN
                v_slot := s;
                EXIT;
            END IF;
        END LOOP;
        IF v_slot IS NULL THEN
            -- Every free slot is being taken by another claim right now: wait for the
            -- lowest (within the claim budget; without waiting, nothing is claimed).
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
        -- Exhausted: the job fails and the database owes its range (trigger). The
        -- claim ends here, answering the job alone, so that its transaction carries one
        -- owner; the caller claims again.
        UPDATE user_exercise_stats_refresh_jobs j
        SET status = 'failed', error_message = 'attempts exhausted', updated_at = now(),
            completed_at = now()
        WHERE j.id = v_job;
        claim_job_id := v_job;
        claim_user_id := started.user_id;
        RETURN NEXT;
        RETURN;
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
END
$$;
