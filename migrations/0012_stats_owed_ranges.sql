-- Training stats worker: a range that was not published stays owed, one live job per
-- user, one definition of an active lease, a pause switch, exact Epley, a session with
-- no sets dirties no exercise, and the application role fails closed without a caller.

-- Range merge rules, one definition for the queue, owed ranges and claims. Dates: the
-- earlier wins, NULL (full history) absorbs. Exercise ids: '{}' (every exercise)
-- absorbs, NULL (no exercise: the period stats only) is the identity, else the union.
CREATE FUNCTION stats_merge_from_date(p_a date, p_b date) RETURNS date
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN p_a IS NULL OR p_b IS NULL THEN NULL ELSE least(p_a, p_b) END
$$;

CREATE FUNCTION stats_merge_exercise_ids(p_a text[], p_b text[]) RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN p_a IS NULL THEN p_b
                WHEN p_b IS NULL THEN p_a
                WHEN cardinality(p_a) = 0 OR cardinality(p_b) = 0 THEN '{}'::text[]
                ELSE (SELECT array_agg(DISTINCT e ORDER BY e) FROM unnest(p_a || p_b) AS e)
           END
$$;

-- NULL exercise_ids: a write that touched no exercise (a session without sets) still
-- dirties the period stats from its date.
ALTER TABLE user_exercise_stats_refresh_jobs ALTER COLUMN exercise_ids DROP NOT NULL;
ALTER TABLE user_stats_projection_runs ALTER COLUMN exercise_ids DROP NOT NULL;

