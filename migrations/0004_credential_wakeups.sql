-- Seed 004: verified credential wakeups for TMDb authentication recovery.

-- A new random generation whenever the key or the active flag changes (not on a
-- language-only or same-value save). Random, so a change away and back still
-- invalidates old work. Existing configurations get an unverified generation here;
-- the migration makes no network call.
ALTER TABLE provider_settings
    ADD COLUMN credential_generation uuid NOT NULL DEFAULT gen_random_uuid();

CREATE FUNCTION advance_credential_generation() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    NEW.credential_generation := gen_random_uuid();
    RETURN NEW;
END
$$;
CREATE TRIGGER provider_settings_credential_generation
    BEFORE UPDATE ON provider_settings
    FOR EACH ROW
    WHEN ((OLD.api_key, OLD.active) IS DISTINCT FROM (NEW.api_key, NEW.active))
    EXECUTE FUNCTION advance_credential_generation();

-- The wakeup row: one per configuration. Probe lease, verification, failure backoff
-- (for the generation it was earned by), the provider's Retry-After (which survives key
-- edits: editing settings is not a throttle bypass), and the release keyset cursor.
CREATE TABLE credential_wakeups (
    provider text PRIMARY KEY REFERENCES provider_settings (provider) ON DELETE CASCADE,
    verified_generation uuid,
    verified_at timestamptz,
    probe_lease_token uuid,
    probe_lease_expires_at timestamptz,
    probe_generation uuid,
    probe_failures integer NOT NULL DEFAULT 0 CHECK (probe_failures >= 0),
    backoff_generation uuid,
    next_probe_at timestamptz,
    throttled_until timestamptz,
    last_outcome text CHECK (
        last_outcome IN ('verified', 'auth', 'throttled', 'transient', 'invalid_response')
    ),
    release_cursor bigint NOT NULL DEFAULT 0,
    last_release_at timestamptz,
    released_total bigint NOT NULL DEFAULT 0,
    CONSTRAINT credential_wakeups_probe_lease CHECK (
        (probe_lease_token IS NULL) = (probe_lease_expires_at IS NULL)
        AND (probe_lease_token IS NULL) = (probe_generation IS NULL)
    ),
    CONSTRAINT credential_wakeups_verified CHECK (
        (verified_generation IS NULL) = (verified_at IS NULL)
    )
);
INSERT INTO credential_wakeups (provider) SELECT provider FROM provider_settings;

-- The per-item generation receipt: the generation that last released this item's case.
ALTER TABLE media_server_items ADD COLUMN recovery_wakeup_generation uuid;

-- The release keyset: open authentication cases by item id.
CREATE INDEX media_server_items_auth_cases
    ON media_server_items (id)
    WHERE recovery_category = 'auth' AND recovery_resolved_at IS NULL;
