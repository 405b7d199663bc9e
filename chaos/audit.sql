-- Harness instrumentation, installed only into the harness's own scratch database (never
-- a migration): triggers write every claim, acknowledgement, release and publication
-- down, so the checks after quiescence can prove, independently of the guards they
-- test, that no work was acknowledged by a lost claim and that nothing went backwards.
--
-- Events are ordered by one sequence and timed by clock_timestamp(), never by now():
-- now() is the transaction's start, the very clock the product's guards compare
-- leases with, so an audit built on it would agree with a broken guard. Events on one
-- row are serialized by its row lock, so their sequence numbers follow commit order.
--
-- completing_token: the lease token the session declared it completes with
-- (chaos.completing_token). The product's statements bind the token in their guards
-- but write it nowhere; the declaration is what tells a stale worker's write from the
-- live claim's. Sessions that declare nothing (Dagster runs) leave it empty.
-- actor: the session's application_name (chaos.<role>.<pid> for the harness's workers).
-- The trigger functions run with the harness's rights (SECURITY DEFINER): a writer
-- role with rights on the items table only must not be refused by the audit.

CREATE SEQUENCE chaos_event_seq;

CREATE FUNCTION chaos_declared_token() RETURNS text LANGUAGE sql STABLE AS $$
    SELECT coalesce(current_setting('chaos.completing_token', true), '')
$$;

CREATE TABLE chaos_profile_claims (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    request_id bigint NOT NULL,
    library_id bigint NOT NULL,
    lease_token uuid NOT NULL,
    attempt integer NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    lease_expires_at timestamptz NOT NULL,
    actor text NOT NULL DEFAULT current_setting('application_name'),
    server_id bigint,  -- the library's server when claimed
    -- The claiming statement's start: its reads of the library are no older.
    statement_at timestamptz NOT NULL DEFAULT statement_timestamp()
);
-- Every transition into `succeeded`, from whatever status (an unguarded write from
-- `pending` is an acknowledgement too), and every row inserted as succeeded.
CREATE TABLE chaos_profile_acks (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    request_id bigint NOT NULL,
    library_id bigint NOT NULL,
    from_status text,
    lease_token uuid,
    completing_token text NOT NULL DEFAULT chaos_declared_token(),
    acked_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    lease_expires_at timestamptz,
    actor text NOT NULL DEFAULT current_setting('application_name')
);
-- A claim that ended without success: failed by its holder, or recovered after its
-- lease ran out (the attempt is spent either way).
CREATE TABLE chaos_profile_lapses (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    request_id bigint NOT NULL,
    library_id bigint NOT NULL,
    lease_token uuid NOT NULL,
    attempt integer NOT NULL,
    to_status text NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    ended_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    completing_token text NOT NULL DEFAULT chaos_declared_token(),
    actor text NOT NULL DEFAULT current_setting('application_name')
);
CREATE FUNCTION chaos_profile_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.status = 'succeeded' THEN
            INSERT INTO chaos_profile_acks (request_id, library_id, from_status)
            VALUES (NEW.id, NEW.library_id, NULL);
        END IF;
        IF NEW.status = 'running' THEN
            INSERT INTO chaos_profile_claims
                (request_id, library_id, lease_token, attempt, lease_expires_at, server_id)
            VALUES (NEW.id, NEW.library_id, NEW.lease_token, NEW.attempts, NEW.lease_expires_at,
                    (SELECT l.server_id FROM libraries l WHERE l.id = NEW.library_id));
        END IF;
        RETURN NULL;
    END IF;
    IF NEW.status = 'running' AND NEW.lease_token IS DISTINCT FROM OLD.lease_token THEN
        INSERT INTO chaos_profile_claims
            (request_id, library_id, lease_token, attempt, lease_expires_at, server_id)
        VALUES (NEW.id, NEW.library_id, NEW.lease_token, NEW.attempts, NEW.lease_expires_at,
                (SELECT l.server_id FROM libraries l WHERE l.id = NEW.library_id));
    ELSIF NEW.status = 'succeeded' AND OLD.status IS DISTINCT FROM 'succeeded' THEN
        INSERT INTO chaos_profile_acks
            (request_id, library_id, from_status, lease_token, lease_expires_at)
        VALUES (OLD.id, OLD.library_id, OLD.status, OLD.lease_token, OLD.lease_expires_at);
    ELSIF OLD.status = 'running' AND NEW.status IN ('pending', 'failed') THEN
        INSERT INTO chaos_profile_lapses
            (request_id, library_id, lease_token, attempt, to_status, lease_expires_at)
        VALUES (OLD.id, OLD.library_id, OLD.lease_token, OLD.attempts, NEW.status,
                OLD.lease_expires_at);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_profile_audit AFTER INSERT OR UPDATE ON profile_refresh_requests
    FOR EACH ROW EXECUTE FUNCTION chaos_profile_audit();