-- The range of every job that failed without publishing, merged per user, until the
-- next claim of that user takes it into its own range. While a row exists the user's
-- stats are stale, whatever the versions say.
CREATE TABLE user_stats_owed_ranges (
    user_id uuid PRIMARY KEY,
    from_date date,                        -- NULL: full history
    exercise_ids text[],                   -- '{}': every exercise; NULL: none
    failed_job_ids bigint[] NOT NULL DEFAULT '{}',
    owed_since timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Owe one failed job's range: merged into the user's owed row with the queue's rules.
CREATE FUNCTION stats_owe_range(
    p_user_id uuid, p_from_date date, p_exercise_ids text[], p_job_id bigint
) RETURNS void
LANGUAGE sql
AS $$
    INSERT INTO user_stats_owed_ranges AS o (user_id, from_date, exercise_ids, failed_job_ids)
    VALUES (p_user_id, p_from_date, p_exercise_ids, ARRAY[p_job_id])
    ON CONFLICT (user_id) DO UPDATE
    SET from_date = stats_merge_from_date(o.from_date, EXCLUDED.from_date),
        exercise_ids = stats_merge_exercise_ids(o.exercise_ids, EXCLUDED.exercise_ids),
        failed_job_ids = o.failed_job_ids || EXCLUDED.failed_job_ids,
        updated_at = now()
$$;

-- Every path that fails a job (attempts exhausted in claim, compute or publish, an
-- operator's UPDATE) owes its range: nothing a failed job held is dropped.
CREATE FUNCTION stats_owe_failed_range() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM stats_owe_range(NEW.user_id, NEW.from_date, NEW.exercise_ids, NEW.id);
    RETURN NULL;
END
$$;
CREATE TRIGGER user_exercise_stats_refresh_jobs_owe_failed
    AFTER UPDATE OF status ON user_exercise_stats_refresh_jobs
    FOR EACH ROW
    WHEN (NEW.status = 'failed' AND OLD.status IS DISTINCT FROM 'failed')
    EXECUTE FUNCTION stats_owe_failed_range();

-- An existing database: the jobs that failed before this migration may have lost their
-- range (a later publication moved applied_version past it), so each one is owed once
-- more; recomputing a range that was in fact published costs one compute and changes
-- nothing.
SELECT stats_owe_range(user_id, from_date, exercise_ids, id)
FROM user_exercise_stats_refresh_jobs
WHERE status = 'failed'
ORDER BY id;

-- One live (processing) job per user: two live jobs could publish generations out of
-- order. Where an existing database holds two, the newest stays live and the others
-- fail, owing their ranges (the trigger above), so nothing they held is dropped.
UPDATE user_exercise_stats_refresh_jobs AS j
SET status = 'failed',
    error_message = 'another live job of this user was newer when one live job per user'
        ' became a rule; its range is owed to the next job',
    updated_at = now()
WHERE j.status = 'processing'
  AND EXISTS (SELECT 1 FROM user_exercise_stats_refresh_jobs AS n
              WHERE n.user_id = j.user_id AND n.status = 'processing' AND n.id > j.id);
CREATE UNIQUE INDEX stats_jobs_one_live_per_user
    ON user_exercise_stats_refresh_jobs (user_id) WHERE status = 'processing';

-- Merge-enqueue with the shared merge rules (NULL exercise ids: no exercise).
CREATE OR REPLACE FUNCTION enqueue_user_exercise_stats_refresh_job(
    p_user_id uuid,
    p_event_type text,
    p_from_date date,
    p_exercise_ids text[],
    p_reason text,
    p_source_ref text,
    p_requested_version bigint
) RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_job user_exercise_stats_refresh_jobs%ROWTYPE;
    v_ids text[] := CASE WHEN p_exercise_ids IS NULL THEN NULL ELSE coalesce(
        (SELECT array_agg(DISTINCT e ORDER BY e) FROM unnest(p_exercise_ids) AS e), '{}') END;
    v_reason text := coalesce(p_reason, '');
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('stats_enqueue:' || p_user_id::text, 0));
    SELECT * INTO v_job
    FROM user_exercise_stats_refresh_jobs
    WHERE user_id = p_user_id AND status = 'pending'
    ORDER BY id
    LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        UPDATE user_exercise_stats_refresh_jobs
        SET from_date = stats_merge_from_date(from_date, p_from_date),
            exercise_ids = stats_merge_exercise_ids(exercise_ids, v_ids),
            reason = CASE WHEN v_reason = '' OR position(v_reason IN reason) > 0 THEN reason
                          WHEN reason = '' THEN v_reason
                          ELSE reason || '; ' || v_reason END,
            requested_version = greatest(requested_version, p_requested_version),
            metadata = metadata || jsonb_build_object(
                'latest_event_type', p_event_type,
                'latest_source_ref', p_source_ref,
                'last_enqueued_at', now(),
                'merge_count', coalesce((metadata ->> 'merge_count')::integer, 0) + 1),
            updated_at = now()
        WHERE id = v_job.id;
        RETURN v_job.id;
    END IF;
    INSERT INTO user_exercise_stats_refresh_jobs
        (user_id, event_type, from_date, exercise_ids, reason, source_ref, requested_version,
         metadata)
    VALUES (p_user_id, p_event_type, p_from_date, v_ids, v_reason, p_source_ref,
            p_requested_version,
            jsonb_build_object('latest_event_type', p_event_type,
                               'latest_source_ref', p_source_ref,
                               'last_enqueued_at', now(),
                               'merge_count', 0))
    RETURNING id INTO v_job.id;
    RETURN v_job.id;
END
$$;

-- Pause switch of the runbook: while set, no claim starts (work in flight finishes;
-- pending jobs and resumable runs wait).
ALTER TABLE stats_projection_worker_settings
    ADD COLUMN paused boolean NOT NULL DEFAULT false;

-- What "active" means, for the claim's lease cap and the status function alike: a run
-- being worked on under a live lease. A run waiting out its retry time is not active
-- (it neither holds a slot nor starves other users).
CREATE FUNCTION stats_run_is_active(
    p_phase text, p_lease_until timestamptz, p_retry_not_before timestamptz
) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT p_phase IN ('claimed', 'computed') AND p_lease_until > now()
           AND p_retry_not_before IS NULL
$$;

-- The caller is the application role (or a member of it), not a trusted service.
CREATE FUNCTION stats_caller_is_application() RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_roles r
        WHERE r.rolname = CASE WHEN current_setting('role') = 'none' THEN session_user::text
                               ELSE current_setting('role') END
          AND NOT r.rolsuper
          AND pg_has_role(r.oid, 'inventory_app', 'MEMBER')
    )
