-- The training stats schema as it runs now: every table, index, function, trigger,
-- grant and starting row this capability owns, in one file to read. The database gets
-- it from migrations/ (applied in order, never edited once applied); a test builds a
-- database from this file and one from the migrations and checks that their catalogs
-- agree (tests/db/test_schema_files.py). To change anything here, change it in this
-- file and write a new migration that carries only the difference.
--
-- Rules, tables and state machine: docs/training-stats.md.


CREATE DOMAIN stats_job_status AS text CHECK ((VALUE = ANY (ARRAY['pending'::text, 'processing'::text, 'completed'::text, 'failed'::text])));
CREATE DOMAIN stats_run_phase AS text CHECK ((VALUE = ANY (ARRAY['claimed'::text, 'computed'::text, 'published'::text, 'failed'::text, 'rejected'::text])));
CREATE DOMAIN stats_attempt_count AS integer CHECK ((VALUE >= 0));
CREATE DOMAIN stats_generation AS bigint CHECK ((VALUE >= 0));

CREATE TABLE exercises (
    id text NOT NULL,
    owner_user_id uuid,
    name text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT exercises_pkey PRIMARY KEY (id),
    CONSTRAINT exercises_id_check CHECK (((length(id) >= 1) AND (length(id) <= 200)))
);

CREATE TABLE training_sessions (
    id uuid NOT NULL,
    user_id uuid NOT NULL,
    session_date date NOT NULL,
    notes text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT training_sessions_pkey PRIMARY KEY (id),
    CONSTRAINT training_sessions_session_date_in_range CHECK (((session_date >= '0001-01-01'::date) AND (session_date <= '9999-12-31'::date)))
);
CREATE INDEX training_sessions_user_date ON training_sessions USING btree (user_id, session_date);

CREATE TABLE training_sets (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    session_id uuid NOT NULL,
    "position" integer NOT NULL,
    exercise_id text NOT NULL,
    weight_kg numeric(7,2) NOT NULL,
    reps integer NOT NULL,
    warmup boolean DEFAULT false NOT NULL,
    CONSTRAINT training_sets_session_id_position_key UNIQUE (session_id, "position"),
    CONSTRAINT training_sets_pkey PRIMARY KEY (id),
    CONSTRAINT training_sets_exercise_id_fkey FOREIGN KEY (exercise_id) REFERENCES exercises(id),
    CONSTRAINT training_sets_session_id_fkey FOREIGN KEY (session_id) REFERENCES training_sessions(id) ON DELETE CASCADE,
    CONSTRAINT training_sets_reps_check CHECK (((reps >= 0) AND (reps <= 1000))),
    CONSTRAINT training_sets_weight_kg_check CHECK (((weight_kg >= (0)::numeric) AND (weight_kg <> 'NaN'::numeric)))
);
CREATE INDEX training_sets_exercise ON training_sets USING btree (exercise_id);

CREATE TABLE user_manual_pr_records (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    user_id uuid NOT NULL,
    exercise_id text NOT NULL,
    weight_kg numeric(7,2) NOT NULL,
    reps integer NOT NULL,
    recorded_on date NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT user_manual_pr_records_pkey PRIMARY KEY (id),
    CONSTRAINT user_manual_pr_records_exercise_id_fkey FOREIGN KEY (exercise_id) REFERENCES exercises(id),
    CONSTRAINT user_manual_pr_records_recorded_on_in_range CHECK (((recorded_on >= '0001-01-01'::date) AND (recorded_on <= '9999-12-31'::date))),
    CONSTRAINT user_manual_pr_records_reps_check CHECK (((reps >= 1) AND (reps <= 1000))),
    CONSTRAINT user_manual_pr_records_weight_kg_check CHECK (((weight_kg > (0)::numeric) AND (weight_kg <> 'NaN'::numeric)))
);
CREATE INDEX user_manual_pr_records_user ON user_manual_pr_records USING btree (user_id, exercise_id);
CREATE INDEX user_manual_pr_records_user_day ON user_manual_pr_records USING btree (user_id, recorded_on);

-- The durable mutation receipt of every write: a session's or a manual PR's save or
-- delete names its subject; an explicit refresh request changes no fact and names none.
CREATE TABLE stats_mutation_receipts (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    user_id uuid NOT NULL,
    session_id uuid,
    operation text NOT NULL,
    requested_version bigint NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    manual_pr_record_id bigint,
    CONSTRAINT stats_mutation_receipts_pkey PRIMARY KEY (id),
    CONSTRAINT stats_mutation_receipts_one_subject CHECK ((num_nonnulls(session_id, manual_pr_record_id) = CASE WHEN (operation = 'refresh'::text) THEN 0 ELSE 1 END)),
    CONSTRAINT stats_mutation_receipts_operation_check CHECK ((operation = ANY (ARRAY['save'::text, 'delete'::text, 'refresh'::text])))
);

CREATE TABLE stats_refresh_event_types (
    id text NOT NULL,
    description text NOT NULL,
    CONSTRAINT stats_refresh_event_types_pkey PRIMARY KEY (id)
);

-- Per user: the generation asked for by writes, and the one published.
CREATE TABLE user_stats_refresh_state (
    user_id uuid NOT NULL,
    requested_version stats_generation DEFAULT 0 NOT NULL,
    applied_version stats_generation DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT user_stats_refresh_state_pkey PRIMARY KEY (user_id)
);

CREATE TABLE user_exercise_stats_refresh_jobs (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    user_id uuid NOT NULL,
    event_type text NOT NULL,
    from_date date,
    exercise_ids text[] DEFAULT '{}'::text[],
    reason text DEFAULT ''::text NOT NULL,
    source_ref text,
    status stats_job_status DEFAULT 'pending'::text NOT NULL,
    requested_version bigint DEFAULT 0 NOT NULL,
    locked_at timestamp with time zone,
    lock_owner text,
    attempts stats_attempt_count DEFAULT 0 NOT NULL,
    error_message text,
    metadata jsonb DEFAULT '{}'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    completed_at timestamp with time zone,
    CONSTRAINT user_exercise_stats_refresh_jobs_pkey PRIMARY KEY (id),
    CONSTRAINT user_exercise_stats_refresh_jobs_event_type_fkey FOREIGN KEY (event_type) REFERENCES stats_refresh_event_types(id),
    CONSTRAINT stats_jobs_processing_locked CHECK ((((status)::text <> 'processing'::text) OR ((locked_at IS NOT NULL) AND (lock_owner IS NOT NULL))))
);
CREATE INDEX stats_jobs_user ON user_exercise_stats_refresh_jobs USING btree (user_id, id);
CREATE INDEX stats_jobs_pending ON user_exercise_stats_refresh_jobs USING btree (created_at, id) WHERE ((status)::text = 'pending'::text);
CREATE INDEX stats_jobs_user_open ON user_exercise_stats_refresh_jobs USING btree (user_id, id) WHERE ((status)::text = ANY (ARRAY['pending'::text, 'processing'::text]));
CREATE INDEX stats_jobs_finished ON user_exercise_stats_refresh_jobs USING btree (completed_at) WHERE ((status)::text = ANY (ARRAY['completed'::text, 'failed'::text]));
CREATE UNIQUE INDEX stats_jobs_one_live_per_user ON user_exercise_stats_refresh_jobs USING btree (user_id) WHERE ((status)::text = 'processing'::text);

