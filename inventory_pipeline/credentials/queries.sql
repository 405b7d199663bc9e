-- Every statement of verified credential wakeups (docs/credentials.md).
-- Lock order in every transaction (docs/credentials.md#lock-order): provider_settings
-- (share) -> credential_wakeups -> each item's library (key share) -> media_server_items
-- rows (SKIP LOCKED). lock_timeout is one second.

-- name: set_lock_timeout
SET LOCAL lock_timeout = '1s';

-- name: status
-- What the sensor needs: are there open authentication cases, is the current generation
-- verified, may a probe run now, may a release batch run now.
SELECT s.credential_generation AS generation,
       s.active AND s.api_key IS NOT NULL AS usable,
       w.verified_generation = s.credential_generation AS verified,
       (SELECT count(*) FROM media_server_items i
         WHERE i.recovery_category = 'auth' AND i.recovery_resolved_at IS NULL) AS auth_cases,
       credential_probe_allowed(w, s.credential_generation) AS probe_allowed,
       credential_release_allowed(w, %(release_spacing_seconds)s) AS release_allowed,
       w.throttled_until, w.next_probe_at,
       -- The outcome of the current generation's last probe: an older key's is history.
       CASE WHEN w.verified_generation = s.credential_generation THEN 'verified'
            WHEN w.backoff_generation = s.credential_generation THEN w.last_outcome
       END AS last_outcome,
       w.released_total
FROM provider_settings s
JOIN credential_wakeups w ON w.provider = s.provider
WHERE s.provider = 'tmdb';

-- name: lock_settings
-- The short share lock: a settings writer waits (at most for this transaction) instead
-- of racing the probe claim or a batch authorization.
SELECT credential_generation AS generation, api_key, active, language
FROM provider_settings
WHERE provider = 'tmdb'
FOR SHARE;

-- name: lock_wakeup
SELECT verified_generation, verified_at, probe_lease_token, probe_lease_expires_at,
       probe_failures, backoff_generation, next_probe_at, throttled_until,
       release_cursor, last_release_at,
       credential_release_allowed(w, %(release_spacing_seconds)s) AS release_allowed
FROM credential_wakeups w
WHERE provider = 'tmdb'
FOR UPDATE;

-- name: claim_probe
-- When authentication cases exist, one worker holds the one-minute probe lease for the
-- current, unverified generation, past any failure backoff of that generation and any
-- provider Retry-After.
UPDATE credential_wakeups w
SET probe_lease_token = %(lease_token)s,
    probe_lease_expires_at = now() + make_interval(secs => %(lease_seconds)s),
    probe_generation = %(generation)s
WHERE w.provider = 'tmdb'
  AND EXISTS (
      SELECT 1 FROM media_server_items i
      WHERE i.recovery_category = 'auth' AND i.recovery_resolved_at IS NULL
  )
  AND w.verified_generation IS DISTINCT FROM %(generation)s
  AND credential_probe_allowed(w, %(generation)s)
-- probe_failures counts the failures of backoff_generation: a new key starts from none.
RETURNING CASE WHEN w.backoff_generation = %(generation)s THEN w.probe_failures ELSE 0 END
          AS probe_failures;

-- name: probe_lease_held
-- Is the probe lease still this claim's and unexpired? Asked after admission (which can
-- wait), before the request is sent.
SELECT probe_lease_expires_at > clock_timestamp() AS held
FROM credential_wakeups
WHERE provider = 'tmdb' AND probe_lease_token = %(lease_token)s;

-- name: give_back_probe
-- A claimed probe that was never sent gives its lease back: no outcome, no backoff.
UPDATE credential_wakeups
SET probe_lease_token = NULL, probe_lease_expires_at = NULL, probe_generation = NULL
WHERE provider = 'tmdb' AND probe_lease_token = %(lease_token)s;

