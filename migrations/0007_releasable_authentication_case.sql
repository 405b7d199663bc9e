-- Seed 004: the qualification of an authentication case for release, in one definition
-- shared by the release batch and the sensor's "anything left to release?" question.
-- Only valid open authentication cases that predate the verification: current typed
-- identity with no conflict against the case's, an active matching movie/TV library
-- and server, no live item lease, a future cooldown, and no receipt for this generation.
CREATE FUNCTION authentication_case_releasable(
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
       AND i.provider_id ~ '^[0-9]{1,10}$'
       AND (i.recovery_provider, i.recovery_provider_kind, i.recovery_provider_id)
           = (i.provider, i.provider_kind, i.provider_id)
       AND l.active AND m.active AND l.media_kind = i.provider_kind
       AND (i.observation_lease_token IS NULL OR i.observation_lease_expires_at <= now())
       AND i.observation_due_at > now()
$$;
