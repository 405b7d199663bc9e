-- Harness instrumentation, installed only into the harness's own scratch database (never
-- a migration): every claim and every acknowledgement is written down by triggers, so
-- the check after quiescence can prove, independently of the guards it tests, that no
-- request was acknowledged by a lost claim and that nothing went backwards.

CREATE TABLE chaos_profile_claims (
    request_id bigint NOT NULL,
    lease_token uuid NOT NULL,
    claimed_at timestamptz NOT NULL,
    lease_expires_at timestamptz NOT NULL
);
-- completing_token: the token the completing worker declared for its session
-- (chaos.completing_token), which the product's statements do not write anywhere; it
-- is what tells a stale worker's completion from the live claim's.
CREATE TABLE chaos_profile_acks (
    request_id bigint NOT NULL,
    lease_token uuid NOT NULL,
    completing_token text NOT NULL,
    acked_at timestamptz NOT NULL,
    lease_expires_at timestamptz NOT NULL
);
CREATE FUNCTION chaos_profile_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'running' AND NEW.lease_token IS DISTINCT FROM OLD.lease_token THEN
        INSERT INTO chaos_profile_claims VALUES (NEW.id, NEW.lease_token, now(), NEW.lease_expires_at);
    ELSIF OLD.status = 'running' AND NEW.status = 'succeeded' THEN
        INSERT INTO chaos_profile_acks VALUES (OLD.id, OLD.lease_token,
            coalesce(current_setting('chaos.completing_token', true), ''), now(),
            OLD.lease_expires_at);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_profile_audit AFTER UPDATE ON profile_refresh_requests
    FOR EACH ROW EXECUTE FUNCTION chaos_profile_audit();

CREATE TABLE chaos_regressions (
    what text NOT NULL,
    detail text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_acknowledged_audit() RETURNS trigger LANGUAGE plpgsql AS $$
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

CREATE FUNCTION chaos_applied_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.applied_version < OLD.applied_version OR NEW.requested_version < OLD.requested_version THEN
        INSERT INTO chaos_regressions (what, detail) VALUES ('stats version went back',
            format('user %s: requested %s -> %s, applied %s -> %s', NEW.user_id,
                   OLD.requested_version, NEW.requested_version, OLD.applied_version, NEW.applied_version));
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_applied_audit AFTER UPDATE ON user_stats_refresh_state
    FOR EACH ROW EXECUTE FUNCTION chaos_applied_audit();

-- Stats publications: the run's lease must have been live (by the statement clock) and
-- its generation must not be older than what was already applied.
CREATE TABLE chaos_stats_publications (
    run_id bigint NOT NULL,
    user_id uuid NOT NULL,
    lease_token uuid NOT NULL,
    completing_token text NOT NULL,
    lease_until timestamptz NOT NULL,
    published_at timestamptz NOT NULL
);
CREATE FUNCTION chaos_publication_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.phase = 'published' AND OLD.phase IS DISTINCT FROM 'published' THEN
        INSERT INTO chaos_stats_publications
        VALUES (NEW.id, NEW.user_id, OLD.lease_token,
                coalesce(current_setting('chaos.completing_token', true), ''),
                OLD.lease_until, now());
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_publication_audit AFTER UPDATE ON user_stats_projection_runs
    FOR EACH ROW EXECUTE FUNCTION chaos_publication_audit();

-- Observation completions: the completing token must be the item's latest claim and the
-- source must not have changed since that claim.
CREATE TABLE chaos_item_claims (
    item_id bigint NOT NULL,
    lease_token uuid NOT NULL,
    source_generation bigint NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_item_completions (
    item_id bigint NOT NULL,
    lease_token uuid,  -- the item's claim when the completion wrote (NULL: none)
    completing_token text NOT NULL,
    source_generation bigint NOT NULL,
    completed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_item_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.observation_lease_token IS NOT NULL
       AND NEW.observation_lease_token IS DISTINCT FROM OLD.observation_lease_token THEN
        INSERT INTO chaos_item_claims (item_id, lease_token, source_generation)
        VALUES (NEW.id, NEW.observation_lease_token, NEW.source_generation);
    ELSIF NEW.observation_attempts > OLD.observation_attempts THEN
        INSERT INTO chaos_item_completions
            (item_id, lease_token, completing_token, source_generation)
        VALUES (NEW.id, OLD.observation_lease_token,
                coalesce(current_setting('chaos.completing_token', true), ''),
                NEW.source_generation);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_item_audit AFTER UPDATE ON media_server_items
    FOR EACH ROW EXECUTE FUNCTION chaos_item_audit();
