-- The provider observation and recovery schema as it runs now: every table, index,
-- function, trigger, grant and starting row this capability owns, in one file to read.
-- The database gets it from migrations/ (applied in order, never edited once applied);
-- a test builds a database from the schema files and one from the migrations and checks
-- that their catalogs agree (tests/db/test_schema_files.py). To change anything here,
-- change it in this file and write a new migration that carries only the difference.
--
-- The observation state of an item lives in media_server_items' recovery columns
-- (profiles/schema.sql); this file holds the triggers and indexes over them.
-- Rules: docs/provider-recovery.md.

-- Provider settings live in the database (key, active flag, language). The credential
-- generation moves whenever the key or the active flag changes (credentials/schema.sql).
CREATE TABLE provider_settings (
    provider text NOT NULL,
    api_key text,
    active boolean DEFAULT false NOT NULL,
    language text,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    credential_generation uuid DEFAULT gen_random_uuid() NOT NULL,
    CONSTRAINT provider_settings_pkey PRIMARY KEY (provider),
    CONSTRAINT provider_settings_active_needs_key CHECK (((NOT active) OR (api_key IS NOT NULL))),
    CONSTRAINT provider_settings_provider_check CHECK ((provider = 'tmdb'::text))
);

-- The shared admission limiter: one row per provider. A request is admitted by moving
-- next_admission_at forward one interval (a reservation); nothing stays locked while
-- the request is in flight, and every process and machine shares the same row.
CREATE TABLE provider_admission (
    bucket text NOT NULL,
    requests_per_second double precision NOT NULL,
    next_admission_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    paused_until timestamp with time zone,
    throttle_strikes integer DEFAULT 0 NOT NULL,
    recent_admissions timestamp with time zone[] DEFAULT '{}'::timestamp with time zone[] NOT NULL,
    CONSTRAINT provider_admission_pkey PRIMARY KEY (bucket),
    CONSTRAINT provider_admission_requests_per_second_check CHECK (((requests_per_second > (0)::double precision) AND (requests_per_second <= (1000)::double precision))),
    CONSTRAINT provider_admission_throttle_strikes_check CHECK ((throttle_strikes >= 0))
);

-- The validated observation of an item's current source generation. No foreign key:
-- other programs TRUNCATE media_server_items (data contract), which a referencing
-- table would forbid; the triggers below remove observations with their items.
CREATE TABLE provider_observations (
    item_id bigint NOT NULL,
    source_generation bigint NOT NULL,
    provider_kind text NOT NULL,
    tmdb_id bigint NOT NULL,
    title text NOT NULL,
    genres text[] NOT NULL,
    vote_average numeric(4,2),
    vote_count integer,
    original_language text,
    companies text[] NOT NULL,
    release_date date,
    status text,
    observed_at timestamp with time zone NOT NULL,
    imdb_id text,
    tvdb_id integer,
    CONSTRAINT provider_observations_pkey PRIMARY KEY (item_id),
    CONSTRAINT provider_observations_imdb_id CHECK ((imdb_id ~ '^tt[0-9]{7,10}$'::text)),
    CONSTRAINT provider_observations_provider_kind_check CHECK ((provider_kind = ANY (ARRAY['movie'::text, 'tv'::text]))),
    CONSTRAINT provider_observations_tvdb_id CHECK ((tvdb_id > 0)),
    CONSTRAINT provider_observations_vote_average_check CHECK (((vote_average >= (0)::numeric) AND (vote_average <= (10)::numeric)))
);

-- Due work: typed TMDb identities by next eligible attempt.
CREATE INDEX media_server_items_observation_due ON media_server_items USING btree (observation_due_at, id) WHERE ((provider = 'tmdb'::text) AND (provider_kind = ANY (ARRAY['movie'::text, 'tv'::text])));
-- Open cases, for the overdue check and status figures.
CREATE INDEX media_server_items_open_cases ON media_server_items USING btree (observation_due_at) WHERE ((recovery_case_id IS NOT NULL) AND (recovery_resolved_at IS NULL));

-- The TMDb id a typed identity's provider_id names, or NULL when it names none. TMDb ids
-- are positive int32 values (its API reference types every movie/TV id as int32), and
-- an id has one spelling: ASCII digits, no sign, no whitespace, no leading zero, at
-- most 2147483647. Non-ASCII digits ('²', '٦٠٣', fullwidth) are not digits here, so
-- '٦٠٣' never names TMDb 603. `recovery/models.py` states the same rule in Python and
-- a test holds the two to identical answers. No cast sits in the condition, so no
-- input can raise.
CREATE FUNCTION tmdb_id_of(provider_id text)
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE STRICT
AS $function$
    SELECT CASE
        WHEN provider_id ~ '^[1-9][0-9]{0,9}$'
             AND (length(provider_id) < 10 OR provider_id COLLATE "C" <= '2147483647')
        THEN provider_id::integer
    END
