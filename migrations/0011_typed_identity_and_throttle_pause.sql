-- One definition of a valid typed TMDb identity, and a fleet-wide pause of the shared
-- admission limiter when the provider throttles.

-- The TMDb id a typed identity's provider_id names, or NULL when it names none. TMDb ids
-- are positive int32 values (its API reference types every movie/TV id as int32), and
-- an id has one spelling: ASCII digits, no sign, no whitespace, no leading zero, at
-- most 2147483647. Non-ASCII digits ('²', '٦٠٣', fullwidth) are not digits here, so
-- '٦٠٣' never names TMDb 603. `recovery/models.py` states the same rule in Python and
-- a test holds the two to identical answers. No cast sits in the condition, so no
-- input can raise.
CREATE FUNCTION tmdb_id_of(provider_id text) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN provider_id ~ '^[1-9][0-9]{0,9}$'
             AND (length(provider_id) < 10 OR provider_id COLLATE "C" <= '2147483647')
        THEN provider_id::integer
    END
$$;

-- Authentication cases qualify for release only with a valid typed identity, by the
-- definition above (it replaces a pattern that let leading zeros and ids past int32
-- through). CREATE OR REPLACE keeps the function's privileges.
CREATE OR REPLACE FUNCTION authentication_case_releasable(
    i media_server_items,
    l libraries,
    m media_servers,
    p_verified_at timestamptz,
    p_generation uuid
) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT i.recovery_category = 'auth'
       AND i.recovery_resolved_at IS NULL
       AND i.recovery_last_failed_at <= p_verified_at
       AND i.recovery_wakeup_generation IS DISTINCT FROM p_generation
       AND i.provider = 'tmdb'
       AND i.provider_kind IN ('movie', 'tv')
       AND tmdb_id_of(i.provider_id) IS NOT NULL
       AND (i.recovery_provider, i.recovery_provider_kind, i.recovery_provider_id)
           = (i.provider, i.provider_kind, i.provider_id)
       AND l.active AND m.active AND l.media_kind = i.provider_kind
       AND (i.observation_lease_token IS NULL OR i.observation_lease_expires_at <= now())
       AND i.observation_due_at > now()
$$;

REVOKE ALL ON FUNCTION tmdb_id_of(text) FROM PUBLIC;

-- A 429 pauses admission for every process and machine until paused_until: nothing is
-- admitted before it. throttle_strikes counts consecutive pauses without a Retry-After
-- so the default pause can grow while the provider keeps refusing.
ALTER TABLE provider_admission
    ADD COLUMN paused_until timestamptz,
    ADD COLUMN throttle_strikes integer NOT NULL DEFAULT 0 CHECK (throttle_strikes >= 0);
