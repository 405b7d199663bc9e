-- The shared admission limiter (docs/provider-recovery.md#admission-limiter): one
-- PostgreSQL row per provider.

-- name: reserve
-- Reserve the next admission slot if it falls within the horizon and the bucket is not
-- paused; returns how long to wait before taking it (`admit`; NULL: nothing reserved)
-- and how long the bucket stays paused. The statement commits at once: no lock is held
-- while waiting or during the request. `headroom` (> 1) spaces the slots a little wider
-- than the rate.
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

-- name: admit
-- Take the reserved admission now, at the moment of sending: only while fewer than the
-- window's capacity (the rate, at least one) were admitted within the window before
-- now (one second, or 1/rate below one request a second, widened by `headroom`), and
-- the bucket is not paused. An admission is recorded as it is taken, under the row's
-- lock, so this holds across processes and for a caller that slept past its slot.
-- Returns whether it was admitted, how long until the window has room, and how long the
-- bucket stays paused.
WITH bucket AS (
    SELECT b.bucket,
           GREATEST(1, floor(b.requests_per_second))::integer AS capacity,
           make_interval(secs => GREATEST(1, 1 / b.requests_per_second) * %(headroom)s)
             AS span,
           b.recent_admissions,
           b.paused_until
    FROM provider_admission b
    WHERE b.bucket = %(bucket)s
),
admitted AS (
    UPDATE provider_admission a
    SET recent_admissions = (a.recent_admissions || clock_timestamp())[
            GREATEST(1, cardinality(a.recent_admissions) + 2 - c.capacity):]
    FROM bucket c
    WHERE a.bucket = c.bucket
      AND (a.paused_until IS NULL OR a.paused_until <= clock_timestamp())
      AND (cardinality(a.recent_admissions) < c.capacity
           OR a.recent_admissions[cardinality(a.recent_admissions) + 1 - c.capacity]
              <= clock_timestamp() - c.span)
    RETURNING a.bucket
)
SELECT EXISTS (SELECT 1 FROM admitted) AS admitted,
       CASE WHEN cardinality(c.recent_admissions) < c.capacity THEN 0
            ELSE GREATEST(0, EXTRACT(epoch FROM
                     c.recent_admissions[cardinality(c.recent_admissions) + 1 - c.capacity]
                     + c.span - clock_timestamp()))
       END::double precision AS wait_seconds,
       GREATEST(0, EXTRACT(epoch FROM c.paused_until - clock_timestamp()))::double precision
         AS paused_seconds
FROM bucket c;

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
