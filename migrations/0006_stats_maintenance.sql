-- Seed 001 (Korean sections, D10): PR overview snapshots with a three-day window and a
-- fail-closed reader, rollover, catalog invalidation tokens, manual PR writes, the
-- backfill scanner and history retention.

-- The database date, overridable per session (tests and replays set it; nothing else
-- does). Every date-window decision reads it.
CREATE FUNCTION stats_clock_date() RETURNS date
LANGUAGE sql STABLE
AS $$
    SELECT coalesce(nullif(current_setting('inventory.stats_today', true), '')::date,
                    current_date)
$$;

CREATE TABLE pr_overview_projection_control (
    id integer PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    catalog_epoch bigint NOT NULL DEFAULT 1,
    updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO pr_overview_projection_control DEFAULT VALUES;

CREATE TABLE user_pr_overview_rollover_state (
    user_id uuid PRIMARY KEY,
    due_at timestamptz NOT NULL,
    snapshot_generation bigint,
    applied_catalog_epoch bigint,
    window_end date,
    attempt_count integer NOT NULL DEFAULT 0,
    next_retry_at timestamptz,
    last_error text,
    last_success_at timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX user_pr_overview_rollover_due ON user_pr_overview_rollover_state (due_at, user_id);

CREATE TABLE user_pr_overview_snapshot_headers (
    user_id uuid NOT NULL,
    generation bigint NOT NULL,
    as_of_date date NOT NULL,
    catalog_epoch bigint NOT NULL,
    exercise_count integer NOT NULL,
    built_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, generation, as_of_date)
);

CREATE TABLE user_pr_exercise_summary_snapshots (
    user_id uuid NOT NULL,
    generation bigint NOT NULL,
    as_of_date date NOT NULL,
    exercise_id text NOT NULL,
    best_e1rm_all_time numeric(9, 2),
    best_e1rm_30d numeric(9, 2),
    best_e1rm_30d_prior_year numeric(9, 2),
    heaviest_kg numeric(7, 2),
    PRIMARY KEY (user_id, generation, as_of_date, exercise_id),
    FOREIGN KEY (user_id, generation, as_of_date)
        REFERENCES user_pr_overview_snapshot_headers (user_id, generation, as_of_date)
        ON DELETE CASCADE
);

-- The fail-closed reader: exactly the requested date in the applied generation, or
-- SQLSTATE 55000. No other-date reuse, no read-time computation.
CREATE FUNCTION get_pr_overview(p_user_id uuid, p_as_of date)
RETURNS TABLE (
    exercise_id text,
    best_e1rm_all_time numeric,
    best_e1rm_30d numeric,
    best_e1rm_30d_prior_year numeric,
    heaviest_kg numeric
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
DECLARE
    v_generation bigint;
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
    RETURN QUERY
    SELECT s.exercise_id, s.best_e1rm_all_time, s.best_e1rm_30d, s.best_e1rm_30d_prior_year,
           s.heaviest_kg
    FROM user_pr_exercise_summary_snapshots s
    WHERE s.user_id = p_user_id AND s.generation = v_generation AND s.as_of_date = p_as_of
    ORDER BY s.exercise_id;
END
$$;

-- Manual PR writes go through the queue like sessions: the next generation refreshes
-- the affected exercise's snapshot (and every other one of that generation).
CREATE FUNCTION save_manual_pr(
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

CREATE FUNCTION delete_manual_pr(p_expected_user_id uuid, p_record_id bigint) RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
DECLARE
    v_old user_manual_pr_records%ROWTYPE;
    v_version bigint;
    v_job bigint;
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
    RETURN jsonb_build_object('record_id', p_record_id, 'requested_version', v_version,
                              'job_id', v_job);
END
$$;

-- Catalog invalidation (D10). Every catalog change is logged; the log insert records a
-- per-scope token in the same transaction. Tokens count changes in commit order (the
-- scope row serializes writers), so a late commit of a lower sequence still moves the
-- token, and pruning the log loses nothing: processors work from tokens.
CREATE TABLE exercise_catalog_changes (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    exercise_id text NOT NULL,
    owner_user_id uuid,
    change text NOT NULL CHECK (change IN ('INSERT', 'UPDATE', 'DELETE')),
    changed_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE catalog_invalidation_tokens (
    scope text PRIMARY KEY,          -- 'global' or a user id
    token bigint NOT NULL DEFAULT 0,
    processed_token bigint NOT NULL DEFAULT 0,
    pass_token bigint,               -- the token a running global pass answers
    cursor uuid,                     -- the global pass's keyset position over users
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION record_catalog_token() RETURNS trigger
LANGUAGE plpgsql
AS $$
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
$$;
CREATE TRIGGER exercise_catalog_changes_token
    AFTER INSERT ON exercise_catalog_changes
    REFERENCING NEW TABLE AS new_changes
    FOR EACH STATEMENT EXECUTE FUNCTION record_catalog_token();

CREATE FUNCTION log_exercise_change() RETURNS trigger
LANGUAGE plpgsql
AS $$
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
$$;
CREATE TRIGGER exercises_log_change
    AFTER INSERT OR UPDATE OR DELETE ON exercises
    FOR EACH ROW EXECUTE FUNCTION log_exercise_change();

-- Retention and scanner indexes.
CREATE INDEX stats_runs_job_finished ON user_stats_projection_runs (job_id)
    WHERE finished_at IS NOT NULL;
CREATE INDEX user_exercise_stats_user ON user_exercise_stats (user_id, generation);

REVOKE ALL ON FUNCTION stats_clock_date() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION stats_clock_date() TO inventory_app;
REVOKE ALL ON FUNCTION
    get_pr_overview(uuid, date),
    save_manual_pr(uuid, text, numeric, integer, date),
    delete_manual_pr(uuid, bigint)
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    get_pr_overview(uuid, date),
    save_manual_pr(uuid, text, numeric, integer, date),
    delete_manual_pr(uuid, bigint)
TO inventory_app;