-- One budget source, read by every stage: statement budgets, lease, cap of active
-- leases, attempts, backoff, and the pause switch. A stage budget is at least 100 ms: a
-- claim, a small account's compute step or publication takes about a millisecond on an
-- idle server and a 100-exercise account's tens, so below that a stage can fail every
-- call (a 1 ms claim budget made a drain publish nothing).
CREATE TABLE stats_projection_worker_settings (
    id integer DEFAULT 1 NOT NULL,
    claim_budget_ms integer DEFAULT 3000 NOT NULL,
    compute_budget_ms integer DEFAULT 60000 NOT NULL,
    publish_budget_ms integer DEFAULT 6000 NOT NULL,
    lease_seconds integer DEFAULT 300 NOT NULL,
    active_lease_cap integer DEFAULT 2 NOT NULL,
    max_attempts integer DEFAULT 3 NOT NULL,
    retry_backoff_seconds integer DEFAULT 30 NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    CONSTRAINT stats_projection_worker_settings_pkey PRIMARY KEY (id),
    CONSTRAINT stats_projection_worker_settings_active_lease_cap_check CHECK ((active_lease_cap > 0)),
    CONSTRAINT stats_projection_worker_settings_claim_budget_ms_check CHECK ((claim_budget_ms >= 100)),
    CONSTRAINT stats_projection_worker_settings_compute_budget_ms_check CHECK ((compute_budget_ms >= 100)),
    CONSTRAINT stats_projection_worker_settings_id_check CHECK ((id = 1)),
    CONSTRAINT stats_projection_worker_settings_lease_seconds_check CHECK ((lease_seconds > 0)),
    CONSTRAINT stats_projection_worker_settings_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT stats_projection_worker_settings_publish_budget_ms_check CHECK (((publish_budget_ms >= 100) AND (publish_budget_ms < 8000))),
    CONSTRAINT stats_projection_worker_settings_retry_backoff_seconds_check CHECK ((retry_backoff_seconds >= 0)),
    CONSTRAINT stats_settings_lease_covers_work CHECK (((lease_seconds * 1000) >= (compute_budget_ms + publish_budget_ms)))
);

-- One attempt chain of a job under a lease. `error` says why its last attempt failed or
-- why it was rejected; error_sqlstate is the SQLSTATE of the database error that
-- caused it (NULL when none did).
CREATE TABLE user_stats_projection_runs (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    job_id bigint NOT NULL,
    user_id uuid NOT NULL,
    phase stats_run_phase NOT NULL,
    lease_token uuid NOT NULL,
    lease_until timestamp with time zone NOT NULL,
    lock_owner text NOT NULL,
    target_version bigint NOT NULL,
    base_applied_version bigint NOT NULL,
    from_date date,
    exercise_ids text[],
    attempts integer DEFAULT 1 NOT NULL,
    retry_not_before timestamp with time zone,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    compute_ms double precision DEFAULT 0 NOT NULL,
    publish_ms double precision,
    error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    error_sqlstate text,
    CONSTRAINT user_stats_projection_runs_pkey PRIMARY KEY (id),
    CONSTRAINT user_stats_projection_runs_error_sqlstate CHECK (((error_sqlstate IS NULL) OR ((error IS NOT NULL) AND (error_sqlstate ~ '^[0-9A-Z]{5}$'::text)))),
    CONSTRAINT user_stats_projection_runs_job_id_fkey FOREIGN KEY (job_id) REFERENCES user_exercise_stats_refresh_jobs(id) ON DELETE CASCADE
);
CREATE INDEX stats_runs_job ON user_stats_projection_runs USING btree (job_id);
CREATE INDEX stats_runs_finished ON user_stats_projection_runs USING btree (finished_at) WHERE (finished_at IS NOT NULL);
CREATE INDEX stats_runs_job_finished ON user_stats_projection_runs USING btree (job_id) WHERE (finished_at IS NOT NULL);
CREATE INDEX stats_runs_live ON user_stats_projection_runs USING btree (lease_until) WHERE ((phase)::text = ANY (ARRAY['claimed'::text, 'computed'::text]));
CREATE INDEX stats_runs_open ON user_stats_projection_runs USING btree (id) WHERE ((phase)::text = ANY (ARRAY['claimed'::text, 'computed'::text]));

-- Private typed outputs of one run (never read by the app).
CREATE TABLE stats_output_exercise (
    run_id bigint NOT NULL,
    exercise_id text NOT NULL,
    sessions integer NOT NULL,
    working_sets integer NOT NULL,
    reps bigint NOT NULL,
    volume numeric NOT NULL,
    heaviest_kg numeric(7,2),
    best_e1rm_kg numeric(9,2),
    first_date date,
    last_date date,
    CONSTRAINT stats_output_exercise_pkey PRIMARY KEY (run_id, exercise_id),
    CONSTRAINT stats_output_exercise_run_id_fkey FOREIGN KEY (run_id) REFERENCES user_stats_projection_runs(id) ON DELETE CASCADE
);

CREATE TABLE stats_output_period (
    run_id bigint NOT NULL,
    period text NOT NULL,
    period_start date NOT NULL,
    sessions integer NOT NULL,
    working_sets integer NOT NULL,
    reps bigint NOT NULL,
    volume numeric NOT NULL,
    CONSTRAINT stats_output_period_pkey PRIMARY KEY (run_id, period, period_start),
    CONSTRAINT stats_output_period_run_id_fkey FOREIGN KEY (run_id) REFERENCES user_stats_projection_runs(id) ON DELETE CASCADE
);

CREATE TABLE user_exercise_stats (
    user_id uuid NOT NULL,
    exercise_id text NOT NULL,
    sessions integer NOT NULL,
    working_sets integer NOT NULL,
    reps bigint NOT NULL,
    volume numeric NOT NULL,
    heaviest_kg numeric(7,2),
    best_e1rm_kg numeric(9,2),
    first_date date,
    last_date date,
    generation bigint NOT NULL,
    CONSTRAINT user_exercise_stats_pkey PRIMARY KEY (user_id, exercise_id),
    CONSTRAINT user_exercise_stats_exercise_id_fkey FOREIGN KEY (exercise_id) REFERENCES exercises(id) DEFERRABLE INITIALLY DEFERRED
);
CREATE INDEX user_exercise_stats_user ON user_exercise_stats USING btree (user_id, generation);

CREATE TABLE user_training_period_stats (
    user_id uuid NOT NULL,
    period text NOT NULL,
    period_start date NOT NULL,
    sessions integer NOT NULL,
    working_sets integer NOT NULL,
    reps bigint NOT NULL,
    volume numeric NOT NULL,
    generation bigint NOT NULL,
    CONSTRAINT user_training_period_stats_pkey PRIMARY KEY (user_id, period, period_start),
    CONSTRAINT user_training_period_stats_period_check CHECK ((period = ANY (ARRAY['day'::text, 'week'::text, 'month'::text, 'quarter'::text, 'year'::text])))
);

CREATE TABLE pr_overview_projection_control (
    id integer DEFAULT 1 NOT NULL,
    catalog_epoch bigint DEFAULT 1 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT pr_overview_projection_control_pkey PRIMARY KEY (id),
    CONSTRAINT pr_overview_projection_control_id_check CHECK ((id = 1))
);

CREATE TABLE user_pr_overview_rollover_state (
    user_id uuid NOT NULL,
    due_at timestamp with time zone NOT NULL,
    snapshot_generation bigint,
    applied_catalog_epoch bigint,
    window_end date,
    attempt_count integer DEFAULT 0 NOT NULL,
    next_retry_at timestamp with time zone,
    last_error text,
    last_success_at timestamp with time zone,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT user_pr_overview_rollover_state_pkey PRIMARY KEY (user_id)
);
CREATE INDEX user_pr_overview_rollover_due ON user_pr_overview_rollover_state USING btree (due_at, user_id);

CREATE TABLE user_pr_overview_snapshot_headers (
    user_id uuid NOT NULL,
    generation bigint NOT NULL,
    as_of_date date NOT NULL,
    catalog_epoch bigint NOT NULL,
    exercise_count integer NOT NULL,
    built_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT user_pr_overview_snapshot_headers_pkey PRIMARY KEY (user_id, generation, as_of_date)
);

