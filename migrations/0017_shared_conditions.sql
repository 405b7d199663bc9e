-- Conditions that more than one statement asks, each defined once so the statements
-- can never drift apart: when an item is due for observation, when a library's refresh
-- circuit is open after a failure, when a credential probe may start and when the next
-- wakeup release batch may run.

-- An item is due for observation when it carries a typed TMDb identity (movie or TV),
-- its due time has come (never observed, source changed, retry or recheck deadline
-- passed) and no live lease holds it, in an active movie/TV library of an active
-- server. The sensor's count and the claim both ask this function. It is one SQL
-- expression (LANGUAGE sql, STABLE, no SECURITY DEFINER or SET clause), so the planner
-- inlines it: the item terms stay on the claim's walk of the due index, whose partial
-- predicate they imply, and the library terms filter each item's library step.
CREATE FUNCTION observation_due(
    i media_server_items,
    l libraries,
    m media_servers
) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT i.provider = 'tmdb'
       AND i.provider_kind IN ('movie', 'tv')
       AND i.observation_due_at <= now()
       AND (i.observation_lease_token IS NULL OR i.observation_lease_expires_at <= now())
       AND l.active AND m.active AND l.media_kind IN ('movie', 'tv')
$$;

-- The library's latest terminal refresh request when it failed less than
-- p_probe_seconds ago (no row otherwise): its circuit is open, and no automatic
-- request is queued for it until the probe interval has passed. Both planners ask
-- `NOT EXISTS (SELECT FROM recent_refresh_failure(...))`. A set-returning SQL function
-- with one SELECT is inlined where it is called, so each call is the same backward step
-- of the library's terminal-request index it was when written out in place.
CREATE FUNCTION recent_refresh_failure(p_library_id bigint, p_probe_seconds double precision)
RETURNS TABLE (request_id bigint, finished_at timestamptz)
LANGUAGE sql STABLE
AS $$
    SELECT latest.id, latest.finished_at
    FROM (
        SELECT t.id, t.status, t.finished_at
        FROM profile_refresh_requests t
        WHERE t.library_id = p_library_id AND t.status IN ('succeeded', 'failed')
        ORDER BY t.id DESC
        LIMIT 1
    ) AS latest
    WHERE latest.status = 'failed'
      AND latest.finished_at > now() - make_interval(secs => p_probe_seconds)
$$;

-- A probe of credential generation p_generation may start: no live probe lease, no
-- provider Retry-After still running, and a failed probe of this same generation has
-- waited out its backoff (a new generation probes at once). The wakeup status the
-- sensor reads and the probe claim both ask it.
CREATE FUNCTION credential_probe_allowed(w credential_wakeups, p_generation uuid)
RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT (w.probe_lease_token IS NULL OR w.probe_lease_expires_at <= now())
       AND (w.throttled_until IS NULL OR w.throttled_until <= now())
       AND (w.backoff_generation IS DISTINCT FROM p_generation
            OR w.next_probe_at IS NULL OR w.next_probe_at <= now())
$$;

-- The next release batch may run: none has run within p_spacing_seconds. The wakeup
-- status the sensor reads and the batch authorization under the wakeup row's lock
-- both ask it.
CREATE FUNCTION credential_release_allowed(
    w credential_wakeups,
    p_spacing_seconds double precision
) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT w.last_release_at IS NULL
        OR w.last_release_at <= now() - make_interval(secs => p_spacing_seconds)
$$;

-- Internal to the pipeline, like every function it calls itself.
REVOKE ALL ON FUNCTION
    observation_due(media_server_items, libraries, media_servers),
    recent_refresh_failure(bigint, double precision),
    credential_probe_allowed(credential_wakeups, uuid),
    credential_release_allowed(credential_wakeups, double precision)
FROM PUBLIC;
