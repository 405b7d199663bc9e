-- The shared admission limiter (seed 003 / issue 3): one PostgreSQL row per provider.

-- name: reserve
-- Reserve the next admission slot if it falls within the horizon and the bucket is not
-- paused; returns how long to wait before sending (NULL: nothing reserved) and how long
-- the bucket stays paused. The statement commits at once: no lock is held while waiting
-- or during the request. `headroom` (> 1) keeps arrivals under the rate despite jitter.
WITH reserved AS (
    UPDATE provider_admission a
    SET next_admission_at = GREATEST(a.next_admission_at, clock_timestamp())
                            + make_interval(secs => %(headroom)s / a.requests_per_second)
    WHERE a.bucket = %(bucket)s
      AND a.next_admission_at <= clock_timestamp() + make_interval(secs => %(horizon)s)
      AND (a.paused_until IS NULL OR a.paused_until <= clock_timestamp())
    RETURNING GREATEST(
        0,
        EXTRACT(epoch FROM a.next_admission_at - clock_timestamp())
        - %(headroom)s / a.requests_per_second
    )::double precision AS wait_seconds
)
SELECT (SELECT wait_seconds FROM reserved) AS wait_seconds,
       GREATEST(0, EXTRACT(epoch FROM b.paused_until - clock_timestamp()))::double precision
         AS paused_seconds
FROM provider_admission b
WHERE b.bucket = %(bucket)s;

-- name: set_rate
UPDATE provider_admission SET requests_per_second = %(requests_per_second)s
WHERE bucket = %(bucket)s AND requests_per_second IS DISTINCT FROM %(requests_per_second)s;

-- name: pause
-- A throttling answer pauses the bucket for every process. While a pause runs, further
-- answers come from requests admitted before it: a Retry-After may lengthen it, nothing
-- counts as a new strike. After a pause, a throttling answer within the memory is one
-- more strike (the default pause doubles); later, the count starts again. A pause is
-- never shortened.
WITH current AS (
    SELECT a.bucket,
           COALESCE(a.paused_until > clock_timestamp(), false) AS running,
           CASE
               WHEN a.paused_until > clock_timestamp() THEN a.throttle_strikes
               WHEN a.paused_until > clock_timestamp()
                                     - make_interval(secs => %(memory_seconds)s)
               THEN a.throttle_strikes + 1
               ELSE 1
           END AS strikes
    FROM provider_admission a
    WHERE a.bucket = %(bucket)s
    FOR UPDATE
)
UPDATE provider_admission a
SET throttle_strikes = c.strikes,
    paused_until = GREATEST(
        a.paused_until,
        clock_timestamp() + make_interval(secs => CASE
            WHEN %(retry_after_seconds)s::integer IS NOT NULL THEN %(retry_after_seconds)s::integer
            WHEN c.running THEN 0
            ELSE LEAST(%(max_default_seconds)s,
                       %(default_seconds)s * 2 ^ LEAST(c.strikes - 1, 30))
        END))
FROM current c
WHERE a.bucket = c.bucket
RETURNING GREATEST(0, EXTRACT(epoch FROM a.paused_until - clock_timestamp()))::double precision
    AS paused_seconds;

-- name: paused
SELECT GREATEST(0, EXTRACT(epoch FROM paused_until - clock_timestamp()))::double precision
    AS paused_seconds
FROM provider_admission
WHERE bucket = %(bucket)s;