CREATE TABLE user_pr_exercise_summary_snapshots (
    user_id uuid NOT NULL,
    generation bigint NOT NULL,
    as_of_date date NOT NULL,
    exercise_id text NOT NULL,
    best_e1rm_all_time numeric(9,2),
    best_e1rm_30d numeric(9,2),
    best_e1rm_30d_prior_year numeric(9,2),
    heaviest_kg numeric(7,2),
    CONSTRAINT user_pr_exercise_summary_snapshots_pkey PRIMARY KEY (user_id, generation, as_of_date, exercise_id),
    CONSTRAINT user_pr_exercise_summary_snap_user_id_generation_as_of_dat_fkey FOREIGN KEY (user_id, generation, as_of_date) REFERENCES user_pr_overview_snapshot_headers(user_id, generation, as_of_date) ON DELETE CASCADE
);

-- Catalog invalidation. Every catalog change is logged; the log insert records a
-- per-scope token in the same transaction. Tokens count changes in commit order (the
-- scope row serializes writers), so a late commit of a lower sequence still moves the
-- token, and pruning the log loses nothing: processors work from tokens.
CREATE TABLE exercise_catalog_changes (
    seq bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    exercise_id text NOT NULL,
    owner_user_id uuid,
    change text NOT NULL,
    changed_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT exercise_catalog_changes_pkey PRIMARY KEY (seq),
    CONSTRAINT exercise_catalog_changes_change_check CHECK ((change = ANY (ARRAY['INSERT'::text, 'UPDATE'::text, 'DELETE'::text])))
);

CREATE TABLE catalog_invalidation_tokens (
    scope text NOT NULL,
    token bigint DEFAULT 0 NOT NULL,
    processed_token bigint DEFAULT 0 NOT NULL,
    pass_token bigint,
    cursor uuid,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT catalog_invalidation_tokens_pkey PRIMARY KEY (scope)
);

-- The range of every job that failed without publishing, merged per user, until the
-- next claim of that user takes it into its own range. While a row exists the user's
-- stats are stale, whatever the versions say.
CREATE TABLE user_stats_owed_ranges (
    user_id uuid NOT NULL,
    from_date date,
    exercise_ids text[],
    failed_job_ids bigint[] DEFAULT '{}'::bigint[] NOT NULL,
    owed_since timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT user_stats_owed_ranges_pkey PRIMARY KEY (user_id)
);

-- An operator's rebuild: one row per request. A pass over every user walks user ids by
-- keyset (`cursor`, the last user enqueued); a pass over a chosen list walks the sorted
-- list by `position`. Each step enqueues one user and moves the position in the same
-- transaction, so a killed pass neither repeats nor skips a user.
CREATE TABLE stats_rebuild_passes (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    user_ids uuid[],
    cursor uuid,
    "position" integer DEFAULT 0 NOT NULL,
    requested integer DEFAULT 0 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    CONSTRAINT stats_rebuild_passes_pkey PRIMARY KEY (id),
    CONSTRAINT stats_rebuild_passes_list_sorted CHECK (((user_ids IS NULL) OR (("position" >= 0) AND ("position" <= cardinality(user_ids)))))
);
CREATE INDEX stats_rebuild_passes_open ON stats_rebuild_passes USING btree (id) WHERE (finished_at IS NULL);

-- The backfill scanner's keyset position over user ids: each tick looks at the next
-- page, so a page that fails cannot keep the scanner from the users after it.
CREATE TABLE stats_scan_cursor (
    id integer DEFAULT 1 NOT NULL,
    cursor uuid,
    laps bigint DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT stats_scan_cursor_pkey PRIMARY KEY (id),
    CONSTRAINT stats_scan_cursor_id_check CHECK ((id = 1))
);

-- One row per slot of the cap of active leases: the run that holds it and its lease's
-- end, kept the run's while the lease is active (stats_mirror_lease). A slot whose
-- lease ended is free: a claim takes one (FOR UPDATE SKIP LOCKED) and writes its run and
-- lease end into it; a stage renewing its lease locks its row first (stats_renew_lease).
-- Raising the cap adds rows; lowering it removes the free rows above it, and the claim
-- fills no slot above it.
CREATE TABLE stats_lease_slots (
    slot integer NOT NULL,
    run_id bigint,
    lease_until timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    CONSTRAINT stats_lease_slots_pkey PRIMARY KEY (slot),
    CONSTRAINT stats_lease_slots_slot_check CHECK ((slot > 0))
);


-- Arm a stage's statement budget from the settings row (transaction-local).
CREATE FUNCTION stats_projection_statement_budget(p_stage text)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$;

-- The lease fence (SQLSTATE LEASE, its own code: a lock timeout's 55P03 is an error
-- callers retry, a fence refusal is a defect): a live lease's phase, payload, token or
-- lease time change only in a transaction that declared the current token. Expired leases and
-- finished runs are free: the claim's expiry recovery owns that path.
CREATE FUNCTION stats_projection_run_lease_fence()
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

-- Epley, exactly: weight × (30 + reps) / 30 for 2-12 reps, rounded once to 0.01 kg.
CREATE FUNCTION estimated_one_rep_max(p_weight numeric, p_reps integer)
 RETURNS numeric
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$
    SELECT CASE
        WHEN p_reps = 1 THEN p_weight
        WHEN p_reps BETWEEN 2 AND 12 THEN round(p_weight * (30 + p_reps) / 30, 2)
    END
$function$;

-- Bump the user's requested generation.
CREATE FUNCTION bump_stats_requested_version(p_user_id uuid)
 RETURNS bigint
 LANGUAGE sql
AS $function$
    INSERT INTO user_stats_refresh_state AS s (user_id, requested_version)
    VALUES (p_user_id, 1)
    ON CONFLICT (user_id) DO UPDATE
    SET requested_version = s.requested_version + 1, updated_at = now()
    RETURNING requested_version
$function$;

-- A user's dirty ranges merge into the user's newest pending job; when a claim holds
-- that job (it is starting it), the range goes into a new job, and later saves merge
-- into that one. Enqueuers of one user take turns (advisory lock), and a claim starts a
-- user's oldest pending job only, so a user's jobs publish in the order they were made.
CREATE FUNCTION enqueue_user_exercise_stats_refresh_job(p_user_id uuid, p_event_type text, p_from_date date, p_exercise_ids text[], p_reason text, p_source_ref text, p_requested_version bigint)
 RETURNS bigint
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_newest bigint;
    v_job bigint;
    v_ids text[] := CASE WHEN p_exercise_ids IS NULL THEN NULL ELSE coalesce(
        (SELECT array_agg(DISTINCT e ORDER BY e) FROM unnest(p_exercise_ids) AS e), '{}') END;
    v_reason text := coalesce(p_reason, '');
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('stats_enqueue:' || p_user_id::text, 0));
    SELECT id INTO v_newest
    FROM user_exercise_stats_refresh_jobs
    WHERE user_id = p_user_id AND status = 'pending'
    ORDER BY id DESC
    LIMIT 1;
    IF v_newest IS NOT NULL THEN
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
        WHERE id = (SELECT n.id FROM user_exercise_stats_refresh_jobs n
                    WHERE n.id = v_newest AND n.status = 'pending'
                    FOR UPDATE SKIP LOCKED)
        RETURNING id INTO v_job;
        IF FOUND THEN
            RETURN v_job;
        END IF;
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
    RETURNING id INTO v_job;
    RETURN v_job;
END
$function$;

-- The caller's identity when an application sets it; NULL for trusted service callers.
CREATE FUNCTION stats_current_user_id()
 RETURNS uuid
 LANGUAGE sql
 STABLE
