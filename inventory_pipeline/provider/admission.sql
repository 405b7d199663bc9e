-- The shared admission limiter (seed 003 / issue 3): one PostgreSQL row per provider.

-- name: reserve
-- Reserve the next admission slot if it falls within the horizon; returns how long to
-- wait before sending. The statement commits at once: no lock is held while waiting or
-- during the request. `headroom` (> 1) keeps arrivals under the rate despite jitter.
UPDATE provider_admission a
SET next_admission_at = GREATEST(a.next_admission_at, clock_timestamp())
                        + make_interval(secs => %(headroom)s / a.requests_per_second)
WHERE a.bucket = %(bucket)s
  AND a.next_admission_at <= clock_timestamp() + make_interval(secs => %(horizon)s)
RETURNING GREATEST(
    0,
    EXTRACT(epoch FROM a.next_admission_at - clock_timestamp())
    - %(headroom)s / a.requests_per_second
)::double precision AS wait_seconds;

-- name: set_rate
UPDATE provider_admission SET requests_per_second = %(requests_per_second)s
WHERE bucket = %(bucket)s AND requests_per_second IS DISTINCT FROM %(requests_per_second)s;
