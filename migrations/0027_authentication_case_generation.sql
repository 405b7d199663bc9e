-- An authentication failure records the credential generation its request was sent
-- with. A request sent with an old key can answer 401 after a new key was verified; its
-- case failed after the verification, yet the verified key never saw it. Such a case is
-- released with the verified generation's other cases (a failure of the verified
-- generation itself is not: that key was refused). Cases recorded before this column
-- existed have none and are judged by time alone, as before.
ALTER TABLE media_server_items ADD COLUMN recovery_credential_generation uuid;

-- CREATE OR REPLACE keeps the function's privileges.
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
$$;