$$;

-- Owner check of every application entry point. The application role must name its
-- caller (inventory.current_user_id); without it, it is refused, never trusted.
CREATE OR REPLACE FUNCTION stats_check_owner(p_expected_user_id uuid, p_actual_user_id uuid)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_expected_user_id IS NULL THEN
        RAISE EXCEPTION 'expected owner is required' USING ERRCODE = '42501';
    END IF;
    IF stats_current_user_id() IS NULL AND stats_caller_is_application() THEN
        RAISE EXCEPTION 'the application must set inventory.current_user_id'
            USING ERRCODE = '42501';
    END IF;
    IF stats_current_user_id() IS NOT NULL AND stats_current_user_id() <> p_expected_user_id THEN
        RAISE EXCEPTION 'expected owner is not the caller' USING ERRCODE = '42501';
    END IF;
    IF p_actual_user_id IS DISTINCT FROM p_expected_user_id THEN
        RAISE EXCEPTION 'session owner does not match the expected owner' USING ERRCODE = '42501';
    END IF;
END
$$;

-- Epley, exactly: weight × (30 + reps) / 30 for 2-12 reps, rounded once to 0.01 kg.
CREATE OR REPLACE FUNCTION estimated_one_rep_max(p_weight numeric, p_reps integer)
RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_reps = 1 THEN p_weight
        WHEN p_reps BETWEEN 2 AND 12 THEN round(p_weight * (30 + p_reps) / 30, 2)
    END
$$;

-- A manual PR of a personal exercise only for its owner (as the session save).
CREATE OR REPLACE FUNCTION save_manual_pr(
    p_expected_user_id uuid, p_exercise_id text, p_weight_kg numeric, p_reps integer,
    p_recorded_on date
) RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
DECLARE
    v_id bigint;
    v_version bigint;
    v_job bigint;
BEGIN
    PERFORM stats_check_owner(p_expected_user_id, p_expected_user_id);
    IF EXISTS (
        SELECT 1 FROM exercises e
        WHERE e.id = p_exercise_id AND e.owner_user_id IS NOT NULL
          AND e.owner_user_id <> p_expected_user_id
    ) THEN
        RAISE EXCEPTION 'a personal exercise of another user' USING ERRCODE = '42501';
    END IF;
    INSERT INTO user_manual_pr_records (user_id, exercise_id, weight_kg, reps, recorded_on)
    VALUES (p_expected_user_id, p_exercise_id, p_weight_kg, p_reps, p_recorded_on)
    RETURNING id INTO v_id;
    v_version := bump_stats_requested_version(p_expected_user_id);
    v_job := enqueue_user_exercise_stats_refresh_job(
        p_expected_user_id, 'manual_pr_changed', p_recorded_on, ARRAY[p_exercise_id],
        'manual PR saved', 'manual_pr:' || v_id, v_version);
    RETURN jsonb_build_object('record_id', v_id, 'requested_version', v_version, 'job_id', v_job);
END
$$;

-- Save one completed session (unchanged but for the dirty range of a session without
-- sets, old or new: its date and no exercise, never every exercise).
CREATE OR REPLACE FUNCTION save_training_session(p_expected_user_id uuid, p_session jsonb)
RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
DECLARE
    v_id uuid := coalesce((p_session ->> 'id')::uuid, gen_random_uuid());
    v_user uuid := (p_session ->> 'user_id')::uuid;
    v_date date := (p_session ->> 'session_date')::date;
    v_old training_sessions%ROWTYPE;
    v_old_exercises text[] := '{}';
    v_new_exercises text[];
    v_dirty text[];
    v_from date;
    v_version bigint;
    v_job bigint;
    v_receipt bigint;