-- name: complete_probe
-- Verification counts only for the same configuration and generation under an unexpired
-- lease. A failure counts towards the backoff of its own generation only
-- (probe_failures are backoff_generation's). A provider Retry-After is recorded whenever the lease token matches, even if the
-- key changed meanwhile: editing settings is not a throttle bypass.
WITH config AS (
    SELECT credential_generation, active
    FROM provider_settings
    WHERE provider = 'tmdb'
    FOR SHARE
),
before AS (
    SELECT w.provider,
           config.credential_generation = %(generation)s
             AND config.active
             AND w.probe_generation = %(generation)s
             AND w.probe_lease_expires_at > now() AS current
    FROM credential_wakeups w
    CROSS JOIN config
    WHERE w.provider = 'tmdb' AND w.probe_lease_token = %(lease_token)s
    FOR UPDATE OF w
)
UPDATE credential_wakeups w
SET verified_generation = CASE WHEN b.current AND %(outcome)s = 'verified'
                               THEN %(generation)s ELSE w.verified_generation END,
    verified_at = CASE WHEN b.current AND %(outcome)s = 'verified'
                       THEN now() ELSE w.verified_at END,
    release_cursor = CASE WHEN b.current AND %(outcome)s = 'verified'
                          THEN 0 ELSE w.release_cursor END,
    probe_failures = CASE WHEN NOT b.current THEN w.probe_failures
                          WHEN %(outcome)s = 'verified' THEN 0
                          WHEN w.backoff_generation = %(generation)s
                          THEN w.probe_failures + 1
                          ELSE 1 END,
    backoff_generation = CASE WHEN b.current AND %(outcome)s <> 'verified'
                              THEN %(generation)s ELSE w.backoff_generation END,
    next_probe_at = CASE WHEN b.current AND %(outcome)s <> 'verified'
                         THEN now() + make_interval(secs => %(backoff_seconds)s)
                         ELSE w.next_probe_at END,
    throttled_until = CASE WHEN %(retry_after_seconds)s::integer IS NULL THEN w.throttled_until
                           ELSE GREATEST(w.throttled_until,
                                         now() + make_interval(secs => %(retry_after_seconds)s))
                           END,
    last_outcome = CASE WHEN b.current THEN %(outcome)s ELSE w.last_outcome END,
    probe_lease_token = NULL,
    probe_lease_expires_at = NULL,
    probe_generation = NULL
FROM before b
WHERE w.provider = b.provider
RETURNING b.current;

-- name: release_batch
-- docs/credentials.md#release.
-- Release at most `limit` valid open authentication cases that predate the
-- verification, scanning an indexed keyset from the cursor. Each release records the
-- generation receipt, a 1-60 s retry jitter and clears the attempt-admission clock; the
-- diagnostic record, attempts, identity and metadata stay. Locked rows are skipped and
-- revisited after the cursor wraps; so are the items of a library being deleted.
WITH scanned AS (
    SELECT i.id
    FROM media_server_items i
    WHERE i.recovery_category = 'auth'
      AND i.recovery_resolved_at IS NULL
      AND i.id > %(cursor)s
    ORDER BY i.id
    LIMIT %(scan)s
),
eligible AS (
    SELECT i.id
    FROM media_server_items i
    JOIN scanned ON scanned.id = i.id
    JOIN libraries l ON l.id = i.library_id
    JOIN media_servers m ON m.id = l.server_id
    WHERE authentication_case_releasable(i, l, m, %(verified_at)s, %(generation)s)
    ORDER BY i.id
    LIMIT %(limit)s
    FOR KEY SHARE OF l SKIP LOCKED
    FOR UPDATE OF i SKIP LOCKED
),
released AS (
    UPDATE media_server_items i
    SET recovery_wakeup_generation = %(generation)s,
        observation_due_at = now() + make_interval(secs => 1 + floor(random() * 60)::integer),
        last_attempt_at = NULL
    FROM eligible
    WHERE i.id = eligible.id
    RETURNING i.id
)
SELECT (SELECT count(*) FROM released) AS released,
       (SELECT max(id) FROM released) AS last_released,
       (SELECT count(*) FROM scanned) AS scanned,
       (SELECT max(id) FROM scanned) AS last_scanned;

-- name: record_release
UPDATE credential_wakeups
SET release_cursor = %(cursor)s,
    last_release_at = now(),
    released_total = released_total + %(released)s
WHERE provider = 'tmdb';

-- name: eligible_exists
-- Does the verified generation still have a case to release (the sensor's question)?
SELECT EXISTS (
    SELECT 1
    FROM media_server_items i
    JOIN libraries l ON l.id = i.library_id
    JOIN media_servers m ON m.id = l.server_id
    JOIN credential_wakeups w ON w.provider = 'tmdb'
    WHERE authentication_case_releasable(i, l, m, w.verified_at, w.verified_generation)
) AS eligible;