AS $function$ SELECT nullif(current_setting('inventory.current_user_id', true), '')::uuid $function$;

-- Owner check of every application entry point. The application role must name its
-- caller (inventory.current_user_id); without it, it is refused, never trusted.
CREATE FUNCTION stats_check_owner(p_expected_user_id uuid, p_actual_user_id uuid)
 RETURNS void
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE FUNCTION save_training_session(p_expected_user_id uuid, p_session jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
DECLARE
    v_id uuid;
    v_user uuid;
    v_date date;
    v_notes text;
    v_old training_sessions%ROWTYPE;
    v_old_exercises text[] := '{}';
    v_new_exercises text[];
    v_dirty text[];
    v_from date;
    v_version bigint;
    v_job bigint;
    v_receipt bigint;
BEGIN
    IF jsonb_typeof(p_session) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'session must be an object' USING ERRCODE = '22023';
    END IF;
    BEGIN
        v_user := (p_session ->> 'user_id')::uuid;
        v_id := coalesce((p_session ->> 'id')::uuid, gen_random_uuid());
    EXCEPTION WHEN invalid_text_representation THEN
        RAISE EXCEPTION 'id and user_id must be UUIDs' USING ERRCODE = '22023';
    END;
    PERFORM stats_check_owner(p_expected_user_id, v_user);
    v_date := stats_checked_date('session_date', p_session ->> 'session_date');
    IF jsonb_typeof(p_session -> 'notes') NOT IN ('string', 'null') THEN
        RAISE EXCEPTION 'notes must be text' USING ERRCODE = '22023';
    END IF;
    v_notes := p_session ->> 'notes';
    IF length(v_notes) > 10000 THEN
        RAISE EXCEPTION 'notes: at most 10000 characters, got %', length(v_notes)
            USING ERRCODE = '22023';
    END IF;

    SELECT * INTO v_old FROM training_sessions WHERE id = v_id FOR UPDATE;
    IF FOUND THEN
        PERFORM stats_check_owner(p_expected_user_id, v_old.user_id);
        v_old_exercises := ARRAY(
            SELECT DISTINCT exercise_id FROM training_sets WHERE session_id = v_id);
    END IF;
    INSERT INTO training_sessions (id, user_id, session_date, notes)
    VALUES (v_id, v_user, v_date, v_notes)
    ON CONFLICT (id) DO UPDATE
    SET session_date = EXCLUDED.session_date, notes = EXCLUDED.notes, updated_at = now();
    DELETE FROM training_sets WHERE session_id = v_id;
    INSERT INTO training_sets (session_id, position, exercise_id, weight_kg, reps, warmup)
    SELECT v_id, s.ordinality, s.exercise_id, s.weight_kg, s.reps, s.warmup
    FROM stats_checked_sets(v_user, p_session -> 'sets') AS s;
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
$function$;

-- Delete one completed session (a session without sets dirties no exercise).
CREATE FUNCTION delete_training_session(p_expected_user_id uuid, p_session_id uuid)
 RETURNS jsonb
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
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
$function$;

CREATE FUNCTION request_stats_refresh(p_user_id uuid, p_from_date date, p_exercise_ids text[], p_reason text)
 RETURNS jsonb
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
DECLARE
    v_version bigint;
    v_job bigint;
    v_receipt bigint;
BEGIN
    PERFORM stats_check_owner(p_user_id, p_user_id);
    IF p_from_date IS NOT NULL THEN
        PERFORM stats_checked_date('from_date', p_from_date::text);
    END IF;
    v_version := bump_stats_requested_version(p_user_id);
    v_job := enqueue_user_exercise_stats_refresh_job(
        p_user_id, 'manual_refresh', p_from_date, coalesce(p_exercise_ids, '{}'),
        coalesce(p_reason, 'manual refresh'), NULL, v_version);
    INSERT INTO stats_mutation_receipts (user_id, operation, requested_version)
    VALUES (p_user_id, 'refresh', v_version)
    RETURNING id INTO v_receipt;
    RETURN jsonb_build_object('job_id', v_job, 'requested_version', v_version,
                              'receipt_id', v_receipt);
END
$function$;

-- What "active" means, for the claim's lease cap and the status function alike: a run
-- being worked on under a live lease. A run waiting out its retry time is not active
-- (it neither holds a slot nor starves other users).
CREATE FUNCTION stats_run_is_active(p_phase text, p_lease_until timestamp with time zone, p_retry_not_before timestamp with time zone)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
    SELECT p_phase IN ('claimed', 'computed') AND p_lease_until > now()
           AND p_retry_not_before IS NULL
$function$;

CREATE FUNCTION stats_projection_worker_status()
 RETURNS jsonb
 LANGUAGE sql
 STABLE
AS $function$
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
        -- What still needs an operator: failed jobs whose range is still owed (no later
        -- job of the user took it in) and that nobody retried.
        'attempt_exhausted_failures', (SELECT count(*)
                                       FROM user_stats_owed_ranges o
                                       CROSS JOIN unnest(o.failed_job_ids) AS f (job_id)
                                       JOIN user_exercise_stats_refresh_jobs j
                                         ON j.id = f.job_id
                                       WHERE NOT j.metadata ? 'retried_by'),
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
$function$;

-- The database date, overridable per session (tests and replays set it; nothing else
-- does). Every date-window decision reads it.
CREATE FUNCTION stats_clock_date()
 RETURNS date
 LANGUAGE sql
 STABLE
AS $function$
    SELECT coalesce(nullif(current_setting('inventory.stats_today', true), '')::date,
                    current_date)
$function$;

CREATE FUNCTION save_manual_pr(p_expected_user_id uuid, p_exercise_id text, p_weight_kg numeric, p_reps integer, p_recorded_on date)
 RETURNS jsonb
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
DECLARE
    v_id bigint;
    v_version bigint;
    v_job bigint;
    v_receipt bigint;
BEGIN
    PERFORM stats_check_owner(p_expected_user_id, p_expected_user_id);
    IF EXISTS (
        SELECT 1 FROM exercises e
        WHERE e.id = p_exercise_id AND e.owner_user_id IS NOT NULL
          AND e.owner_user_id <> p_expected_user_id
    ) THEN
        RAISE EXCEPTION 'a personal exercise of another user' USING ERRCODE = '42501';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM exercises e WHERE e.id = p_exercise_id) THEN
        RAISE EXCEPTION 'exercise_id must name a known exercise, got %',
            left(coalesce(p_exercise_id, 'nothing'), 60) USING ERRCODE = '22023';
    END IF;
    PERFORM stats_checked_weight('weight_kg', p_weight_kg, true);
    IF p_reps IS NULL OR p_reps NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'reps must be a whole number from 1 to 1000, got %',
            coalesce(p_reps::text, 'nothing') USING ERRCODE = '22023';
    END IF;
    PERFORM stats_checked_date('recorded_on', p_recorded_on::text);
    INSERT INTO user_manual_pr_records (user_id, exercise_id, weight_kg, reps, recorded_on)
    VALUES (p_expected_user_id, p_exercise_id, p_weight_kg, p_reps, p_recorded_on)
    RETURNING id INTO v_id;
    v_version := bump_stats_requested_version(p_expected_user_id);
    v_job := enqueue_user_exercise_stats_refresh_job(
        p_expected_user_id, 'manual_pr_changed', p_recorded_on, ARRAY[p_exercise_id],
        'manual PR saved', 'manual_pr:' || v_id, v_version);
    INSERT INTO stats_mutation_receipts
        (user_id, manual_pr_record_id, operation, requested_version)
    VALUES (p_expected_user_id, v_id, 'save', v_version)
    RETURNING id INTO v_receipt;
    RETURN jsonb_build_object('record_id', v_id, 'requested_version', v_version,
                              'receipt_id', v_receipt, 'job_id', v_job);
