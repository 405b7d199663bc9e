-- The profile outbox claim as one server-side call, and the admission limiter's record
-- of what it admitted in the last window.

-- Claim up to p_limit pending requests under one lease token: oldest available first
-- (available_at, id), SKIP LOCKED so concurrent claimers never take the same request,
-- each claimed request running with one more attempt and a lease of p_lease_seconds.
-- New claims pause while a library (or its server) is inactive. Named requests
-- (p_request_ids, an analyst's backfill) are claimed at once, even in backoff. A
-- running request stays the library's one active request (the partial unique index).
-- Only request rows are locked: the claim never waits while holding another lock.
-- Each branch is a static statement planned once per session: a custom plan per call
-- (the default while the generic plan's estimate is higher) would cost more planning
-- than the claim itself, and the generic plan walks the same indexes.
CREATE FUNCTION claim_profile_requests(
    p_lease_token uuid,
    p_lease_seconds integer,
    p_limit integer,
    p_request_ids bigint[] DEFAULT NULL
) RETURNS TABLE (
    id bigint,
    library_id bigint,
    kind text,
    inventory_revision bigint,
    attempts integer,
    lease_token uuid,
    lease_expires_at timestamptz
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    IF p_request_ids IS NULL THEN
        RETURN QUERY
        UPDATE profile_refresh_requests r
        SET status = 'running',
            attempts = r.attempts + 1,
            lease_token = p_lease_token,
            lease_expires_at = now() + make_interval(secs => p_lease_seconds),
            started_at = now()
        WHERE r.id = ANY (ARRAY(
            SELECT n.id
            FROM profile_refresh_requests n
            JOIN libraries l ON l.id = n.library_id
            JOIN media_servers m ON m.id = l.server_id
            WHERE n.status = 'pending'
              AND n.available_at <= now()
              AND l.active
              AND m.active
            ORDER BY n.available_at, n.id
            LIMIT p_limit
            FOR UPDATE OF n SKIP LOCKED
        ))
          AND r.status = 'pending'
        RETURNING r.id, r.library_id, r.kind, r.inventory_revision, r.attempts,
                  r.lease_token, r.lease_expires_at;
    ELSE
        RETURN QUERY
        UPDATE profile_refresh_requests r
        SET status = 'running',
            attempts = r.attempts + 1,
            lease_token = p_lease_token,
            lease_expires_at = now() + make_interval(secs => p_lease_seconds),
            started_at = now()
        WHERE r.id = ANY (ARRAY(
            SELECT n.id
            FROM profile_refresh_requests n
            JOIN libraries l ON l.id = n.library_id
            JOIN media_servers m ON m.id = l.server_id
            WHERE n.status = 'pending'
              AND n.id = ANY (p_request_ids)
              AND l.active
              AND m.active
            ORDER BY n.available_at, n.id
            LIMIT p_limit
            FOR UPDATE OF n SKIP LOCKED
        ))
          AND r.status = 'pending'
        RETURNING r.id, r.library_id, r.kind, r.inventory_revision, r.attempts,
                  r.lease_token, r.lease_expires_at;
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION claim_profile_requests(uuid, integer, integer, bigint[]) FROM PUBLIC;

-- The admission limiter's own record of what it admitted: the latest admissions of the
-- bucket, oldest first, at most as many as one window may hold. An admission is taken
-- only while fewer than that many fall within the window before it, so no window of
-- the rate's length admits more than the rate, whoever was late to take a slot.
ALTER TABLE provider_admission
    ADD COLUMN recent_admissions timestamptz[] NOT NULL DEFAULT '{}';