-- Every write of a stored profile, to prove its inventory_revision never goes back.
CREATE TABLE chaos_profile_writes (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    library_id bigint NOT NULL,
    operation text NOT NULL,
    inventory_revision bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_profile_write_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO chaos_profile_writes (library_id, operation, inventory_revision)
        VALUES (OLD.library_id, TG_OP, OLD.inventory_revision);
    ELSE
        INSERT INTO chaos_profile_writes (library_id, operation, inventory_revision)
        VALUES (NEW.library_id, TG_OP, NEW.inventory_revision);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_profile_write_audit AFTER INSERT OR UPDATE OR DELETE ON library_profiles
    FOR EACH ROW EXECUTE FUNCTION chaos_profile_write_audit();

CREATE TABLE chaos_regressions (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    what text NOT NULL,
    detail text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_acknowledged_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.acknowledged_revision < OLD.acknowledged_revision OR NEW.revision < OLD.revision THEN
        INSERT INTO chaos_regressions (what, detail) VALUES ('library revision went back',
            format('library %s: revision %s -> %s, acknowledged %s -> %s', NEW.library_id,
                   OLD.revision, NEW.revision, OLD.acknowledged_revision, NEW.acknowledged_revision));
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_acknowledged_audit AFTER UPDATE ON library_inventory_state
    FOR EACH ROW EXECUTE FUNCTION chaos_acknowledged_audit();

-- Every change of a user's applied generation, with the transaction that made it: a
-- publication is joined to its own change (what applied was before it, and after).
CREATE TABLE chaos_applied_changes (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    user_id uuid NOT NULL,
    old_applied bigint NOT NULL,
    new_applied bigint NOT NULL,
    txid bigint NOT NULL DEFAULT txid_current(),
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_applied_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.applied_version < OLD.applied_version OR NEW.requested_version < OLD.requested_version THEN
        INSERT INTO chaos_regressions (what, detail) VALUES ('stats version went back',
            format('user %s: requested %s -> %s, applied %s -> %s', NEW.user_id,
                   OLD.requested_version, NEW.requested_version, OLD.applied_version, NEW.applied_version));
    END IF;
    IF NEW.applied_version IS DISTINCT FROM OLD.applied_version THEN
        INSERT INTO chaos_applied_changes (user_id, old_applied, new_applied)
        VALUES (NEW.user_id, OLD.applied_version, NEW.applied_version);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_applied_audit AFTER UPDATE ON user_stats_refresh_state
    FOR EACH ROW EXECUTE FUNCTION chaos_applied_audit();

-- Stats publications: the publishing transaction must have begun while the run's lease
-- was live, by its holder. (A publication locks its run and checks the lease as it
-- begins; one that outlasts the rest of its lease is safe because it re-checks the
-- published base under the user's lock, so its end may fall after the lease.) Each
-- records the generation it published (target), the base it was computed on, the
-- applied generation after it, and who published it: the worker's process id (from
-- the session name) and the server process, since two processes can resume one token.
-- product_token is the token the product's publish stage declared for its fence; a
-- drain loop declares nothing to the harness, so its publication is judged by that.
CREATE TABLE chaos_stats_publications (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    run_id bigint NOT NULL,
    user_id uuid NOT NULL,
    lease_token uuid NOT NULL,
    completing_token text NOT NULL DEFAULT chaos_declared_token(),
    product_token text NOT NULL
        DEFAULT coalesce(current_setting('inventory.stats_lease_token', true), ''),
    lease_until timestamptz NOT NULL,
    target_version bigint NOT NULL,
    base_version bigint NOT NULL,
    applied_version bigint,
    mode text,  -- the manifest's compute mode: single or batched
    worker_pid integer DEFAULT substring(current_setting('application_name') FROM '[.]([0-9]+)$')::integer,
    backend_pid integer NOT NULL DEFAULT pg_backend_pid(),
    txid bigint NOT NULL DEFAULT txid_current(),
    began_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor text NOT NULL DEFAULT current_setting('application_name')
);
CREATE FUNCTION chaos_publication_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.phase = 'published' AND OLD.phase IS DISTINCT FROM 'published' THEN
        INSERT INTO chaos_stats_publications (run_id, user_id, lease_token, lease_until,
            target_version, base_version, applied_version, mode)
        VALUES (NEW.id, NEW.user_id, OLD.lease_token, OLD.lease_until, NEW.target_version,
                NEW.base_applied_version,
                (SELECT s.applied_version FROM user_stats_refresh_state s
                 WHERE s.user_id = NEW.user_id),
                coalesce(NEW.payload #>> '{manifest,mode}', OLD.payload #>> '{manifest,mode}'));
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_publication_audit AFTER UPDATE ON user_stats_projection_runs
    FOR EACH ROW EXECUTE FUNCTION chaos_publication_audit();

-- Every step of a stats run (a claim, each compute call that moved its payload or
-- phase) and who took it: a batch run resumed under its token may be stepped by
-- several processes in turn, never two at once (its row lock).
-- A step of a live claim (from_phase claimed or computed) is the lease holder's: its
-- transaction declared the run's token (product_token) and began (began_at, the clock
-- the stages check the lease with) before the lease ended (lease_until, the lease as
-- it stood before the step), unless it is the expiry recovery retiring a lapsed lease
-- (error 'lease expired').
CREATE TABLE chaos_stats_steps (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    run_id bigint NOT NULL,
    phase text NOT NULL,
    worker_pid integer DEFAULT substring(current_setting('application_name') FROM '[.]([0-9]+)$')::integer,
    backend_pid integer NOT NULL DEFAULT pg_backend_pid(),
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    from_phase text,
    lease_token uuid,
    lease_until timestamptz,
    product_token text NOT NULL
        DEFAULT coalesce(current_setting('inventory.stats_lease_token', true), ''),
    error text,
    began_at timestamptz NOT NULL DEFAULT now()
);
CREATE FUNCTION chaos_stats_step_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO chaos_stats_steps (run_id, phase) VALUES (NEW.id, NEW.phase);
    ELSIF NEW.payload IS DISTINCT FROM OLD.payload OR NEW.phase IS DISTINCT FROM OLD.phase THEN
        INSERT INTO chaos_stats_steps (run_id, phase, from_phase, lease_token, lease_until,
                                       error)
        VALUES (NEW.id, NEW.phase, OLD.phase, OLD.lease_token, OLD.lease_until, NEW.error);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_stats_step_audit AFTER INSERT OR UPDATE ON user_stats_projection_runs
    FOR EACH ROW EXECUTE FUNCTION chaos_stats_step_audit();

-- Jobs that ended failed (attempts exhausted, or a non-retryable error): each one's
-- range must still be owed, never silently dropped.
CREATE TABLE chaos_stats_job_failures (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    job_id bigint NOT NULL,
    user_id uuid NOT NULL,
    requested_version bigint NOT NULL,
    from_date date,
    exercise_ids text[],  -- NULL: no exercise (period stats only)
    error text,
    failed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_job_failure_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.status = 'failed' AND OLD.status IS DISTINCT FROM 'failed' THEN
        INSERT INTO chaos_stats_job_failures
            (job_id, user_id, requested_version, from_date, exercise_ids, error)
        VALUES (NEW.id, NEW.user_id, NEW.requested_version, NEW.from_date, NEW.exercise_ids,
                NEW.error_message);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_job_failure_audit AFTER UPDATE ON user_exercise_stats_refresh_jobs
    FOR EACH ROW EXECUTE FUNCTION chaos_job_failure_audit();

-- Every write of a generation-labelled row, per statement and user: the lowest and
-- highest generation it wrote. A user's generations must never go back in any table
-- (the projections, the PR overview headers, the rollover state).
CREATE TABLE chaos_generation_writes (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    what text NOT NULL,
    user_id uuid NOT NULL,
    min_generation bigint NOT NULL,
    max_generation bigint NOT NULL,
    txid bigint NOT NULL DEFAULT txid_current(),
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_generation_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    INSERT INTO chaos_generation_writes (what, user_id, min_generation, max_generation)
    SELECT TG_TABLE_NAME, w.user_id, min(w.generation), max(w.generation)
    FROM written w GROUP BY w.user_id ORDER BY w.user_id;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_exercise_generation_insert AFTER INSERT ON user_exercise_stats
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION chaos_generation_audit();
CREATE TRIGGER chaos_exercise_generation_update AFTER UPDATE ON user_exercise_stats
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION chaos_generation_audit();
CREATE TRIGGER chaos_period_generation_insert AFTER INSERT ON user_training_period_stats
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION chaos_generation_audit();
CREATE TRIGGER chaos_period_generation_update AFTER UPDATE ON user_training_period_stats
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION chaos_generation_audit();
CREATE TRIGGER chaos_header_generation_insert AFTER INSERT ON user_pr_overview_snapshot_headers
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION chaos_generation_audit();
CREATE TRIGGER chaos_header_generation_update AFTER UPDATE ON user_pr_overview_snapshot_headers
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION chaos_generation_audit();
CREATE FUNCTION chaos_rollover_generation_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.snapshot_generation IS NOT NULL THEN
        INSERT INTO chaos_generation_writes (what, user_id, min_generation, max_generation)
        VALUES (TG_TABLE_NAME, NEW.user_id, NEW.snapshot_generation, NEW.snapshot_generation);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_rollover_generation AFTER INSERT OR UPDATE ON user_pr_overview_rollover_state
    FOR EACH ROW EXECUTE FUNCTION chaos_rollover_generation_audit();

-- Observation completions: the completing token must be the item's latest claim and the
-- source must not have changed since that claim.
CREATE TABLE chaos_item_claims (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    item_id bigint NOT NULL,
    lease_token uuid NOT NULL,
    source_generation bigint NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_item_completions (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    item_id bigint NOT NULL,
    lease_token uuid,  -- the item's claim when the completion wrote (NULL: none)
    completing_token text NOT NULL DEFAULT chaos_declared_token(),
    source_generation bigint NOT NULL,
    completed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- A claim given back without an attempt counted (released unsent, or given back after an
-- interruption), with how long after the give-back its item is due (due_in_seconds).
CREATE TABLE chaos_item_givebacks (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    item_id bigint NOT NULL,
    lease_token uuid NOT NULL,
    source_generation bigint NOT NULL,
    due_in_seconds double precision NOT NULL,
    given_back_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- The claims an observer reported `interrupted` (its answer could not be saved), written
-- by the harness's observers: whether it was observed under an approved replacement
-- (such a claim is due whatever its item's due time).
CREATE TABLE chaos_interruptions (
    item_id bigint NOT NULL,
    lease_token uuid NOT NULL,
    replacement boolean NOT NULL
);
-- Credential wakeup releases: one row per released case, grouped into batches by the
-- releasing transaction; xact_start is that transaction's start (the instant the
-- spacing is measured from), released_at the event clock.
-- open_auth: the item held an open authentication case; own_kind: its library is of the
-- item's media kind; jitter_seconds: how long after the release the item is due. Whether
-- the library and its server were active is judged from chaos_activity at the
-- releasing statement's start (statement_at): a fresh read here could see a
-- deactivation that committed after the release read the library.
CREATE TABLE chaos_wakeup_releases (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    item_id bigint NOT NULL,
    generation uuid NOT NULL,
    batch bigint NOT NULL DEFAULT txid_current(),
    xact_start timestamptz NOT NULL DEFAULT now(),
    released_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    open_auth boolean,
    own_kind boolean,
    jitter_seconds double precision,
    library_id bigint,
    server_id bigint,
    statement_at timestamptz NOT NULL DEFAULT statement_timestamp()
);
CREATE FUNCTION chaos_item_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.observation_lease_token IS NOT NULL
       AND NEW.observation_lease_token IS DISTINCT FROM OLD.observation_lease_token THEN
        INSERT INTO chaos_item_claims (item_id, lease_token, source_generation)
        VALUES (NEW.id, NEW.observation_lease_token, NEW.source_generation);
    ELSIF NEW.observation_attempts > OLD.observation_attempts THEN
        INSERT INTO chaos_item_completions (item_id, lease_token, source_generation)
        VALUES (NEW.id, OLD.observation_lease_token, NEW.source_generation);
    ELSIF NEW.observation_lease_token IS NULL AND OLD.observation_lease_token IS NOT NULL
          AND NEW.source_generation = OLD.source_generation THEN
        INSERT INTO chaos_item_givebacks (item_id, lease_token, source_generation,
                                          due_in_seconds)
        VALUES (NEW.id, OLD.observation_lease_token, NEW.source_generation,
                extract(epoch FROM NEW.observation_due_at - clock_timestamp()));
    END IF;
    IF NEW.recovery_wakeup_generation IS NOT NULL
       AND NEW.recovery_wakeup_generation IS DISTINCT FROM OLD.recovery_wakeup_generation THEN
        INSERT INTO chaos_wakeup_releases (item_id, generation, open_auth, own_kind,
                                           jitter_seconds, library_id, server_id)
        SELECT NEW.id, NEW.recovery_wakeup_generation,
               coalesce(OLD.recovery_category = 'auth', false)
                   AND OLD.recovery_resolved_at IS NULL,
               coalesce(l.media_kind = NEW.provider_kind, false),
               extract(epoch FROM NEW.observation_due_at - now()), NEW.library_id, l.server_id
        FROM (SELECT 1) AS one
        LEFT JOIN libraries l ON l.id = NEW.library_id;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_item_audit AFTER UPDATE ON media_server_items
    FOR EACH ROW EXECUTE FUNCTION chaos_item_audit();

-- Verifications of a credential generation, with the probe lease they completed under
-- and the settings' generation when they wrote (the completing statement holds the
-- settings row in share mode, so this read is the configuration it verified against).
CREATE TABLE chaos_verifications (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    generation uuid NOT NULL,
    lease_token uuid,
    lease_generation uuid,
    lease_expires_at timestamptz,
    completing_token text NOT NULL DEFAULT chaos_declared_token(),
    settings_generation uuid,
    settings_active boolean,
    verified_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor text NOT NULL DEFAULT current_setting('application_name')
);
CREATE FUNCTION chaos_verification_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.verified_generation IS NOT NULL
       AND (NEW.verified_generation IS DISTINCT FROM OLD.verified_generation
            OR NEW.verified_at IS DISTINCT FROM OLD.verified_at) THEN
        INSERT INTO chaos_verifications (generation, lease_token, lease_generation,
            lease_expires_at, settings_generation, settings_active)
        SELECT NEW.verified_generation, OLD.probe_lease_token, OLD.probe_generation,
               OLD.probe_lease_expires_at, s.credential_generation, s.active
        FROM provider_settings s WHERE s.provider = NEW.provider;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_verification_audit AFTER UPDATE ON credential_wakeups
    FOR EACH ROW EXECUTE FUNCTION chaos_verification_audit();

-- Faults the harness injected that end sessions it does not own (a server restart),
-- so that a claim whose holder they killed is not mistaken for one never worked on.
CREATE TABLE chaos_faults (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    kind text NOT NULL,
    started_at timestamptz NOT NULL,
    ended_at timestamptz NOT NULL
);

-- Replacement identities (docs/identity-revalidation.md#invariants). Every observation
-- written, with the item's own TMDb id and whether an approved proposal of the same
-- source named the observed id at that moment: the trigger fires at the end of the
-- writing statement, which holds the item row, so it reads the source observed.
CREATE TABLE chaos_observation_writes (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    item_id bigint NOT NULL,
    source_generation bigint NOT NULL,
    tmdb_id bigint NOT NULL,
    own_tmdb_id integer,
    approved boolean NOT NULL,
    written_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor text NOT NULL DEFAULT current_setting('application_name')
);
CREATE FUNCTION chaos_observation_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    INSERT INTO chaos_observation_writes (item_id, source_generation, tmdb_id, own_tmdb_id,
                                          approved)
    SELECT NEW.item_id, NEW.source_generation, NEW.tmdb_id, tmdb_id_of(i.provider_id),
           EXISTS (SELECT 1 FROM replacement_proposals p
                   WHERE p.item_id = NEW.item_id AND p.state = 'approved'
                     AND p.source_generation = NEW.source_generation
                     AND p.candidate_tmdb_id = NEW.tmdb_id)
    FROM media_server_items i WHERE i.id = NEW.item_id;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_observation_audit AFTER INSERT OR UPDATE ON provider_observations
    FOR EACH ROW EXECUTE FUNCTION chaos_observation_audit();

-- The merges the workload injected at the stand-in, and whether the revalidation must
-- propose them (for an item of that kind and id with exactly `title` and a year within
-- one of `year`): a broken round trip, an ambiguous lookup, or a survivor of another
-- title or year must not be.
CREATE TABLE chaos_merges (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    provider_kind text NOT NULL,
    merged_id integer NOT NULL,
    into_id integer NOT NULL,
    title text NOT NULL,
    year integer,
    variant text NOT NULL,
    corroborated boolean NOT NULL,
    merged_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Every error a product path recorded in a row, with the SQLSTATE it stored beside it
-- (NULL: not a database error): a path that turns a database error into a failed
-- attempt or a failed stats run must not hide a deadlock, a constraint or SQL error, or
-- a fence's refusal among its expected outcomes.
CREATE TABLE chaos_recorded_errors (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    path text NOT NULL,
    sqlstate text,
    error text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor text NOT NULL DEFAULT current_setting('application_name')
);
CREATE FUNCTION chaos_recorded_error_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF TG_TABLE_NAME = 'profile_refresh_requests' THEN
        -- A claim that ended without success: a failed attempt or an expired lease.
        IF OLD.status = 'running' AND NEW.status IN ('pending', 'failed')
           AND NEW.last_error IS NOT NULL THEN
            INSERT INTO chaos_recorded_errors (path, sqlstate, error)
            VALUES ('profile refresh attempt', NEW.last_error_sqlstate, NEW.last_error);
        END IF;
    ELSIF NEW.error IS NOT NULL AND (NEW.error, NEW.error_sqlstate, NEW.attempts, NEW.phase)
            IS DISTINCT FROM (OLD.error, OLD.error_sqlstate, OLD.attempts, OLD.phase) THEN
        INSERT INTO chaos_recorded_errors (path, sqlstate, error)
        VALUES ('stats run', NEW.error_sqlstate, NEW.error);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_recorded_error_audit AFTER UPDATE ON profile_refresh_requests
    FOR EACH ROW EXECUTE FUNCTION chaos_recorded_error_audit();
CREATE TRIGGER chaos_recorded_error_audit AFTER UPDATE ON user_stats_projection_runs
    FOR EACH ROW EXECUTE FUNCTION chaos_recorded_error_audit();

-- When a library or a server turned active or inactive, timed as the change commits (a
-- deferred trigger: the writing statement's other triggers may take long): no claim
-- may start at a library inactive by then (its running work may finish).
CREATE TABLE chaos_activity (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    kind text NOT NULL,  -- library or server
    id bigint NOT NULL,
    active boolean NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_activity_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.active IS DISTINCT FROM OLD.active THEN
        INSERT INTO chaos_activity (kind, id, active)
        VALUES (CASE TG_TABLE_NAME WHEN 'libraries' THEN 'library' ELSE 'server' END,
                NEW.id, NEW.active);
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER chaos_activity_audit AFTER UPDATE OF active ON libraries
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION chaos_activity_audit();
CREATE CONSTRAINT TRIGGER chaos_activity_audit AFTER UPDATE OF active ON media_servers
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION chaos_activity_audit();

-- Every stats lease granted (a run turning active: claimed or computed, its lease live,
-- no retry pending), with the active leases counted as it was granted (itself
-- included), how many of those may have been granted under an earlier cap (their
-- claiming statement began before the cap last changed, plus a second), and the cap.
-- Leases granted under the current cap never outnumber it (a lowered cap lets the
-- leases above it run out). A cap change is timed as it commits (a deferred trigger);
-- a grant whose own statement began within a second of it (raced) may have read the
-- older cap and is not judged.
CREATE TABLE chaos_stats_cap_changes (
    cap integer NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_stats_cap_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    INSERT INTO chaos_stats_cap_changes (cap) VALUES (NEW.active_lease_cap);
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER chaos_stats_cap_audit AFTER UPDATE OF active_lease_cap
    ON stats_projection_worker_settings DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION chaos_stats_cap_audit();
CREATE TABLE chaos_stats_grants (
    seq bigint NOT NULL DEFAULT nextval('chaos_event_seq'),
    run_id bigint NOT NULL,
    live integer NOT NULL,
    earlier integer NOT NULL,
    cap integer NOT NULL,
    raced boolean NOT NULL,
    statement_at timestamptz NOT NULL DEFAULT statement_timestamp(),
    granted_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- The product's stats_run_is_active, on the event clock: that one compares with now(),
-- the transaction's start, which a long transaction would hold back.
CREATE FUNCTION chaos_stats_active(r user_stats_projection_runs) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT r.phase IN ('claimed', 'computed') AND r.lease_until > clock_timestamp()
           AND r.retry_not_before IS NULL
$$;
CREATE FUNCTION chaos_stats_grant_audit() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF chaos_stats_active(NEW)
       AND (TG_OP = 'INSERT' OR NOT chaos_stats_active(OLD)
            OR NEW.lease_token IS DISTINCT FROM OLD.lease_token) THEN
        INSERT INTO chaos_stats_grants (run_id, live, earlier, cap, raced)
        SELECT NEW.id, count(*),
               count(*) FILTER (WHERE r.id <> NEW.id
                                  AND (SELECT max(g.statement_at) FROM chaos_stats_grants g
                                       WHERE g.run_id = r.id)
                                      < c.changed_at + interval '1 second'),
               (SELECT s.active_lease_cap FROM stats_projection_worker_settings s),
               coalesce(c.changed_at > statement_timestamp() - interval '1 second', false)
        FROM user_stats_projection_runs r
        CROSS JOIN (SELECT max(changed_at) AS changed_at FROM chaos_stats_cap_changes) c
        WHERE chaos_stats_active(r)
        GROUP BY c.changed_at;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_stats_grant_audit AFTER INSERT OR UPDATE ON user_stats_projection_runs
    FOR EACH ROW EXECUTE FUNCTION chaos_stats_grant_audit();
