-- The credential wakeup schema as it runs now: every table, index, function, trigger,
-- grant and starting row this capability owns, in one file to read. The database gets
-- it from migrations/ (applied in order, never edited once applied); a test builds a
-- database from the schema files and one from the migrations and checks that their
-- catalogs agree (tests/db/test_schema_files.py). To change anything here, change it in
-- this file and write a new migration that carries only the difference.
--
-- The key and its generation are provider_settings' columns (recovery/schema.sql); an
-- item's authentication case is media_server_items' recovery columns
-- (profiles/schema.sql). Rules: docs/credentials.md.

-- The wakeup row: one per configuration. Probe lease, verification, failure backoff
-- (for the generation it was earned by), the provider's Retry-After (which survives key
-- edits: editing settings is not a throttle bypass), and the release keyset cursor.
CREATE TABLE credential_wakeups (
    provider text NOT NULL,
    verified_generation uuid,
    verified_at timestamp with time zone,
    probe_lease_token uuid,
    probe_lease_expires_at timestamp with time zone,
    probe_generation uuid,
    probe_failures integer DEFAULT 0 NOT NULL,
    backoff_generation uuid,
    next_probe_at timestamp with time zone,
    throttled_until timestamp with time zone,
    last_outcome text,
    release_cursor bigint DEFAULT 0 NOT NULL,
    last_release_at timestamp with time zone,
    released_total bigint DEFAULT 0 NOT NULL,
    CONSTRAINT credential_wakeups_pkey PRIMARY KEY (provider),
    CONSTRAINT credential_wakeups_provider_fkey FOREIGN KEY (provider) REFERENCES provider_settings(provider) ON DELETE CASCADE,
    CONSTRAINT credential_wakeups_last_outcome_check CHECK ((last_outcome = ANY (ARRAY['verified'::text, 'auth'::text, 'throttled'::text, 'transient'::text, 'invalid_response'::text]))),
    CONSTRAINT credential_wakeups_probe_failures_check CHECK ((probe_failures >= 0)),
    CONSTRAINT credential_wakeups_probe_lease CHECK ((((probe_lease_token IS NULL) = (probe_lease_expires_at IS NULL)) AND ((probe_lease_token IS NULL) = (probe_generation IS NULL)))),
    CONSTRAINT credential_wakeups_verified CHECK (((verified_generation IS NULL) = (verified_at IS NULL)))
);

-- The release keyset: open authentication cases by item id.
CREATE INDEX media_server_items_auth_cases ON media_server_items USING btree (id) WHERE ((recovery_category = 'auth'::text) AND (recovery_resolved_at IS NULL));

CREATE FUNCTION advance_credential_generation()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    NEW.credential_generation := gen_random_uuid();
    RETURN NEW;
END
$function$;

-- The qualification of an authentication case for release, in one definition shared by
-- the release batch and the sensor's "anything left to release?" question. Only valid
-- open authentication cases that predate the verification: current typed identity with
-- no conflict against the case's, an active matching movie/TV library and server, no
-- live item lease, a future cooldown, and no receipt for this generation. A case records
-- the credential generation its request was sent with: a request sent with an old key
-- can answer 401 after a new key was verified, and such a case is released with the
-- verified generation's other cases (a failure of the verified generation itself is
-- not: that key was refused). A case recorded without a generation is judged by time.
CREATE FUNCTION authentication_case_releasable(i media_server_items, l libraries, m media_servers, p_verified_at timestamp with time zone, p_generation uuid)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
    SELECT i.recovery_category = 'auth'
       AND i.recovery_resolved_at IS NULL
       AND (i.recovery_last_failed_at <= p_verified_at
            OR i.recovery_credential_generation <> p_generation)
       AND i.recovery_wakeup_generation IS DISTINCT FROM p_generation
       AND i.provider = 'tmdb'
       AND i.provider_kind IN ('movie', 'tv')
       AND tmdb_id_of(i.provider_id) IS NOT NULL
       AND (i.recovery_provider, i.recovery_provider_kind, i.recovery_provider_id)
           = (i.provider, i.provider_kind, i.provider_id)
       AND l.active AND m.active AND l.media_kind = i.provider_kind
       AND (i.observation_lease_token IS NULL OR i.observation_lease_expires_at <= now())
       AND i.observation_due_at > now()
$function$;

-- A probe of credential generation p_generation may start: no live probe lease, no
-- provider Retry-After still running, and a failed probe of this same generation has
-- waited out its backoff (a new generation probes at once). The wakeup status the
-- sensor reads and the probe claim both ask it.
CREATE FUNCTION credential_probe_allowed(w credential_wakeups, p_generation uuid)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
    SELECT (w.probe_lease_token IS NULL OR w.probe_lease_expires_at <= now())
       AND (w.throttled_until IS NULL OR w.throttled_until <= now())
       AND (w.backoff_generation IS DISTINCT FROM p_generation
            OR w.next_probe_at IS NULL OR w.next_probe_at <= now())
$function$;

-- The next release batch may run: none has run within p_spacing_seconds. The wakeup
-- status the sensor reads and the batch authorization under the wakeup row's lock
-- both ask it.
CREATE FUNCTION credential_release_allowed(w credential_wakeups, p_spacing_seconds double precision)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
    SELECT w.last_release_at IS NULL
        OR w.last_release_at <= now() - make_interval(secs => p_spacing_seconds)
$function$;

CREATE TRIGGER provider_settings_credential_generation BEFORE UPDATE ON provider_settings FOR EACH ROW WHEN (((old.api_key IS DISTINCT FROM new.api_key) OR (old.active IS DISTINCT FROM new.active))) EXECUTE FUNCTION advance_credential_generation();

REVOKE ALL ON FUNCTION
    advance_credential_generation(),
    authentication_case_releasable(media_server_items,libraries,media_servers,timestamp with time zone,uuid),
    credential_probe_allowed(credential_wakeups,uuid),
    credential_release_allowed(credential_wakeups,double precision)
FROM PUBLIC;

-- == The rows it starts from ==========================================================

INSERT INTO credential_wakeups (provider) VALUES ('tmdb');