BEGIN
    PERFORM stats_check_owner(p_expected_user_id, v_user);
    IF v_date IS NULL THEN
        RAISE EXCEPTION 'session_date is required' USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(coalesce(p_session -> 'sets', '[]')) <> 'array' THEN
        RAISE EXCEPTION 'sets must be an array' USING ERRCODE = '22023';
    END IF;
    SELECT * INTO v_old FROM training_sessions WHERE id = v_id FOR UPDATE;
    IF FOUND THEN
        PERFORM stats_check_owner(p_expected_user_id, v_old.user_id);
        v_old_exercises := ARRAY(
            SELECT DISTINCT exercise_id FROM training_sets WHERE session_id = v_id);
    END IF;
    IF EXISTS (
        SELECT 1
        FROM jsonb_to_recordset(coalesce(p_session -> 'sets', '[]')) AS s (exercise_id text)
        JOIN exercises e ON e.id = s.exercise_id
        WHERE e.owner_user_id IS NOT NULL AND e.owner_user_id <> v_user
    ) THEN
        RAISE EXCEPTION 'a personal exercise of another user' USING ERRCODE = '42501';
    END IF;
    INSERT INTO training_sessions (id, user_id, session_date, notes)
    VALUES (v_id, v_user, v_date, p_session ->> 'notes')
    ON CONFLICT (id) DO UPDATE
    SET session_date = EXCLUDED.session_date, notes = EXCLUDED.notes, updated_at = now();
    DELETE FROM training_sets WHERE session_id = v_id;
    INSERT INTO training_sets (session_id, position, exercise_id, weight_kg, reps, warmup)
    SELECT v_id, s.ordinality, s.exercise_id, s.weight_kg, s.reps, coalesce(s.warmup, false)
    FROM ROWS FROM (jsonb_to_recordset(coalesce(p_session -> 'sets', '[]'))
             AS (exercise_id text, weight_kg numeric, reps integer, warmup boolean))
         WITH ORDINALITY AS s (exercise_id, weight_kg, reps, warmup, ordinality);
    v_new_exercises := ARRAY(SELECT DISTINCT exercise_id FROM training_sets WHERE session_id = v_id);
    v_dirty := nullif(v_old_exercises || v_new_exercises, '{}');
    v_from := CASE WHEN v_old.id IS NULL THEN v_date ELSE least(v_old.session_date, v_date) END;
    v_version := bump_stats_requested_version(v_user);
    v_job := enqueue_user_exercise_stats_refresh_job(
        v_user, 'session_saved', v_from, v_dirty,
        CASE WHEN v_old.id IS NULL THEN 'session created' ELSE 'session updated' END,
        'session:' || v_id, v_version);
    INSERT INTO stats_mutation_receipts (user_id, session_id, operation, requested_version)
    VALUES (v_user, v_id, 'save', v_version)
    RETURNING id INTO v_receipt;
    RETURN jsonb_build_object('session_id', v_id, 'requested_version', v_version,
                              'receipt_id', v_receipt, 'job_id', v_job);
END
$$;

-- Delete one completed session (a session without sets dirties no exercise).
CREATE OR REPLACE FUNCTION delete_training_session(p_expected_user_id uuid, p_session_id uuid)
RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
DECLARE
    v_old training_sessions%ROWTYPE;
    v_exercises text[];
    v_version bigint;
    v_job bigint;
    v_receipt bigint;
