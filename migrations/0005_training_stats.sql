-- Seed 001: training stats. Canonical workout data, the atomic write surface, the
-- dirty-range queue, the lease-fenced claim -> compute -> publish worker, and the
-- per-exercise and per-period projections.

-- Canonical data -------------------------------------------------------------------

CREATE TABLE exercises (
    id text PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 200),
    owner_user_id uuid,  -- NULL: a global exercise; else a personal one
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE training_sessions (
    id uuid PRIMARY KEY,
    user_id uuid NOT NULL,
    session_date date NOT NULL,
    notes text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX training_sessions_user_date ON training_sessions (user_id, session_date);

CREATE TABLE training_sets (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session_id uuid NOT NULL REFERENCES training_sessions (id) ON DELETE CASCADE,
    position integer NOT NULL,
    exercise_id text NOT NULL REFERENCES exercises (id),
    weight_kg numeric(7, 2) NOT NULL CHECK (weight_kg >= 0),
    reps integer NOT NULL CHECK (reps >= 0 AND reps <= 1000),
    warmup boolean NOT NULL DEFAULT false,
    UNIQUE (session_id, position)
);
CREATE INDEX training_sets_exercise ON training_sets (exercise_id);

CREATE TABLE user_manual_pr_records (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id uuid NOT NULL,
    exercise_id text NOT NULL REFERENCES exercises (id),
    weight_kg numeric(7, 2) NOT NULL CHECK (weight_kg > 0),
    reps integer NOT NULL CHECK (reps BETWEEN 1 AND 1000),
    recorded_on date NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX user_manual_pr_records_user ON user_manual_pr_records (user_id, exercise_id);

-- The durable mutation receipt of every write.
CREATE TABLE stats_mutation_receipts (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id uuid NOT NULL,
    session_id uuid NOT NULL,
    operation text NOT NULL CHECK (operation IN ('save', 'delete')),
    requested_version bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Queue ----------------------------------------------------------------------------

CREATE TABLE stats_refresh_event_types (
    id text PRIMARY KEY,
    description text NOT NULL
);
INSERT INTO stats_refresh_event_types (id, description) VALUES
    ('session_saved', 'a completed session was created or updated'),
    ('session_deleted', 'a completed session was deleted'),
    ('manual_pr_changed', 'a manual PR record changed'),
    ('catalog_changed', 'the exercise catalog changed'),
    ('pr_overview_rollover', 'the PR overview date window moved'),
    ('scheduled_stats_backfill', 'the backfill scanner found missing projections'),
    ('analyst_rebuild', 'an operator asked for a rebuild'),
    ('manual_refresh', 'an explicit refresh request');

-- Per user: the generation asked for by writes, and the one published.
CREATE TABLE user_stats_refresh_state (
    user_id uuid PRIMARY KEY,
    requested_version bigint NOT NULL DEFAULT 0 CHECK (requested_version >= 0),
    applied_version bigint NOT NULL DEFAULT 0 CHECK (applied_version >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE user_exercise_stats_refresh_jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id uuid NOT NULL,
    event_type text NOT NULL REFERENCES stats_refresh_event_types (id),
    from_date date,                                -- NULL: full user history
    exercise_ids text[] NOT NULL DEFAULT '{}',     -- empty: every exercise
    reason text NOT NULL DEFAULT '',
    source_ref text,
    status text NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'processing', 'completed', 'failed')),
    requested_version bigint NOT NULL DEFAULT 0,   -- the generation this job publishes
    locked_at timestamptz,
    lock_owner text,
    attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    error_message text,
    metadata jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    CONSTRAINT stats_jobs_processing_locked CHECK (
        status <> 'processing' OR (locked_at IS NOT NULL AND lock_owner IS NOT NULL)
    )
);
CREATE INDEX stats_jobs_pending ON user_exercise_stats_refresh_jobs (created_at, id)
    WHERE status = 'pending';
CREATE INDEX stats_jobs_user_open ON user_exercise_stats_refresh_jobs (user_id, id)
    WHERE status IN ('pending', 'processing');
CREATE INDEX stats_jobs_finished ON user_exercise_stats_refresh_jobs (completed_at)
    WHERE status IN ('completed', 'failed');

-- Worker ---------------------------------------------------------------------------

-- One budget source (seed 001 D08): statement budgets, lease, cap, attempts, backoff.
CREATE TABLE stats_projection_worker_settings (
    id integer PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    claim_budget_ms integer NOT NULL DEFAULT 3000 CHECK (claim_budget_ms > 0),
    compute_budget_ms integer NOT NULL DEFAULT 60000 CHECK (compute_budget_ms > 0),
    publish_budget_ms integer NOT NULL DEFAULT 6000
        CHECK (publish_budget_ms > 0 AND publish_budget_ms < 8000),  -- below the 8 s save deadline
    lease_seconds integer NOT NULL DEFAULT 300 CHECK (lease_seconds > 0),
    active_lease_cap integer NOT NULL DEFAULT 2 CHECK (active_lease_cap > 0),
    max_attempts integer NOT NULL DEFAULT 3 CHECK (max_attempts > 0),
    retry_backoff_seconds integer NOT NULL DEFAULT 30 CHECK (retry_backoff_seconds >= 0),
    CONSTRAINT stats_settings_lease_covers_work
        CHECK (lease_seconds * 1000 >= compute_budget_ms + publish_budget_ms)
);
INSERT INTO stats_projection_worker_settings DEFAULT VALUES;

-- Arm a stage's statement budget from the settings row (transaction-local).
CREATE FUNCTION stats_projection_statement_budget(p_stage text) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    budget integer;
BEGIN
    SELECT CASE p_stage
               WHEN 'claim' THEN claim_budget_ms
               WHEN 'compute' THEN compute_budget_ms
               WHEN 'publish' THEN publish_budget_ms
           END
    INTO budget
    FROM stats_projection_worker_settings WHERE id = 1;
    IF budget IS NULL THEN
        RAISE EXCEPTION 'unknown stats stage %', p_stage USING ERRCODE = '22023';
    END IF;
    PERFORM set_config('statement_timeout', budget::text, true);
    RETURN budget;
END
$$;

CREATE TABLE user_stats_projection_runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id bigint NOT NULL REFERENCES user_exercise_stats_refresh_jobs (id) ON DELETE CASCADE,
    user_id uuid NOT NULL,
    phase text NOT NULL CHECK (phase IN ('claimed', 'computed', 'published', 'failed', 'rejected')),
    lease_token uuid NOT NULL,
    lease_until timestamptz NOT NULL,
    lock_owner text NOT NULL,
    target_version bigint NOT NULL,       -- the generation this run publishes
    base_applied_version bigint NOT NULL, -- the published base it was computed on
    from_date date,
    exercise_ids text[] NOT NULL,
    attempts integer NOT NULL DEFAULT 1,
    retry_not_before timestamptz,
    payload jsonb NOT NULL DEFAULT '{}',
    compute_ms double precision NOT NULL DEFAULT 0,
    publish_ms double precision,
    error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
CREATE INDEX stats_runs_live ON user_stats_projection_runs (lease_until)
    WHERE phase IN ('claimed', 'computed');
CREATE INDEX stats_runs_job ON user_stats_projection_runs (job_id);
CREATE INDEX stats_runs_finished ON user_stats_projection_runs (finished_at)
    WHERE finished_at IS NOT NULL;

-- seed 001 D08 lease fence (55P03): a live lease's phase, payload, token or lease time
-- change only in a transaction that declared the current token. Expired leases and
-- finished runs are free: the claim's expiry recovery owns that path.
CREATE FUNCTION stats_projection_run_lease_fence() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF OLD.phase IN ('claimed', 'computed')
       AND OLD.lease_until > clock_timestamp()
       AND (OLD.phase, OLD.payload, OLD.lease_token, OLD.lease_until)
           IS DISTINCT FROM (NEW.phase, NEW.payload, NEW.lease_token, NEW.lease_until)
       AND coalesce(current_setting('inventory.stats_lease_token', true), '')
           <> OLD.lease_token::text
    THEN
        RAISE EXCEPTION 'stats projection run % is leased to another worker', OLD.id
            USING ERRCODE = '55P03';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER user_stats_projection_runs_lease_fence
    BEFORE UPDATE ON user_stats_projection_runs
    FOR EACH ROW EXECUTE FUNCTION stats_projection_run_lease_fence();

-- Private typed outputs of one run (never read by the app).
CREATE TABLE stats_output_exercise (
    run_id bigint NOT NULL REFERENCES user_stats_projection_runs (id) ON DELETE CASCADE,
    exercise_id text NOT NULL,
    sessions integer NOT NULL,
    working_sets integer NOT NULL,
    reps bigint NOT NULL,
    volume numeric NOT NULL,
    heaviest_kg numeric(7, 2),
    best_e1rm_kg numeric(9, 2),
    first_date date,
    last_date date,
    PRIMARY KEY (run_id, exercise_id)
);
CREATE TABLE stats_output_period (
    run_id bigint NOT NULL REFERENCES user_stats_projection_runs (id) ON DELETE CASCADE,
    period text NOT NULL,
    period_start date NOT NULL,
    sessions integer NOT NULL,
    working_sets integer NOT NULL,
    reps bigint NOT NULL,
    volume numeric NOT NULL,
    PRIMARY KEY (run_id, period, period_start)
);

-- Public projections --------------------------------------------------------------

CREATE TABLE user_exercise_stats (
    user_id uuid NOT NULL,
    -- Deferred: publication forces it immediate, so an exercise deleted during the
    -- computation rejects the payload with 23503 (seed 001 D08).
    exercise_id text NOT NULL REFERENCES exercises (id) DEFERRABLE INITIALLY DEFERRED,
    sessions integer NOT NULL,
    working_sets integer NOT NULL,
    reps bigint NOT NULL,
    volume numeric NOT NULL,
    heaviest_kg numeric(7, 2),
    best_e1rm_kg numeric(9, 2),
    first_date date,
    last_date date,
    generation bigint NOT NULL,
    PRIMARY KEY (user_id, exercise_id)
);

CREATE TABLE user_training_period_stats (
    user_id uuid NOT NULL,
    period text NOT NULL CHECK (period IN ('day', 'week', 'month', 'quarter', 'year')),
    period_start date NOT NULL,
    sessions integer NOT NULL,
    working_sets integer NOT NULL,
    reps bigint NOT NULL,
    volume numeric NOT NULL,
    generation bigint NOT NULL,
    PRIMARY KEY (user_id, period, period_start)
);

-- Epley estimate (seed 001 projections): weight × (1 + reps/30) for 2-12 reps, the
-- weight itself for one rep, no estimate above twelve.
CREATE FUNCTION estimated_one_rep_max(p_weight numeric, p_reps integer) RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_reps = 1 THEN p_weight
        WHEN p_reps BETWEEN 2 AND 12 THEN round(p_weight * (1 + p_reps / 30.0), 2)
    END
$$;

-- Write surface -------------------------------------------------------------------

-- Bump the user's requested generation (the requested_version of seed 001).
CREATE FUNCTION bump_stats_requested_version(p_user_id uuid) RETURNS bigint
LANGUAGE sql
AS $$
    INSERT INTO user_stats_refresh_state AS s (user_id, requested_version)
    VALUES (p_user_id, 1)
    ON CONFLICT (user_id) DO UPDATE
    SET requested_version = s.requested_version + 1, updated_at = now()
    RETURNING requested_version
$$;

-- seed 001 merge semantics: one mergeable pending job per user. A pending row locked by
-- a worker that is claiming it is skipped (SKIP LOCKED) and the next pending row is
-- created; processing rows are never touched. Enqueuers of one user serialize on a
-- per-user advisory lock, so later writes merge into that new row.
CREATE FUNCTION enqueue_user_exercise_stats_refresh_job(
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
    v_ids text[] := coalesce(
        (SELECT array_agg(DISTINCT e ORDER BY e) FROM unnest(p_exercise_ids) AS e), '{}');
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
        SET from_date = CASE WHEN from_date IS NULL OR p_from_date IS NULL THEN NULL
                             ELSE least(from_date, p_from_date) END,
            exercise_ids = CASE
                WHEN cardinality(exercise_ids) = 0 OR cardinality(v_ids) = 0 THEN '{}'
                ELSE (SELECT array_agg(DISTINCT e ORDER BY e)
                      FROM unnest(exercise_ids || v_ids) AS e) END,
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

-- The caller's identity when an application sets it; NULL for trusted service callers.
CREATE FUNCTION stats_current_user_id() RETURNS uuid
LANGUAGE sql STABLE
AS $$ SELECT nullif(current_setting('inventory.current_user_id', true), '')::uuid $$;

CREATE FUNCTION stats_check_owner(p_expected_user_id uuid, p_actual_user_id uuid)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_expected_user_id IS NULL THEN
        RAISE EXCEPTION 'expected owner is required' USING ERRCODE = '42501';
    END IF;
    IF stats_current_user_id() IS NOT NULL AND stats_current_user_id() <> p_expected_user_id THEN
        RAISE EXCEPTION 'expected owner is not the caller' USING ERRCODE = '42501';
    END IF;
    IF p_actual_user_id IS DISTINCT FROM p_expected_user_id THEN
        RAISE EXCEPTION 'session owner does not match the expected owner' USING ERRCODE = '42501';
    END IF;
END
$$;

-- Save (create or update) one completed session: canonical rows, the mutation receipt,
-- the dirty-range enqueue and the requested_version bump commit together. Dirty range
-- (seed 001 "Past Edit Dirty Range"): the earlier of the old and new date, the union of
-- the old and new exercises.
CREATE FUNCTION save_training_session(p_expected_user_id uuid, p_session jsonb)
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
    v_from := CASE WHEN v_old.id IS NULL THEN v_date ELSE least(v_old.session_date, v_date) END;
    v_version := bump_stats_requested_version(v_user);
    v_job := enqueue_user_exercise_stats_refresh_job(
        v_user, 'session_saved', v_from, v_old_exercises || v_new_exercises,
        CASE WHEN v_old.id IS NULL THEN 'session created' ELSE 'session updated' END,
        'session:' || v_id, v_version);
    INSERT INTO stats_mutation_receipts (user_id, session_id, operation, requested_version)
    VALUES (v_user, v_id, 'save', v_version)
    RETURNING id INTO v_receipt;
    RETURN jsonb_build_object('session_id', v_id, 'requested_version', v_version,
                              'receipt_id', v_receipt, 'job_id', v_job);
END
$$;

-- Delete one completed session: the dirty range is its date and its exercises.
CREATE FUNCTION delete_training_session(p_expected_user_id uuid, p_session_id uuid)
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
    v_exercises := ARRAY(SELECT DISTINCT exercise_id FROM training_sets WHERE session_id = p_session_id);
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

-- The app-facing refresh request (the only queue API the application role may call).
CREATE FUNCTION request_stats_refresh(
    p_user_id uuid, p_from_date date, p_exercise_ids text[], p_reason text
) RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
DECLARE
    v_version bigint;
    v_job bigint;
BEGIN
    PERFORM stats_check_owner(p_user_id, p_user_id);
    v_version := bump_stats_requested_version(p_user_id);
    v_job := enqueue_user_exercise_stats_refresh_job(
        p_user_id, 'manual_refresh', p_from_date, coalesce(p_exercise_ids, '{}'),
        coalesce(p_reason, 'manual refresh'), NULL, v_version);
    RETURN jsonb_build_object('job_id', v_job, 'requested_version', v_version);
END
$$;

-- Worker status (seed 001 D08 observation).
CREATE FUNCTION stats_projection_worker_status() RETURNS jsonb
LANGUAGE sql STABLE
AS $$
    SELECT jsonb_build_object(
        'pending_users', (SELECT count(DISTINCT user_id) FROM user_exercise_stats_refresh_jobs
                          WHERE status = 'pending'),
        'pending_jobs', (SELECT count(*) FROM user_exercise_stats_refresh_jobs
                         WHERE status = 'pending'),
        'oldest_wait_seconds', (SELECT extract(epoch FROM now() - min(created_at))
                                FROM user_exercise_stats_refresh_jobs WHERE status = 'pending'),
        'active_leases', (SELECT count(*) FROM user_stats_projection_runs
                          WHERE phase IN ('claimed', 'computed') AND lease_until > now()
                            AND (retry_not_before IS NULL OR retry_not_before <= now())),
        'expired_leases', (SELECT count(*) FROM user_stats_projection_runs
                           WHERE phase IN ('claimed', 'computed') AND lease_until <= now()),
        'backing_off', (SELECT count(*) FROM user_stats_projection_runs
                        WHERE phase IN ('claimed', 'computed') AND retry_not_before > now()),
        'attempt_exhausted_failures', (
            SELECT count(*) FROM user_exercise_stats_refresh_jobs j
            WHERE j.status = 'failed'
              AND j.attempts >= (SELECT max_attempts FROM stats_projection_worker_settings)),
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

-- Roles: the application may call the write functions and read its own projections;
-- it cannot reach the queue, runs, settings or worker functions.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inventory_app') THEN
        CREATE ROLE inventory_app NOLOGIN;
    END IF;
END
$$;
REVOKE ALL ON FUNCTION
    bump_stats_requested_version(uuid),
    enqueue_user_exercise_stats_refresh_job(uuid, text, date, text[], text, text, bigint),
    stats_projection_statement_budget(text),
    stats_projection_worker_status(),
    stats_check_owner(uuid, uuid),
    save_training_session(uuid, jsonb),
    delete_training_session(uuid, uuid),
    request_stats_refresh(uuid, date, text[], text)
FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO inventory_app;
GRANT EXECUTE ON FUNCTION
    save_training_session(uuid, jsonb),
    delete_training_session(uuid, uuid),
    request_stats_refresh(uuid, date, text[], text)
TO inventory_app;
GRANT SELECT ON exercises, user_exercise_stats, user_training_period_stats TO inventory_app;
ALTER TABLE user_exercise_stats ENABLE ROW LEVEL SECURITY;
ALTER TABLE user_training_period_stats ENABLE ROW LEVEL SECURITY;
CREATE POLICY user_exercise_stats_own ON user_exercise_stats FOR SELECT TO inventory_app
    USING (user_id = stats_current_user_id());
CREATE POLICY user_training_period_stats_own ON user_training_period_stats FOR SELECT
    TO inventory_app USING (user_id = stats_current_user_id());