END
$function$;

CREATE FUNCTION delete_manual_pr(p_expected_user_id uuid, p_record_id bigint)
 RETURNS jsonb
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
DECLARE
    v_old user_manual_pr_records%ROWTYPE;
    v_version bigint;
    v_job bigint;
    v_receipt bigint;
BEGIN
    SELECT * INTO v_old FROM user_manual_pr_records WHERE id = p_record_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no such manual PR record' USING ERRCODE = 'P0002';
    END IF;
    PERFORM stats_check_owner(p_expected_user_id, v_old.user_id);
    DELETE FROM user_manual_pr_records WHERE id = p_record_id;
    v_version := bump_stats_requested_version(v_old.user_id);
    v_job := enqueue_user_exercise_stats_refresh_job(
        v_old.user_id, 'manual_pr_changed', v_old.recorded_on, ARRAY[v_old.exercise_id],
        'manual PR deleted', 'manual_pr:' || p_record_id, v_version);
    INSERT INTO stats_mutation_receipts
        (user_id, manual_pr_record_id, operation, requested_version)
    VALUES (v_old.user_id, p_record_id, 'delete', v_version)
    RETURNING id INTO v_receipt;
    RETURN jsonb_build_object('record_id', p_record_id, 'requested_version', v_version,
                              'receipt_id', v_receipt, 'job_id', v_job);
END
$function$;

CREATE FUNCTION record_catalog_token()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    INSERT INTO catalog_invalidation_tokens AS t (scope, token)
    SELECT coalesce(n.owner_user_id::text, 'global'), count(*)
    FROM new_changes n
    GROUP BY 1
    ORDER BY 1
    ON CONFLICT (scope) DO UPDATE SET token = t.token + EXCLUDED.token, updated_at = now();
    IF EXISTS (SELECT 1 FROM new_changes WHERE owner_user_id IS NULL) THEN
        UPDATE pr_overview_projection_control
        SET catalog_epoch = catalog_epoch + 1, updated_at = now() WHERE id = 1;
    END IF;
    RETURN NULL;
END
$function$;

CREATE FUNCTION log_exercise_change()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO exercise_catalog_changes (exercise_id, owner_user_id, change)
        VALUES (OLD.id, OLD.owner_user_id, TG_OP);
    ELSE
        INSERT INTO exercise_catalog_changes (exercise_id, owner_user_id, change)
        VALUES (NEW.id, NEW.owner_user_id, TG_OP);
    END IF;
    RETURN NULL;
END
$function$;

-- Range merge rules, one definition for the queue, owed ranges and claims. Dates: the
-- earlier wins, NULL (full history) absorbs. Exercise ids: '{}' (every exercise)
-- absorbs, NULL (no exercise: the period stats only) is the identity, else the union.
CREATE FUNCTION stats_merge_from_date(p_a date, p_b date)
 RETURNS date
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT CASE WHEN p_a IS NULL OR p_b IS NULL THEN NULL ELSE least(p_a, p_b) END
$function$;

CREATE FUNCTION stats_merge_exercise_ids(p_a text[], p_b text[])
 RETURNS text[]
 LANGUAGE sql
 IMMUTABLE
AS $function$
    SELECT CASE WHEN p_a IS NULL THEN p_b
                WHEN p_b IS NULL THEN p_a
                WHEN cardinality(p_a) = 0 OR cardinality(p_b) = 0 THEN '{}'::text[]
                ELSE (SELECT array_agg(DISTINCT e ORDER BY e) FROM unnest(p_a || p_b) AS e)
           END
$function$;

-- Owe one failed job's range: merged into the user's owed row with the queue's rules.
CREATE FUNCTION stats_owe_range(p_user_id uuid, p_from_date date, p_exercise_ids text[], p_job_id bigint)
 RETURNS void
 LANGUAGE sql
AS $function$
    INSERT INTO user_stats_owed_ranges AS o (user_id, from_date, exercise_ids, failed_job_ids)
    VALUES (p_user_id, p_from_date, p_exercise_ids, ARRAY[p_job_id])
    ON CONFLICT (user_id) DO UPDATE
    SET from_date = stats_merge_from_date(o.from_date, EXCLUDED.from_date),
        exercise_ids = stats_merge_exercise_ids(o.exercise_ids, EXCLUDED.exercise_ids),
        failed_job_ids = o.failed_job_ids || EXCLUDED.failed_job_ids,
        updated_at = now()
$function$;

CREATE FUNCTION stats_notify_work()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM pg_notify('stats_work', '');
    RETURN NULL;
END
$function$;

-- A job's change wakes a waiting drain only when it can have made work claimable: a
-- merge into a pending job (a claim may have passed the job by while the merge held its
-- row), or a live job ending while its user has a pending successor (claimable from
-- now). A job ending with no successor frees only a lease slot, which a drain waiting
-- for one finds at its recheck: its commit takes no notify queue lock.
CREATE FUNCTION stats_notify_job_change()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF NEW.status = 'pending' OR EXISTS (
        SELECT 1 FROM user_exercise_stats_refresh_jobs j
        WHERE j.user_id = NEW.user_id AND j.status = 'pending'
    ) THEN
        PERFORM pg_notify('stats_work', '');
    END IF;
    RETURN NULL;
END
$function$;

CREATE FUNCTION stats_owe_failed_range()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF OLD.status IS DISTINCT FROM 'failed' THEN
        PERFORM stats_owe_range(NEW.user_id, NEW.from_date, NEW.exercise_ids, NEW.id);
    END IF;
    RETURN NULL;
END
$function$;

-- The caller is the application role (or a member of it), not a trusted service.
CREATE FUNCTION stats_caller_is_application()
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
    SELECT EXISTS (
        SELECT 1 FROM pg_roles r
        WHERE r.rolname = CASE WHEN current_setting('role') = 'none' THEN session_user::text
                               ELSE current_setting('role') END
          AND NOT r.rolsuper
          AND pg_has_role(r.oid, 'inventory_app', 'MEMBER')
    )
$function$;

-- A user's stats are current only when the applied generation is the requested one and
-- no range is owed.
CREATE FUNCTION stats_user_is_stale(p_user_id uuid)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
    SELECT coalesce((SELECT requested_version > applied_version
                     FROM user_stats_refresh_state WHERE user_id = p_user_id), false)
        OR EXISTS (SELECT 1 FROM user_stats_owed_ranges WHERE user_id = p_user_id)
$function$;

-- The PR overview's header for one date: the applied generation whose window serves it,
-- whether the user's stats are stale (a newer generation requested, or a range owed),
-- and how many exercises the window holds. It says stale even when the window holds no
-- exercise, where no row of get_pr_overview could. Fails closed with 55000 unless the
-- applied generation has a window for exactly that date: no other date's window, and no
-- computing at read time.
CREATE FUNCTION get_pr_overview_status(p_user_id uuid, p_as_of date)
 RETURNS TABLE(generation bigint, as_of_date date, stale boolean, exercise_count integer)
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
#variable_conflict use_column
BEGIN
    PERFORM stats_check_owner(p_user_id, p_user_id);
    RETURN QUERY
    SELECT h.generation, h.as_of_date, stats_user_is_stale(p_user_id), h.exercise_count
    FROM user_stats_refresh_state st
    JOIN user_pr_overview_snapshot_headers h
      ON h.user_id = st.user_id AND h.generation = st.applied_version AND h.as_of_date = p_as_of
    WHERE st.user_id = p_user_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no PR overview snapshot for % in the applied generation', p_as_of
            USING ERRCODE = '55000';
    END IF;
END
$function$;

