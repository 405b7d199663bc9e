-- Seed 003: provider observation against TMDb and one durable, item-scoped recovery
-- record per item, plus the provider settings and the shared admission limiter.

-- Provider settings live in the database (key, active flag, language); seed 004 adds
-- the credential generation on top.
CREATE TABLE provider_settings (
    provider text PRIMARY KEY CHECK (provider = 'tmdb'),
    api_key text,
    active boolean NOT NULL DEFAULT false,
    language text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT provider_settings_active_needs_key CHECK (NOT active OR api_key IS NOT NULL)
);
INSERT INTO provider_settings (provider) VALUES ('tmdb');

-- The shared admission limiter: one row per provider. A request is admitted by moving
-- next_admission_at forward one interval (a reservation); nothing stays locked while
-- the request is in flight, and every process and machine shares the same row.
CREATE TABLE provider_admission (
    bucket text PRIMARY KEY,
    requests_per_second double precision NOT NULL
        CHECK (requests_per_second > 0 AND requests_per_second <= 1000),
    next_admission_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO provider_admission (bucket, requests_per_second) VALUES ('tmdb', 40);

-- The item's source generation, observation lease and clocks, activity counters and
-- its one current recovery record (opaque case id, typed identity, category, attempts,
-- first/last failure, resolution). No raw response, URL, credential or title.
ALTER TABLE media_server_items
    ADD COLUMN source_generation bigint NOT NULL DEFAULT 1,
    ADD COLUMN observation_due_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN observation_lease_token uuid,
    ADD COLUMN observation_lease_expires_at timestamptz,
    ADD COLUMN observed_at timestamptz,
    ADD COLUMN last_attempt_at timestamptz,
    ADD COLUMN observation_attempts bigint NOT NULL DEFAULT 0,
    ADD COLUMN observation_successes bigint NOT NULL DEFAULT 0,
    ADD COLUMN recovery_case_id uuid,
    ADD COLUMN recovery_provider text,
    ADD COLUMN recovery_provider_kind text,
    ADD COLUMN recovery_provider_id text,
    ADD COLUMN recovery_category text,
    ADD COLUMN recovery_attempts integer NOT NULL DEFAULT 0 CHECK (recovery_attempts >= 0),
    ADD COLUMN recovery_first_failed_at timestamptz,
    ADD COLUMN recovery_last_failed_at timestamptz,
    ADD COLUMN recovery_resolved_at timestamptz,
    ADD CONSTRAINT media_server_items_observation_lease CHECK (
        (observation_lease_token IS NULL) = (observation_lease_expires_at IS NULL)
    ),
    ADD CONSTRAINT media_server_items_recovery_category CHECK (
        recovery_category IN (
            'not_found', 'auth', 'throttled', 'transient', 'invalid_response', 'configuration'
        )
    ),
    ADD CONSTRAINT media_server_items_recovery_case CHECK (
        (recovery_case_id IS NULL) = (recovery_category IS NULL)
        AND (recovery_case_id IS NULL) = (recovery_first_failed_at IS NULL)
        AND (recovery_resolved_at IS NULL OR recovery_case_id IS NOT NULL)
    );

-- Due work: typed TMDb identities by next eligible attempt.
CREATE INDEX media_server_items_observation_due
    ON media_server_items (observation_due_at, id)
    WHERE provider = 'tmdb' AND provider_kind IN ('movie', 'tv');
-- Open cases, for the overdue check and status figures.
CREATE INDEX media_server_items_open_cases
    ON media_server_items (observation_due_at)
    WHERE recovery_case_id IS NOT NULL AND recovery_resolved_at IS NULL;

-- seed 003: a change of source identity or metadata advances the generation and clears
-- the lease, the recovery state and the observation clocks, so an old result loses even
-- after the source changes away and back. Observed fields (original_language) and the
-- bookkeeping columns are not source fields.
CREATE FUNCTION advance_source_generation() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    NEW.source_generation := OLD.source_generation + 1;
    NEW.observation_lease_token := NULL;
    NEW.observation_lease_expires_at := NULL;
    NEW.observation_due_at := now();
    NEW.observed_at := NULL;
    NEW.last_attempt_at := NULL;
    NEW.recovery_case_id := NULL;
    NEW.recovery_provider := NULL;
    NEW.recovery_provider_kind := NULL;
    NEW.recovery_provider_id := NULL;
    NEW.recovery_category := NULL;
    NEW.recovery_attempts := 0;
    NEW.recovery_first_failed_at := NULL;
    NEW.recovery_last_failed_at := NULL;
    NEW.recovery_resolved_at := NULL;
    RETURN NEW;
END
$$;
CREATE TRIGGER media_server_items_source_change
    BEFORE UPDATE ON media_server_items
    FOR EACH ROW
    WHEN ((OLD.provider, OLD.provider_kind, OLD.provider_id, OLD.title, OLD.year)
          IS DISTINCT FROM (NEW.provider, NEW.provider_kind, NEW.provider_id, NEW.title, NEW.year))
    EXECUTE FUNCTION advance_source_generation();

-- The validated observation of an item's current source generation. No foreign key:
-- other programs TRUNCATE media_server_items (data contract), which a referencing
-- table would forbid; the triggers below remove observations with their items.
CREATE TABLE provider_observations (
    item_id bigint PRIMARY KEY,
    source_generation bigint NOT NULL,
    provider_kind text NOT NULL CHECK (provider_kind IN ('movie', 'tv')),
    tmdb_id bigint NOT NULL,
    title text NOT NULL,
    genres text[] NOT NULL,
    vote_average numeric(4, 2) CHECK (vote_average BETWEEN 0 AND 10),
    vote_count integer,
    original_language text,
    companies text[] NOT NULL,
    release_date date,
    status text,
    observed_at timestamptz NOT NULL
);

CREATE FUNCTION forget_deleted_observations() RETURNS trigger
LANGUAGE plpgsql
SET jit = off
AS $$
BEGIN
    DELETE FROM provider_observations o USING old_rows d WHERE o.item_id = d.id;
    RETURN NULL;
END
$$;
CREATE TRIGGER media_server_items_forget_observations
    AFTER DELETE ON media_server_items
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION forget_deleted_observations();

CREATE FUNCTION forget_all_observations() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    DELETE FROM provider_observations;
    RETURN NULL;
END
$$;
CREATE TRIGGER media_server_items_forget_all_observations
    BEFORE TRUNCATE ON media_server_items
    FOR EACH STATEMENT EXECUTE FUNCTION forget_all_observations();