$function$;

-- A change of source identity or metadata advances the generation and clears
-- the lease, the recovery state and the observation clocks, so an old result loses even
-- after the source changes away and back. Observed fields (original_language) and the
-- bookkeeping columns are not source fields.
CREATE FUNCTION advance_source_generation()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
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
    NEW.recovery_cause_attempts := 0;
    NEW.recovery_first_failed_at := NULL;
    NEW.recovery_last_failed_at := NULL;
    NEW.recovery_resolved_at := NULL;
    RETURN NEW;
END
$function$;

CREATE FUNCTION forget_deleted_observations()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET jit TO 'off'
 SET search_path TO 'public', 'pg_temp'
AS $function$
BEGIN
    DELETE FROM provider_observations o USING old_rows d WHERE o.item_id = d.id;
    RETURN NULL;
END
$function$;

CREATE FUNCTION forget_all_observations()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
BEGIN
    DELETE FROM provider_observations;
    RETURN NULL;
END
$function$;

-- What is kept by item id goes with both ids a re-keyed row touched (its old id, and its
-- new one, which in a swap another row held): the observation and revalidation records
-- are deleted, the proposals stored as superseded (the rule for a deleted item,
-- revalidation/schema.sql). Row-level, only for rows whose id changed: a transition table cannot tell
-- which new row an old one became.
CREATE FUNCTION forget_rekeyed_item()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
BEGIN
    DELETE FROM provider_observations o WHERE o.item_id IN (OLD.id, NEW.id);
    DELETE FROM identity_revalidations r WHERE r.item_id IN (OLD.id, NEW.id);
    UPDATE replacement_proposals p
    SET state = 'superseded', superseded_at = now()
    WHERE p.item_id IN (OLD.id, NEW.id) AND p.state <> 'superseded';
    RETURN NULL;
END
$function$;

-- An item is due for observation when it carries a typed TMDb identity (movie or TV),
-- its due time has come (never observed, source changed, retry or recheck deadline
-- passed) and no live lease holds it, in an active movie/TV library of an active
-- server. The sensor's count and the claim both ask this function. It is one SQL
-- expression (LANGUAGE sql, STABLE, no SECURITY DEFINER or SET clause), so the planner
-- inlines it: the item terms stay on the claim's walk of the due index, whose partial
-- predicate they imply, and the library terms filter each item's library step.
CREATE FUNCTION observation_due(i media_server_items, l libraries, m media_servers)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
    SELECT i.provider = 'tmdb'
       AND i.provider_kind IN ('movie', 'tv')
       AND i.observation_due_at <= now()
       AND (i.observation_lease_token IS NULL OR i.observation_lease_expires_at <= now())
       AND l.active AND m.active AND l.media_kind IN ('movie', 'tv')
$function$;

CREATE TRIGGER media_server_items_source_change
    BEFORE UPDATE ON media_server_items
    FOR EACH ROW
    WHEN ((OLD.id, OLD.provider, OLD.provider_kind, OLD.provider_id, OLD.title, OLD.year)
          IS DISTINCT FROM
          (NEW.id, NEW.provider, NEW.provider_kind, NEW.provider_id, NEW.title, NEW.year))
    EXECUTE FUNCTION advance_source_generation();
CREATE TRIGGER media_server_items_forget_observations AFTER DELETE ON media_server_items REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION forget_deleted_observations();
CREATE TRIGGER media_server_items_forget_all_observations BEFORE TRUNCATE ON media_server_items FOR EACH STATEMENT EXECUTE FUNCTION forget_all_observations();
CREATE TRIGGER media_server_items_forget_rekeyed AFTER UPDATE OF id ON media_server_items FOR EACH ROW WHEN ((old.id IS DISTINCT FROM new.id)) EXECUTE FUNCTION forget_rekeyed_item();

REVOKE ALL ON FUNCTION
    tmdb_id_of(text),
    advance_source_generation(),
    forget_deleted_observations(),
    forget_all_observations(),
    forget_rekeyed_item(),
    observation_due(media_server_items,libraries,media_servers)
FROM PUBLIC;

-- == The rows it starts from ==========================================================

INSERT INTO provider_settings (provider) VALUES ('tmdb');
INSERT INTO provider_admission (bucket, requests_per_second) VALUES ('tmdb', 40);
