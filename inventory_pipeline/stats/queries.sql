-- Every statement of training stats the Python code sends. The tables, the write
-- functions, the stage functions, the merge-enqueue, the owed-range trigger and the
-- lease fence are in schema.sql (their current definitions; migrations/ holds the
-- changes that produced them).

-- name: arm_stage
-- Sent with every stage call, in the same transaction and message, before it: the
-- stage's statement budget from the settings row (it bounds the statement that follows),
-- the lease token the call acts under ('' declares none; the fence checks it), and
-- whether its commit may return before its WAL is flushed. Its parameters are named
-- arm_* (they travel with the call's own).
SELECT stats_projection_statement_budget(%(arm_stage)s) AS budget_ms,
       set_config('inventory.stats_lease_token', %(arm_lease_token)s, true) AS lease_token,
       CASE WHEN %(arm_async_commit)s::boolean
            THEN set_config('synchronous_commit', 'off', true) END AS async_commit;

-- name: stage_budget
-- A stage's statement budget as the settings row holds it (read only: arming it is
-- arm_stage's).
SELECT CASE %(stage)s WHEN 'claim' THEN claim_budget_ms
                      WHEN 'compute' THEN compute_budget_ms
                      WHEN 'publish' THEN publish_budget_ms END AS budget_ms
FROM stats_projection_worker_settings WHERE id = 1;

-- name: claim_stage
-- The claim stage as one call: no row when nothing was claimed.
SELECT claim_run_id, claim_job_id, claim_user_id, claim_lease_token, claim_target_version,
       claim_base_applied_version, claim_from_date, claim_exercise_ids
FROM stats_claim_stage(%(lock_owner)s::text, %(user_id)s::uuid);

-- name: compute_stage
-- One step of the compute stage (the whole computation, or a batch run's next step).
SELECT compute_status, compute_stage, compute_next_offset, compute_total, compute_reason,
       compute_retry_not_before
FROM stats_compute_stage(%(run_id)s::bigint, %(lease_token)s::uuid, %(batch_size)s::integer);

-- name: publish_stage
-- The publish stage as one call.
SELECT publish_status, publish_applied_version, publish_reason, publish_retry_not_before
FROM stats_publish_stage(%(run_id)s::bigint, %(lease_token)s::uuid);

-- name: give_back_run
-- A stage call a transient error rolled back whole: the run given back at once by the
-- worker still holding its lease (a failed attempt, or due again at once), or nothing
-- done when the lease is no longer its own.
SELECT give_back_status, give_back_reason, give_back_retry_not_before
FROM stats_give_back_run(%(run_id)s::bigint, %(lease_token)s::uuid, %(lock_owner)s::text,
                         %(stage)s::text, %(sqlstate)s::text, %(budget_spent)s::boolean);

-- name: lock_job
-- A job as the runbook's retry judges it: whether its range is still owed, and else the
-- latest job of its user that took it in, and how that one stands.
SELECT j.id, j.user_id, j.status, j.metadata ->> 'retried_by' AS retried_by,
       EXISTS (SELECT 1 FROM user_stats_owed_ranges o
               WHERE o.user_id = j.user_id AND j.id = ANY (o.failed_job_ids)) AS owed,
       taker.id AS taken_in_by, taker.status AS taker_status
FROM user_exercise_stats_refresh_jobs j
LEFT JOIN LATERAL (
    SELECT a.id, a.status FROM user_exercise_stats_refresh_jobs a
    WHERE a.user_id = j.user_id AND a.id > j.id
      AND a.metadata -> 'absorbed_failed_jobs' @> to_jsonb(j.id)
    ORDER BY a.id DESC
    LIMIT 1
) AS taker ON true
WHERE j.id = %(job_id)s
FOR UPDATE OF j;

-- name: retry_job
-- The runbook's retry of an exhausted job: its range again, as a new generation through
-- the queue; the failed job stays for inspection and records its successor.
WITH successor AS (
    SELECT enqueue_user_exercise_stats_refresh_job(
        j.user_id, 'manual_refresh', j.from_date, j.exercise_ids,
        'operator retry of job ' || j.id, 'job:' || j.id,
        bump_stats_requested_version(j.user_id)) AS id
    FROM user_exercise_stats_refresh_jobs j WHERE j.id = %(job_id)s
)
UPDATE user_exercise_stats_refresh_jobs j
SET metadata = j.metadata || jsonb_build_object('retried_by', successor.id, 'retried_at', now()),
    updated_at = now()
FROM successor
WHERE j.id = %(job_id)s
RETURNING successor.id AS successor_id;

-- name: read_settings
SELECT claim_budget_ms, compute_budget_ms, publish_budget_ms, lease_seconds,
       active_lease_cap, max_attempts, retry_backoff_seconds, paused
FROM stats_projection_worker_settings WHERE id = 1;

-- name: update_settings
-- The runbook's budget change: NULL keeps a value; the table's CHECKs judge the result.
UPDATE stats_projection_worker_settings
SET claim_budget_ms = coalesce(%(claim_budget_ms)s, claim_budget_ms),
    compute_budget_ms = coalesce(%(compute_budget_ms)s, compute_budget_ms),
    publish_budget_ms = coalesce(%(publish_budget_ms)s, publish_budget_ms),
    lease_seconds = coalesce(%(lease_seconds)s, lease_seconds),
    active_lease_cap = coalesce(%(active_lease_cap)s, active_lease_cap),
    max_attempts = coalesce(%(max_attempts)s, max_attempts),
    retry_backoff_seconds = coalesce(%(retry_backoff_seconds)s, retry_backoff_seconds),
    paused = coalesce(%(paused)s, paused)
WHERE id = 1
RETURNING claim_budget_ms, compute_budget_ms, publish_budget_ms, lease_seconds,
          active_lease_cap, max_attempts, retry_backoff_seconds, paused;

-- name: remaining_users
SELECT count(DISTINCT user_id) AS users FROM user_exercise_stats_refresh_jobs
WHERE status IN ('pending', 'processing')
  AND (%(user_id)s::uuid IS NULL OR user_id = %(user_id)s::uuid);

-- name: waits_for_retry
-- Does the user's run wait out a retry time (the claim resumes it then)?
SELECT EXISTS (
    SELECT 1 FROM user_stats_projection_runs r
    WHERE r.user_id = %(user_id)s AND r.phase IN ('claimed', 'computed')
      AND r.retry_not_before > now()) AS waits;

-- name: worker_status
SELECT stats_projection_worker_status() AS status;

-- name: rebuild_start
-- An operator's rebuild request: a pass over every user (NULL) or over the chosen users,
-- sorted and without duplicates. It takes no user's lock; its steps do, one at a time.
INSERT INTO stats_rebuild_passes (user_ids)
SELECT CASE WHEN %(user_ids)s::uuid[] IS NULL THEN NULL
            ELSE coalesce((SELECT array_agg(DISTINCT u ORDER BY u)
                           FROM unnest(%(user_ids)s::uuid[]) AS u
                           WHERE u IS NOT NULL), '{}') END
RETURNING id;

-- name: rebuild_step
-- One user of a rebuild pass in one transaction: the next user after the pass's position
-- (every user: the least id above the cursor among users with sessions or a stats state;
-- a list: the next entry) gets a full-history generation through the merge-enqueue, and
-- the position moves with it, so a killed pass resumes exactly after the last user it
-- committed. No next user: the pass is finished (no row when it was already). Two
-- drivers of one pass take turns on its row. The step commits asynchronously: a crash
-- can lose only whole steps (enqueue and position together), which the resumed pass
-- then repeats.
WITH pass AS (
    SELECT p.id, p.user_ids, p.cursor, p.position,
           set_config('synchronous_commit', 'off', true) AS async_commit
    FROM stats_rebuild_passes p
    WHERE p.id = %(pass_id)s AND p.finished_at IS NULL
    FOR UPDATE
),
next AS (
    SELECT pass.id,
           CASE WHEN pass.user_ids IS NOT NULL THEN pass.user_ids[pass.position + 1]
                WHEN pass.cursor IS NULL THEN least(
                    (SELECT s.user_id FROM training_sessions s ORDER BY 1 LIMIT 1),
                    (SELECT st.user_id FROM user_stats_refresh_state st ORDER BY 1 LIMIT 1))
                ELSE least(
                    (SELECT s.user_id FROM training_sessions s
                     WHERE s.user_id > pass.cursor ORDER BY 1 LIMIT 1),
                    (SELECT st.user_id FROM user_stats_refresh_state st
                     WHERE st.user_id > pass.cursor ORDER BY 1 LIMIT 1))
           END AS user_id
    FROM pass
),
enqueued AS (
    SELECT next.id, next.user_id,
           enqueue_user_exercise_stats_refresh_job(
               next.user_id, 'analyst_rebuild', NULL, '{}', 'analyst rebuild',
               'rebuild:' || next.id, bump_stats_requested_version(next.user_id)) AS job_id
    FROM next
    WHERE next.user_id IS NOT NULL
)
UPDATE stats_rebuild_passes p
SET cursor = coalesce(e.user_id, p.cursor),
    position = p.position + CASE WHEN e.user_id IS NULL THEN 0 ELSE 1 END,
    requested = p.requested + CASE WHEN e.user_id IS NULL THEN 0 ELSE 1 END,
    finished_at = CASE WHEN e.user_id IS NULL THEN now() END,
    updated_at = now()
FROM next
LEFT JOIN enqueued e ON e.id = next.id
WHERE p.id = next.id
RETURNING e.user_id, e.job_id, p.requested, p.finished_at IS NOT NULL AS finished;

-- name: rebuild_open_passes
-- Rebuild passes not finished and not stepped for `idle_seconds` (a killed driver left
-- them), oldest first.
SELECT id, requested FROM stats_rebuild_passes
WHERE finished_at IS NULL AND updated_at <= now() - make_interval(secs => %(idle_seconds)s)
ORDER BY id;

-- name: hold_drain_lock
-- A kept-alive drain's mark of life: a session lock, held until its connection closes.
SELECT pg_try_advisory_lock(stats_drain_lock(%(owner)s)) AS held;

-- name: live_drains
-- Of these drain owners, those whose drain's session lives: it holds its lock (a
-- session-level advisory lock on a bigint key shows in pg_locks as the key's high and
-- low 32 bits).
SELECT o.owner
FROM unnest(%(owners)s::text[]) AS o (owner)
WHERE EXISTS (
    SELECT 1 FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
      AND l.classid = ((stats_drain_lock(o.owner) >> 32) & 4294967295)::oid
      AND l.objid = (stats_drain_lock(o.owner) & 4294967295)::oid);

-- name: waiting_work
-- The drain policy's one definition of work waiting, for the sensor and the drain
-- alike: what a claim could take now (pending jobs of users with no live job, runs due
-- to resume, dead workers' runs), how long the oldest of it has waited since it became
-- claimable (a job since it was enqueued or, for a successor, since the job before it
-- ended; a run since it became due), the lease slots free, and the pause switch.
-- The oldest wait is looked for among the 100 claimable jobs enqueued first: a job
-- enqueued later became claimable no earlier than it was enqueued, so the front holds the
-- oldest wait unless all 100 became claimable after the 100th was enqueued (a drain busy
-- ending their predecessors, which is no drain falling behind). Looking up every pending
-- job's predecessor took 0.5 s a tick at 100,000 pending users.
WITH jobs AS (
    SELECT j.id, j.user_id, j.created_at
    FROM user_exercise_stats_refresh_jobs j
    WHERE j.status = 'pending'
      AND NOT EXISTS (
          SELECT 1 FROM user_exercise_stats_refresh_jobs p
          WHERE p.user_id = j.user_id AND p.status = 'processing')
), front AS (
    SELECT greatest(f.created_at, (
               SELECT p.completed_at FROM user_exercise_stats_refresh_jobs p
               WHERE p.user_id = f.user_id AND p.id < f.id
               ORDER BY p.id DESC
               LIMIT 1)) AS since
    FROM (SELECT * FROM jobs ORDER BY created_at, id LIMIT 100) AS f
), runs AS (
    SELECT coalesce(r.retry_not_before, r.lease_until) AS since
    FROM user_stats_projection_runs r
    WHERE r.phase IN ('claimed', 'computed')
      AND (r.retry_not_before <= now()
           OR (r.retry_not_before IS NULL AND r.lease_until <= now()))
)
SELECT st.paused,
       (SELECT count(*) FROM stats_lease_slots l
        WHERE l.slot <= st.active_lease_cap AND l.lease_until <= now()) AS free_slots,
       (SELECT count(*) FROM jobs) + (SELECT count(*) FROM runs) AS waiting,
       coalesce(extract(epoch FROM now() - least((SELECT min(since) FROM front),
                                                 (SELECT min(since) FROM runs))), 0)
           AS oldest_wait_seconds
FROM stats_projection_worker_settings st
WHERE st.id = 1;

-- name: build_pr_snapshot
-- The PR overview window of one generation: database date -1, 0 and +1. Per exercise
-- as of each date: all-time best Epley estimate (manual PR records included), the best
-- in the rolling 30 days ending on it, the same window a year earlier, and the heaviest
-- weight. Built whole at publication and moved day by day by stats_roll_one; the reader
-- never computes.
WITH days AS (
    SELECT (stats_clock_date() + d)::date AS as_of FROM generate_series(-1, 1) AS d
),
facts AS (
    SELECT ts.exercise_id, s.session_date AS day, ts.weight_kg,
           estimated_one_rep_max(ts.weight_kg, ts.reps) AS e1rm
    FROM training_sessions s
    JOIN training_sets ts ON ts.session_id = s.id
    WHERE s.user_id = %(user_id)s AND NOT ts.warmup
    UNION ALL
    SELECT exercise_id, recorded_on, weight_kg, estimated_one_rep_max(weight_kg, reps)
    FROM user_manual_pr_records
    WHERE user_id = %(user_id)s
),
headers AS (
    INSERT INTO user_pr_overview_snapshot_headers
        (user_id, generation, as_of_date, catalog_epoch, exercise_count)
    SELECT %(user_id)s, %(generation)s, days.as_of,
           (SELECT catalog_epoch FROM pr_overview_projection_control WHERE id = 1),
           (SELECT count(DISTINCT f.exercise_id) FROM facts f WHERE f.day <= days.as_of)
    FROM days
    RETURNING as_of_date
)
INSERT INTO user_pr_exercise_summary_snapshots
    (user_id, generation, as_of_date, exercise_id, best_e1rm_all_time, best_e1rm_30d,
     best_e1rm_30d_prior_year, heaviest_kg)
SELECT %(user_id)s, %(generation)s, h.as_of_date, f.exercise_id,
       max(f.e1rm),
       max(f.e1rm) FILTER (WHERE f.day > h.as_of_date - 30),
       max(f.e1rm) FILTER (
           WHERE f.day > (h.as_of_date - interval '1 year')::date - 30
             AND f.day <= (h.as_of_date - interval '1 year')::date),
       max(f.weight_kg)
FROM headers h
JOIN facts f ON f.day <= h.as_of_date
GROUP BY h.as_of_date, f.exercise_id;

-- name: drop_older_snapshots
-- Only the generation being published keeps a window (rebuilt whole if it existed); an
-- older job never publishes after a newer one (the base check).
DELETE FROM user_pr_overview_snapshot_headers
WHERE user_id = %(user_id)s AND generation <= %(generation)s;

-- name: schedule_rollover
-- The window is fresh: the next rollover is due when the database date moves on.
INSERT INTO user_pr_overview_rollover_state AS r
    (user_id, due_at, snapshot_generation, applied_catalog_epoch, window_end,
     last_success_at)
SELECT %(user_id)s, (stats_clock_date() + 1)::timestamptz, %(generation)s,
       (SELECT catalog_epoch FROM pr_overview_projection_control WHERE id = 1),
       stats_clock_date() + 1, now()
ON CONFLICT (user_id) DO UPDATE
SET due_at = EXCLUDED.due_at,
    snapshot_generation = EXCLUDED.snapshot_generation,
    applied_catalog_epoch = EXCLUDED.applied_catalog_epoch,
    window_end = EXCLUDED.window_end,
    attempt_count = 0,
    next_retry_at = NULL,
    last_error = NULL,
    last_success_at = now(),
    updated_at = now();

-- name: set_lock_timeout
SET LOCAL lock_timeout = '1s';

-- name: request_rollover
-- One due user's rollover as one call, its own transaction: the next due user after
-- the tick's last one gets a new generation requested (or waits for its pending one);
-- no row when nobody is due.
SELECT roll_due_at, roll_user_id, roll_outcome
FROM stats_request_rollover(%(after_due)s::timestamptz, %(after_user)s::uuid);

-- name: request_generation
-- A new generation for one user: the worker publishes it (never a patch of the applied
-- generation in place).
SELECT enqueue_user_exercise_stats_refresh_job(
    %(user_id)s, %(event_type)s, %(from_date)s, '{}', %(reason)s, %(source_ref)s,
    bump_stats_requested_version(%(user_id)s)) AS job_id;

-- name: rollover_overview
-- What an operator watches before the three-day window runs out.
SELECT count(*) FILTER (WHERE due_at <= now()) AS due_backlog,
       max(attempt_count) AS max_attempts,
       min(last_success_at) AS oldest_success,
       count(*) FILTER (WHERE last_error IS NOT NULL) AS failing_users,
       (array_agg(last_error ORDER BY updated_at DESC) FILTER (WHERE last_error IS NOT NULL))[1]
           AS last_error
FROM user_pr_overview_rollover_state;

-- name: maintenance_due
-- What the rollover job would do now: users whose PR overview window is due, catalog
-- scopes with an unanswered token (or a global pass under way), and rebuild passes a
-- killed run left idle for `idle_seconds`. All zero: a run would find nothing.
SELECT (SELECT count(*) FROM user_pr_overview_rollover_state WHERE due_at <= now())
           AS rollover_users,
       (SELECT count(*) FROM catalog_invalidation_tokens
        WHERE token > processed_token OR (scope = 'global' AND pass_token IS NOT NULL))
           AS catalog_scopes,
       (SELECT count(*) FROM stats_rebuild_passes
        WHERE finished_at IS NULL
          AND updated_at <= now() - make_interval(secs => %(idle_seconds)s))
           AS abandoned_rebuilds;

-- name: catalog_next_personal
-- One personal catalog scope with an unanswered token, locked for this transaction
-- (scopes that failed in this tick are passed over until the next one).
SELECT scope, token
FROM catalog_invalidation_tokens
WHERE scope <> 'global' AND token > processed_token
  AND NOT (scope = ANY (%(skipped)s::text[]))
ORDER BY scope
LIMIT 1
FOR UPDATE SKIP LOCKED;

-- name: personal_scope_done
UPDATE catalog_invalidation_tokens
SET processed_token = %(token)s, updated_at = now()
WHERE scope = %(scope)s;

-- name: catalog_global_pass
-- The global scope while a pass is owed or running, locked for one step of the pass.
SELECT token, processed_token, pass_token, cursor
FROM catalog_invalidation_tokens
WHERE scope = 'global' AND (token > processed_token OR pass_token IS NOT NULL)
FOR UPDATE SKIP LOCKED;

-- name: users_after
-- The next user with a stats state after the cursor, by id (the global pass's keyset).
SELECT user_id FROM user_stats_refresh_state
WHERE %(cursor)s::uuid IS NULL OR user_id > %(cursor)s::uuid
ORDER BY user_id
LIMIT 1;

-- name: global_pass_progress
-- Move the global pass on; when it has seen every user, the token it answered is done.
UPDATE catalog_invalidation_tokens
SET pass_token = CASE WHEN %(done)s THEN NULL ELSE %(pass_token)s END,
    cursor = CASE WHEN %(done)s THEN NULL ELSE %(cursor)s::uuid END,
    processed_token = CASE WHEN %(done)s THEN greatest(processed_token, %(pass_token)s)
                           ELSE processed_token END,
    updated_at = now()
WHERE scope = 'global';

-- name: scan_page
-- The scanner's next page of users by id after its cursor (users with sessions,
-- projections or a stats state), with the cursor row locked so two scanners never walk
-- the same page. No row: another scanner holds it.
WITH position AS (
    SELECT cursor FROM stats_scan_cursor WHERE id = 1 FOR UPDATE SKIP LOCKED
)
SELECT p.cursor,
       coalesce((
           SELECT array_agg(u.user_id ORDER BY u.user_id) FROM (
               SELECT user_id FROM (
                   (SELECT DISTINCT user_id FROM training_sessions
                    WHERE p.cursor IS NULL OR user_id > p.cursor
                    ORDER BY user_id LIMIT %(limit)s)
                   UNION
                   (SELECT user_id FROM user_stats_refresh_state
                    WHERE p.cursor IS NULL OR user_id > p.cursor
                    ORDER BY user_id LIMIT %(limit)s)
                   UNION
                   (SELECT DISTINCT user_id FROM user_exercise_stats
                    WHERE p.cursor IS NULL OR user_id > p.cursor
                    ORDER BY user_id LIMIT %(limit)s)
               ) AS candidates
               ORDER BY user_id
               LIMIT %(limit)s
           ) AS u), '{}') AS user_ids
FROM position p;

-- name: scan_advance
-- The page is taken: the cursor moves past it (NULL after a short page: the next page
-- starts a new lap).
UPDATE stats_scan_cursor
SET cursor = %(cursor)s::uuid,
    laps = laps + CASE WHEN %(cursor)s::uuid IS NULL THEN 1 ELSE 0 END,
    updated_at = now()
WHERE id = 1;

-- name: stale_users
-- The backfill scanner's signals for one page of users: a range owed by a failed job
-- whose last failure is an hour old (a range that keeps failing is retried hourly, never
-- in a loop), sessions without rollups, rollups without period stats, rollups newer
-- than period stats, and PR snapshot gaps (the applied generation has no window for
-- today). Users with open work are left to it (its claim takes in an owed range).
SELECT user_id, min(signal) AS signal FROM (
    SELECT o.user_id, 'owed range' AS signal
    FROM user_stats_owed_ranges o
    WHERE o.user_id = ANY (%(user_ids)s::uuid[])
      AND o.updated_at <= now() - interval '1 hour'
    UNION ALL
    SELECT DISTINCT s.user_id, 'sessions without rollups'
    FROM training_sessions s
    WHERE s.user_id = ANY (%(user_ids)s::uuid[])
      AND EXISTS (SELECT 1 FROM training_sets ts WHERE ts.session_id = s.id)
      AND NOT EXISTS (SELECT 1 FROM user_exercise_stats e WHERE e.user_id = s.user_id)
    UNION ALL
    SELECT DISTINCT e.user_id, 'rollups without period stats'
    FROM user_exercise_stats e
    WHERE e.user_id = ANY (%(user_ids)s::uuid[])
      AND NOT EXISTS (SELECT 1 FROM user_training_period_stats p WHERE p.user_id = e.user_id)
    UNION ALL
    SELECT e.user_id, 'rollups newer than period stats'
    FROM (SELECT user_id, max(generation) AS g FROM user_exercise_stats
          WHERE user_id = ANY (%(user_ids)s::uuid[]) GROUP BY user_id) e
    JOIN (SELECT user_id, max(generation) AS g FROM user_training_period_stats
          WHERE user_id = ANY (%(user_ids)s::uuid[]) GROUP BY user_id) p
      ON p.user_id = e.user_id
    WHERE e.g > p.g
    UNION ALL
    SELECT st.user_id, 'PR snapshot gap'
    FROM user_stats_refresh_state st
    WHERE st.user_id = ANY (%(user_ids)s::uuid[])
      AND st.applied_version > 0
      AND NOT EXISTS (
          SELECT 1 FROM user_pr_overview_snapshot_headers h
          WHERE h.user_id = st.user_id AND h.generation = st.applied_version
            AND h.as_of_date = stats_clock_date())
) AS signals
WHERE NOT EXISTS (
    SELECT 1 FROM user_exercise_stats_refresh_jobs j
    WHERE j.user_id = signals.user_id AND j.status IN ('pending', 'processing')
)
GROUP BY user_id
ORDER BY user_id;

-- name: prune_catalog_log
-- The catalog change log is execution history: the tokens carry every request.
WITH doomed AS (
    SELECT seq FROM exercise_catalog_changes
    WHERE changed_at < now() - make_interval(days => %(days)s)
    ORDER BY seq
    LIMIT %(limit)s
)
DELETE FROM exercise_catalog_changes c USING doomed WHERE c.seq = doomed.seq;

-- name: read_pr_overview
-- The header and the rows in one statement (one snapshot): a header without rows is a
-- window that holds no exercise, and still says whether it is stale.
SELECT h.generation, h.as_of_date, h.stale, o.exercise_id, o.best_e1rm_all_time,
       o.best_e1rm_30d, o.best_e1rm_30d_prior_year, o.heaviest_kg
FROM get_pr_overview_status(%(user_id)s, %(as_of)s) AS h
LEFT JOIN LATERAL get_pr_overview(%(user_id)s, %(as_of)s) AS o ON true
ORDER BY o.exercise_id;
