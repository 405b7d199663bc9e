-- Every statement of the lapsed-lease overview (docs/deployment.md#failure-guarantees).

-- name: lapsed_by_kind
SELECT kind, count(*) AS n
FROM lapsed_leases
WHERE taken_at > now() - make_interval(secs => %(window)s)
GROUP BY kind
ORDER BY kind;

-- name: latest_lapsed
SELECT kind, work, holder, lapsed_at, taken_by, taken_at, outcome
FROM lapsed_leases
WHERE taken_at > now() - make_interval(secs => %(window)s)
ORDER BY taken_at DESC, id DESC
LIMIT %(limit)s;

-- name: expired_now
-- Leases run out and not yet taken back: by the rules the triggers of schema.sql record
-- when they are (a stats run waiting out a retry keeps its claim).
SELECT (SELECT count(*) FROM profile_refresh_requests
        WHERE status = 'running' AND lease_expires_at <= now()) AS "profile request",
       (SELECT count(*) FROM user_stats_projection_runs
        WHERE phase IN ('claimed', 'computed') AND retry_not_before IS NULL
          AND lease_until <= now()) AS "stats run",
       (SELECT count(*) FROM media_server_items
        WHERE observation_lease_token IS NOT NULL
          AND observation_lease_expires_at <= now()) AS observation,
       (SELECT count(*) FROM credential_wakeups
        WHERE probe_lease_token IS NOT NULL
          AND probe_lease_expires_at <= now()) AS "credential probe";