BEGIN
    IF p_expected_user_id IS NULL THEN
        RAISE EXCEPTION 'expected owner is required' USING ERRCODE = '42501';
    END IF;
    SELECT * INTO v_old FROM training_sessions WHERE id = p_session_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no such session' USING ERRCODE = 'P0002';
    END IF;
    PERFORM stats_check_owner(p_expected_user_id, v_old.user_id);
    v_exercises := nullif(
        ARRAY(SELECT DISTINCT exercise_id FROM training_sets WHERE session_id = p_session_id),
        '{}');
    DELETE FROM training_sessions WHERE id = p_session_id;
    v_version := bump_stats_requested_version(v_old.user_id);
    v_job := enqueue_user_exercise_stats_refresh_job(
        v_old.user_id, 'session_deleted', v_old.session_date, v_exercises, 'session deleted',
        'session:' || p_session_id, v_version);
    INSERT INTO stats_mutation_receipts (user_id, session_id, operation, requested_version)
    VALUES (v_old.user_id, p_session_id, 'delete', v_version)
    RETURNING id INTO v_receipt;
    RETURN jsonb_build_object('session_id', p_session_id, 'requested_version', v_version,
                              'receipt_id', v_receipt, 'job_id', v_job);
END
$$;

-- A user's stats are current only when the applied generation is the requested one and
-- no range is owed.
CREATE FUNCTION stats_user_is_stale(p_user_id uuid) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT coalesce((SELECT requested_version > applied_version
                     FROM user_stats_refresh_state WHERE user_id = p_user_id), false)
        OR EXISTS (SELECT 1 FROM user_stats_owed_ranges WHERE user_id = p_user_id)
$$;

-- The fail-closed PR overview reader, now saying whether the generation it serves is
-- stale (a newer generation requested, or a range owed).
DROP FUNCTION get_pr_overview(uuid, date);
CREATE FUNCTION get_pr_overview(p_user_id uuid, p_as_of date)
RETURNS TABLE (
    exercise_id text,
    best_e1rm_all_time numeric,
    best_e1rm_30d numeric,
    best_e1rm_30d_prior_year numeric,
    heaviest_kg numeric,
    stale boolean
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
DECLARE
    v_generation bigint;
    v_stale boolean;
BEGIN
    PERFORM stats_check_owner(p_user_id, p_user_id);
    SELECT applied_version INTO v_generation
    FROM user_stats_refresh_state WHERE user_id = p_user_id;
    IF v_generation IS NULL OR NOT EXISTS (
        SELECT 1 FROM user_pr_overview_snapshot_headers h
        WHERE h.user_id = p_user_id AND h.generation = v_generation AND h.as_of_date = p_as_of
    ) THEN
        RAISE EXCEPTION 'no PR overview snapshot for % in the applied generation', p_as_of
            USING ERRCODE = '55000';
    END IF;
    v_stale := stats_user_is_stale(p_user_id);
    RETURN QUERY
    SELECT s.exercise_id, s.best_e1rm_all_time, s.best_e1rm_30d, s.best_e1rm_30d_prior_year,
           s.heaviest_kg, v_stale
    FROM user_pr_exercise_summary_snapshots s
    WHERE s.user_id = p_user_id AND s.generation = v_generation AND s.as_of_date = p_as_of
    ORDER BY s.exercise_id;
END
$$;

-- Worker status: active leases by the shared definition, every exhausted failure
-- (compute and publish failures included: a failed job exhausted its attempts), owed
-- ranges and stale users, and the pause switch in the settings.
CREATE OR REPLACE FUNCTION stats_projection_worker_status() RETURNS jsonb
LANGUAGE sql STABLE
AS $$
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
        'attempt_exhausted_failures', (SELECT count(*) FROM user_exercise_stats_refresh_jobs
                                       WHERE status = 'failed'
                                         AND NOT metadata ? 'retried_by'),
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
$$;

REVOKE ALL ON FUNCTION
    stats_merge_from_date(date, date),
    stats_merge_exercise_ids(text[], text[]),
    stats_owe_range(uuid, date, text[], bigint),
    stats_owe_failed_range(),
    stats_run_is_active(text, timestamptz, timestamptz),
    stats_caller_is_application(),
    stats_user_is_stale(uuid),
    get_pr_overview(uuid, date)
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION get_pr_overview(uuid, date) TO inventory_app;