-- The PR overview for one date: one row per exercise of the applied generation's window,
-- each saying whether the stats are stale (get_pr_overview_status, which it reads first,
-- fails closed and says it for a window without rows).
CREATE FUNCTION get_pr_overview(p_user_id uuid, p_as_of date)
 RETURNS TABLE(exercise_id text, best_e1rm_all_time numeric, best_e1rm_30d numeric, best_e1rm_30d_prior_year numeric, heaviest_kg numeric, stale boolean)
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
DECLARE
    v_header record;
BEGIN
    SELECT o.generation, o.stale INTO v_header FROM get_pr_overview_status(p_user_id, p_as_of) o;
    RETURN QUERY
    SELECT s.exercise_id, s.best_e1rm_all_time, s.best_e1rm_30d, s.best_e1rm_30d_prior_year,
           s.heaviest_kg, v_header.stale
    FROM user_pr_exercise_summary_snapshots s
    WHERE s.user_id = p_user_id AND s.generation = v_header.generation
      AND s.as_of_date = p_as_of
    ORDER BY s.exercise_id;
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
CREATE FUNCTION stats_compute_stage(p_run_id bigint, p_lease_token uuid, p_batch_size integer)
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

-- A slot holds its run's lease end while the lease is active (claimed or computed, not
-- waiting out a retry time): a run that finishes or backs off frees its slot at once, a
-- lapsed lease frees it by its end passing. Only the slot's live row follows the run
-- (a slot the run's lapsed lease held before a claim resumed it elsewhere stays free).
CREATE FUNCTION stats_mirror_lease()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    UPDATE stats_lease_slots
    SET lease_until = CASE WHEN stats_run_is_active(NEW.phase, NEW.lease_until,
                                                    NEW.retry_not_before)
                           THEN NEW.lease_until ELSE '-infinity' END
    WHERE slot IN (SELECT l.slot FROM stats_lease_slots l
                   WHERE l.run_id = NEW.id AND l.lease_until > now()
                   -- a slot another claim is filling is no longer this run's
                   FOR UPDATE SKIP LOCKED);
    RETURN NULL;
END
$function$;

-- The cap's rows follow the settings: raising the cap adds rows, lowering it removes the
-- free rows above it (a row still held above it is never taken again and goes with a
-- later change once free).
CREATE FUNCTION stats_fit_lease_slots()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    INSERT INTO stats_lease_slots (slot)
    SELECT s FROM generate_series(1, NEW.active_lease_cap) AS s
    ON CONFLICT (slot) DO NOTHING;
    DELETE FROM stats_lease_slots l
    WHERE l.slot IN (SELECT f.slot FROM stats_lease_slots f
                     WHERE f.slot > NEW.active_lease_cap AND f.lease_until <= now()
                     FOR UPDATE SKIP LOCKED);
    RETURN NULL;
END
$function$;

-- The one lock of a user's worker side: a claim starting the user's job takes it with a
-- try (and passes the user by when another holds it), a publication waits for it.
CREATE FUNCTION stats_user_lock(p_user_id uuid)
 RETURNS bigint
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT hashtextextended('stats_user:' || p_user_id::text, 0) $function$;

-- The session lock a kept-alive drain holds while it lives, taken in its own connection
-- (pg_try_advisory_lock): the database tells a live drain from one whose worker died
-- unseen, which Dagster's run state cannot (such a run stays STARTED until its maximum
-- runtime). The server ends a dead host's session, and the lock with it, within the
-- connection bounds (docs/deployment.md#failure-guarantees).
CREATE FUNCTION stats_drain_lock(p_owner text)
 RETURNS bigint
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT hashtextextended('stats_drain:' || p_owner, 0) $function$;

-- Renew a live lease at a stage boundary: the lease's slot row is locked first (to the
-- commit: no claim can take it meanwhile), then the run's lease end moves (and the
-- slot's with it, by trigger). False when the slot is no longer this run's (its lease
-- lapsed as the stage began and a claim took the slot, whose lock this waited for): the
-- stage then works no further.
CREATE FUNCTION stats_renew_lease(p_run_id bigint, p_lease_seconds integer)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM 1 FROM stats_lease_slots
    WHERE run_id = p_run_id AND lease_until > now()
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE user_stats_projection_runs
    SET lease_until = now() + make_interval(secs => p_lease_seconds)
    WHERE id = p_run_id;
    RETURN true;
END
$function$;

-- A failed attempt of a run: attempt n waits n x retry_backoff_seconds with `p_payload`
-- kept (its cursor, with the batch retries counted, or its computed output); past
-- max_attempts the run and its job fail, the run's private output goes, and the job's
-- range is owed (trigger). `p_sqlstate` is the database error's code when one caused
-- the failure. Returns the retry time (NULL: failed for good).
CREATE FUNCTION stats_fail_attempt(p_run_id bigint, p_error text, p_payload jsonb, p_sqlstate text DEFAULT NULL::text)
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
CREATE FUNCTION stats_give_back_run(p_run_id bigint, p_lease_token uuid, p_lock_owner text, p_stage text, p_sqlstate text, p_budget_spent boolean)
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

-- A payload that will not be published: the run ends with its private output, and its
-- job's range moves into the user's successor job with a generation newer than the
-- applied one (merge-enqueue), so generations never go back.
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

-- The first committed stage: one transaction records an attempt and a lease within the
-- cap. In order: resume a run due to resume under its own token and cursor (its retry
-- time came, or it computes in batches and its worker's lease lapsed: a retry consumed),
-- revive a dead worker's job under a new lease (its run retired, never adopted), else
-- start the oldest pending job of a user with no live job whose lock this claim gets
-- (the user's oldest pending job, so a user's jobs publish in creation order). Nothing
-- while paused or with no free slot; a claim never waits for a lock. A started job past
-- the attempt cap fails (its range owed) and the claim answers it without a run: a
-- transaction carries one owner, and the caller claims again.
CREATE FUNCTION stats_claim_stage(p_lock_owner text, p_user_id uuid)
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

-- The third committed stage: under a live lease, the user's lock and state row, the
-- public projections replaced and applied_version advanced with the PR overview window,
-- or the run rejected into a successor (an older generation, a moved base, a deleted
-- referenced row), or a failed attempt (a value it cannot publish). A wait that runs out
-- (for the user's lock or state row, held by a save in progress), a cancel or a deadlock
-- ends the whole call, and its worker gives the run back (stats_give_back_run).
CREATE FUNCTION stats_publish_stage(p_run_id bigint, p_lease_token uuid)
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

-- A value the worker cannot compute or a reader cannot load is refused before anything
-- is written, with one line naming the field: dates from 0001-01-01 to 9999-12-31 (the
-- period arithmetic needs timestamps, which end in 294276, and a reader's date type
-- ends with year 9999), weights that are finite numbers from 0 to 99999.99 kg (manual
-- PRs above 0), reps from 0 to 1,000 (manual PRs from 1), known exercises, at most
-- 1,000 sets a session and 10,000 characters of notes.
CREATE FUNCTION stats_checked_date(p_field text, p_value text)
 RETURNS date
 LANGUAGE plpgsql
 STABLE
AS $function$
DECLARE
    v_date date;
BEGIN
    BEGIN
        v_date := p_value::date;
    EXCEPTION WHEN data_exception THEN
        RAISE EXCEPTION '% must be a date (YYYY-MM-DD), got %', p_field, left(p_value, 40)
            USING ERRCODE = '22008';
    END;
    IF v_date IS NULL THEN
        RAISE EXCEPTION '% is required', p_field USING ERRCODE = '22008';
    END IF;
    IF NOT v_date BETWEEN DATE '0001-01-01' AND DATE '9999-12-31' THEN
        RAISE EXCEPTION '% must be between 0001-01-01 and 9999-12-31, got %', p_field,
            p_value USING ERRCODE = '22008';
    END IF;
    RETURN v_date;
END
$function$;

CREATE FUNCTION stats_checked_weight(p_field text, p_value numeric, p_minimum_exclusive boolean)
 RETURNS numeric
 LANGUAGE plpgsql
 IMMUTABLE
AS $function$
BEGIN
    IF p_value IS NULL OR p_value = 'NaN'::numeric OR p_value IN ('Infinity', '-Infinity')
       OR p_value < 0 OR (p_minimum_exclusive AND p_value = 0) OR p_value >= 100000 THEN
        RAISE EXCEPTION '% must be a number %, got %', p_field,
            CASE WHEN p_minimum_exclusive THEN 'above 0 and below 100000'
                 ELSE 'from 0 to 99999.99' END,
            coalesce(p_value::text, 'nothing')
            USING ERRCODE = '22023';
    END IF;
    RETURN p_value;
END
$function$;

-- The sets of a session payload, each field checked (its position named in the error).
CREATE FUNCTION stats_checked_sets(p_user_id uuid, p_sets jsonb)
 RETURNS TABLE(exercise_id text, weight_kg numeric, reps integer, warmup boolean, ordinality bigint)
 LANGUAGE plpgsql
 STABLE
AS $function$
#variable_conflict use_column
DECLARE
    v_set jsonb;
    v_n bigint := 0;
    v_value jsonb;
BEGIN
    IF p_sets IS NULL OR jsonb_typeof(p_sets) = 'null' THEN
        RETURN;
    END IF;
    IF jsonb_typeof(p_sets) <> 'array' THEN
        RAISE EXCEPTION 'sets must be an array' USING ERRCODE = '22023';
    END IF;
    IF jsonb_array_length(p_sets) > 1000 THEN
        RAISE EXCEPTION 'sets: at most 1000 a session, got %', jsonb_array_length(p_sets)
            USING ERRCODE = '22023';
    END IF;
    FOR v_set IN SELECT value FROM jsonb_array_elements(p_sets) LOOP
        v_n := v_n + 1;
        IF jsonb_typeof(v_set) <> 'object' THEN
            RAISE EXCEPTION 'sets[%] must be an object', v_n USING ERRCODE = '22023';
        END IF;
        exercise_id := v_set ->> 'exercise_id';
        IF jsonb_typeof(v_set -> 'exercise_id') IS DISTINCT FROM 'string' OR NOT EXISTS (
            SELECT 1 FROM exercises e
            WHERE e.id = exercise_id
              AND (e.owner_user_id IS NULL OR e.owner_user_id = p_user_id)
        ) THEN
            IF EXISTS (SELECT 1 FROM exercises e WHERE e.id = exercise_id) THEN
                RAISE EXCEPTION 'a personal exercise of another user' USING ERRCODE = '42501';
            END IF;
            RAISE EXCEPTION 'sets[%].exercise_id must name a known exercise, got %', v_n,
                left(coalesce(v_set ->> 'exercise_id', 'nothing'), 60)
                USING ERRCODE = '22023';
        END IF;
        v_value := v_set -> 'weight_kg';
        IF jsonb_typeof(v_value) IS DISTINCT FROM 'number' THEN
            RAISE EXCEPTION 'sets[%].weight_kg must be a number, got %', v_n,
                left(coalesce(v_value::text, 'nothing'), 40) USING ERRCODE = '22023';
        END IF;
        weight_kg := stats_checked_weight(format('sets[%s].weight_kg', v_n),
                                          v_value::text::numeric, false);
        v_value := v_set -> 'reps';
        IF jsonb_typeof(v_value) IS DISTINCT FROM 'number'
           OR v_value::text::numeric <> trunc(v_value::text::numeric)
           OR v_value::text::numeric NOT BETWEEN 0 AND 1000 THEN
            RAISE EXCEPTION 'sets[%].reps must be a whole number from 0 to 1000, got %', v_n,
                left(coalesce(v_value::text, 'nothing'), 40) USING ERRCODE = '22023';
        END IF;
        reps := v_value::text::integer;
        v_value := v_set -> 'warmup';
        IF v_value IS NOT NULL AND jsonb_typeof(v_value) NOT IN ('boolean', 'null') THEN
            RAISE EXCEPTION 'sets[%].warmup must be true or false, got %', v_n,
                left(v_value::text, 40) USING ERRCODE = '22023';
        END IF;
        warmup := coalesce((v_value #>> '{}')::boolean, false);
        ordinality := v_n;
        RETURN NEXT;
    END LOOP;
END
$function$;

-- One due user's rollover in one transaction: the next due user after the caller's last
-- one (due order), its rollover row locked and its state row taken without waiting. A
-- user whose newer generation is pending waits for it (that publication builds a fresh
-- window); a busy state row is a failed attempt (backoff 1, 2, 4 ... 60 min); otherwise a
-- new generation is requested (`pr_overview_rollover`: no exercise, the periods from
-- the new date), whose publication builds the window and schedules the next rollover.
-- The applied generation's window is never rewritten. Until that publication the row
-- waits 10 minutes before asking again (a worker down: the request counts as an attempt).
CREATE FUNCTION stats_request_rollover(p_after_due timestamp with time zone, p_after_user uuid)
 RETURNS TABLE(roll_due_at timestamp with time zone, roll_user_id uuid, roll_outcome text)
 LANGUAGE plpgsql
AS $function$
#variable_conflict use_column
DECLARE
    v_user uuid;
    v_due timestamptz;
    v_state record;
    v_backoff interval;
BEGIN
    -- A rollover never waits long for a user's save: one second, then a failed attempt.
    PERFORM set_config('lock_timeout', '1s', true);
    SELECT r.user_id, r.due_at,
           make_interval(mins => least(60, power(2, r.attempt_count)::integer))
    INTO v_user, v_due, v_backoff
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
    SELECT s.requested_version, s.applied_version INTO v_state
    FROM user_stats_refresh_state s
    WHERE s.user_id = v_user
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        UPDATE user_pr_overview_rollover_state
        SET attempt_count = attempt_count + 1,
            last_error = 'stats state locked by a save or publication in progress',
            next_retry_at = now() + v_backoff, due_at = now() + v_backoff,
            updated_at = now()
        WHERE user_id = v_user;
        RETURN QUERY SELECT v_due, v_user, 'failed';
        RETURN;
    END IF;
    IF v_state.requested_version > v_state.applied_version THEN
        UPDATE user_pr_overview_rollover_state
        SET due_at = now() + interval '5 minutes', next_retry_at = now() + interval '5 minutes',
            updated_at = now()
        WHERE user_id = v_user;
        RETURN QUERY SELECT v_due, v_user, 'deferred';
        RETURN;
    END IF;
    BEGIN
        PERFORM enqueue_user_exercise_stats_refresh_job(
            v_user, 'pr_overview_rollover', stats_clock_date(), NULL,
            'PR overview window moved to ' || stats_clock_date(),
            'rollover:' || stats_clock_date(), bump_stats_requested_version(v_user));
    EXCEPTION WHEN lock_not_available THEN
        -- A save of the user holds its enqueue turn past the lock timeout.
        UPDATE user_pr_overview_rollover_state
        SET attempt_count = attempt_count + 1,
            last_error = left(split_part(SQLERRM, E'\n', 1), 200),
            next_retry_at = now() + v_backoff, due_at = now() + v_backoff,
            updated_at = now()
        WHERE user_id = v_user;
        RETURN QUERY SELECT v_due, v_user, 'failed';
        RETURN;
    END;
    UPDATE user_pr_overview_rollover_state
    SET attempt_count = attempt_count + 1, last_error = NULL,
        next_retry_at = now() + interval '10 minutes', due_at = now() + interval '10 minutes',
        updated_at = now()
    WHERE user_id = v_user;
    RETURN QUERY SELECT v_due, v_user, 'requested';
END
$function$;

CREATE TRIGGER user_stats_projection_runs_lease_fence BEFORE UPDATE ON user_stats_projection_runs FOR EACH ROW EXECUTE FUNCTION stats_projection_run_lease_fence();
CREATE TRIGGER exercise_catalog_changes_token AFTER INSERT ON exercise_catalog_changes REFERENCING NEW TABLE AS new_changes FOR EACH STATEMENT EXECUTE FUNCTION record_catalog_token();
CREATE TRIGGER exercises_log_change AFTER INSERT OR DELETE OR UPDATE ON exercises FOR EACH ROW EXECUTE FUNCTION log_exercise_change();
CREATE TRIGGER user_exercise_stats_refresh_jobs_owe_failed AFTER UPDATE OF status ON user_exercise_stats_refresh_jobs FOR EACH ROW WHEN (((new.status)::text = 'failed'::text)) EXECUTE FUNCTION stats_owe_failed_range();
CREATE TRIGGER user_stats_projection_runs_mirror_lease AFTER UPDATE OF phase, lease_until, retry_not_before ON user_stats_projection_runs FOR EACH ROW EXECUTE FUNCTION stats_mirror_lease();
CREATE TRIGGER stats_projection_worker_settings_fit_slots AFTER UPDATE OF active_lease_cap ON stats_projection_worker_settings FOR EACH ROW EXECUTE FUNCTION stats_fit_lease_slots();
CREATE TRIGGER stats_projection_worker_settings_notify AFTER UPDATE ON stats_projection_worker_settings FOR EACH STATEMENT EXECUTE FUNCTION stats_notify_work();
CREATE TRIGGER user_exercise_stats_refresh_jobs_notify_enqueued AFTER INSERT ON user_exercise_stats_refresh_jobs FOR EACH STATEMENT EXECUTE FUNCTION stats_notify_work();
CREATE TRIGGER user_exercise_stats_refresh_jobs_notify_changed AFTER UPDATE ON user_exercise_stats_refresh_jobs FOR EACH ROW WHEN ((((new.status)::text = 'pending'::text) OR (((old.status)::text = 'processing'::text) AND ((new.status)::text <> 'processing'::text)))) EXECUTE FUNCTION stats_notify_job_change();

-- == Who may call and read what =========================================================

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'inventory_app') THEN
        CREATE ROLE inventory_app NOLOGIN;
    END IF;
END
$$;
GRANT USAGE ON SCHEMA public TO inventory_app;
REVOKE ALL ON FUNCTION
    stats_projection_statement_budget(p_stage text),
    stats_projection_run_lease_fence(),
    estimated_one_rep_max(p_weight numeric, p_reps integer),
    bump_stats_requested_version(p_user_id uuid),
    enqueue_user_exercise_stats_refresh_job(p_user_id uuid, p_event_type text, p_from_date date, p_exercise_ids text[], p_reason text, p_source_ref text, p_requested_version bigint),
    stats_check_owner(p_expected_user_id uuid, p_actual_user_id uuid),
    save_training_session(p_expected_user_id uuid, p_session jsonb),
    delete_training_session(p_expected_user_id uuid, p_session_id uuid),
    request_stats_refresh(p_user_id uuid, p_from_date date, p_exercise_ids text[], p_reason text),
    stats_projection_worker_status(),
    stats_clock_date(),
    save_manual_pr(p_expected_user_id uuid, p_exercise_id text, p_weight_kg numeric, p_reps integer, p_recorded_on date),
    delete_manual_pr(p_expected_user_id uuid, p_record_id bigint),
    record_catalog_token(),
    log_exercise_change(),
    stats_merge_from_date(p_a date, p_b date),
    stats_merge_exercise_ids(p_a text[], p_b text[]),
    stats_owe_range(p_user_id uuid, p_from_date date, p_exercise_ids text[], p_job_id bigint),
    stats_owe_failed_range(),
    stats_notify_work(),
    stats_notify_job_change(),
    stats_run_is_active(p_phase text, p_lease_until timestamp with time zone, p_retry_not_before timestamp with time zone),
    stats_caller_is_application(),
    stats_user_is_stale(p_user_id uuid),
    get_pr_overview_status(p_user_id uuid, p_as_of date),
    get_pr_overview(p_user_id uuid, p_as_of date),
    stats_compute_stage(p_run_id bigint, p_lease_token uuid, p_batch_size integer),
    stats_mirror_lease(),
    stats_fit_lease_slots(),
    stats_user_lock(p_user_id uuid),
    stats_drain_lock(p_owner text),
    stats_renew_lease(p_run_id bigint, p_lease_seconds integer),
    stats_fail_attempt(p_run_id bigint, p_error text, p_payload jsonb, p_sqlstate text),
    stats_give_back_run(p_run_id bigint, p_lease_token uuid, p_lock_owner text, p_stage text, p_sqlstate text, p_budget_spent boolean),
    stats_reject_run(p_run_id bigint, p_reason text, p_sqlstate text),
    stats_claim_stage(p_lock_owner text, p_user_id uuid),
    stats_publish_stage(p_run_id bigint, p_lease_token uuid),
    stats_checked_date(p_field text, p_value text),
    stats_checked_weight(p_field text, p_value numeric, p_minimum_exclusive boolean),
    stats_checked_sets(p_user_id uuid, p_sets jsonb),
    stats_request_rollover(p_after_due timestamp with time zone, p_after_user uuid)
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    save_training_session(p_expected_user_id uuid, p_session jsonb),
    delete_training_session(p_expected_user_id uuid, p_session_id uuid),
    request_stats_refresh(p_user_id uuid, p_from_date date, p_exercise_ids text[], p_reason text),
    stats_clock_date(),
    save_manual_pr(p_expected_user_id uuid, p_exercise_id text, p_weight_kg numeric, p_reps integer, p_recorded_on date),
    delete_manual_pr(p_expected_user_id uuid, p_record_id bigint),
    get_pr_overview_status(p_user_id uuid, p_as_of date),
    get_pr_overview(p_user_id uuid, p_as_of date)
TO inventory_app;
GRANT SELECT ON exercises, user_exercise_stats, user_training_period_stats TO inventory_app;
ALTER TABLE user_exercise_stats ENABLE ROW LEVEL SECURITY;
ALTER TABLE user_training_period_stats ENABLE ROW LEVEL SECURITY;
CREATE POLICY user_exercise_stats_own ON user_exercise_stats FOR SELECT TO inventory_app
    USING (user_id = stats_current_user_id());
CREATE POLICY user_training_period_stats_own ON user_training_period_stats FOR SELECT TO inventory_app
    USING (user_id = stats_current_user_id());

-- == The rows the worker starts from ===================================================

INSERT INTO stats_projection_worker_settings (id) VALUES (1);
INSERT INTO stats_lease_slots (slot) SELECT generate_series(1, 2);
INSERT INTO pr_overview_projection_control (id) VALUES (1);
INSERT INTO stats_scan_cursor (id) VALUES (1);
INSERT INTO stats_refresh_event_types (id, description) VALUES
    ('session_saved', 'a completed session was created or updated'),
    ('session_deleted', 'a completed session was deleted'),
    ('manual_pr_changed', 'a manual PR record changed'),
    ('catalog_changed', 'the exercise catalog changed'),
    ('pr_overview_rollover', 'the PR overview date window moved'),
    ('scheduled_stats_backfill', 'the backfill scanner found missing projections'),
    ('analyst_rebuild', 'an operator asked for a rebuild'),
    ('manual_refresh', 'an explicit refresh request');
