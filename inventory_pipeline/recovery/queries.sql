-- Every statement of provider observation and recovery (docs/provider-recovery.md).

-- name: provider_settings
SELECT api_key, active, language, credential_generation FROM provider_settings
WHERE provider = 'tmdb';

-- name: save_provider_settings
-- A language left out (NULL) keeps the saved one: a new key alone changes the key alone.
UPDATE provider_settings
SET api_key = %(api_key)s, active = %(active)s, language = coalesce(%(language)s, language),
    updated_at = now()
WHERE provider = 'tmdb';

-- name: due_items
-- Items due for observation, by the definitions the claims use too: `observation_due`
-- (migration 0017), and approved replacements awaiting their first observation
-- (`replacement_due`, migration 0018).
SELECT (SELECT count(*)
        FROM media_server_items i
        JOIN libraries l ON l.id = i.library_id
        JOIN media_servers m ON m.id = l.server_id
        WHERE observation_due(i, l, m))
     + (SELECT count(*)
        FROM replacement_proposals p
        JOIN media_server_items i ON i.id = p.item_id
        JOIN libraries l ON l.id = i.library_id
        JOIN media_servers m ON m.id = l.server_id
        WHERE p.state = 'approved' AND p.attempted_at IS NULL
          AND replacement_due(p, i, l, m)) AS due;

-- name: claim_due
-- docs/provider-recovery.md#claim-and-lease.
-- Compare-and-set claim before provider I/O, each item under a fresh UUID
-- and a five-minute lease; SKIP LOCKED so concurrent observers never double-claim.
-- Each item's library is locked first (key share, the lock order of every statement
-- that reaches a library's rows): the items of a library being deleted are skipped.
-- The walk is driven by the due index in its order and stops after `limit` items: the
-- library test is a lateral step per item (its own locking clause keeps it from being
-- joined first), so no estimate of the small libraries table (which autovacuum may
-- never analyze) can turn the claim into reading and sorting every due item.
-- Returns the source snapshot the completion is bound to, and the approved replacement
-- the item is observed under instead of its own id (`approved_replacement`, migration
-- 0018; docs/identity-revalidation.md#replacement), read under the item's lock, so of
-- that same source generation.
-- Due means `observation_due` (migration 0017), the count's own definition. Inlined,
-- its item terms stay on the walk of the due index and its library terms filter the
-- lateral library step.
WITH due AS (
    SELECT i.id, i.source_generation
    FROM media_server_items i
    CROSS JOIN LATERAL (
        SELECT l, m
        FROM libraries l
        JOIN media_servers m ON m.id = l.server_id
        WHERE l.id = i.library_id
        FOR KEY SHARE OF l SKIP LOCKED
    ) AS library
    WHERE observation_due(i, library.l, library.m)
    ORDER BY i.observation_due_at, i.id
    LIMIT %(limit)s
    FOR UPDATE OF i SKIP LOCKED
)
UPDATE media_server_items i
SET observation_lease_token = gen_random_uuid(),
    observation_lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
FROM due
LEFT JOIN LATERAL approved_replacement(due.id, due.source_generation) AS r ON true
WHERE i.id = due.id
RETURNING i.id, i.title, i.provider_kind, i.provider_id, i.source_generation,
          i.observation_lease_token,
          i.recovery_case_id, i.recovery_category, i.recovery_cause_attempts, i.recovery_resolved_at,
          r.proposal_id, r.tmdb_id AS replacement_tmdb_id;

-- name: claim_replacements
-- docs/identity-revalidation.md#replacement.
-- The first observation after an operator's approval comes at once, not after the
-- item's backoff: approved replacements awaiting it (`replacement_due`, migration 0018),
-- oldest decision first, each item claimed like `claim_due` (library key share first,
-- SKIP LOCKED, a fresh UUID and lease) under the approved candidate's id.
WITH due AS (
    SELECT i.id, p.id AS proposal_id, p.candidate_tmdb_id
    FROM replacement_proposals p
    JOIN media_server_items i ON i.id = p.item_id
    CROSS JOIN LATERAL (
        SELECT l, m
        FROM libraries l
        JOIN media_servers m ON m.id = l.server_id
        WHERE l.id = i.library_id
        FOR KEY SHARE OF l SKIP LOCKED
    ) AS library
    WHERE p.state = 'approved' AND p.attempted_at IS NULL
      AND replacement_due(p, i, library.l, library.m)
    ORDER BY p.decided_at, p.id
    LIMIT %(limit)s
    FOR UPDATE OF i SKIP LOCKED
)
UPDATE media_server_items i
SET observation_lease_token = gen_random_uuid(),
    observation_lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
FROM due
WHERE i.id = due.id
RETURNING i.id, i.title, i.provider_kind, i.provider_id, i.source_generation,
          i.observation_lease_token,
          i.recovery_case_id, i.recovery_category, i.recovery_cause_attempts, i.recovery_resolved_at,
          due.proposal_id, due.candidate_tmdb_id AS replacement_tmdb_id;

-- name: completion_lock_timeout
-- A completion waits for its library's state at most this long (then it is retried).
SET LOCAL lock_timeout = '2s';

-- name: ensure_observed_library_state
-- docs/provider-recovery.md#lock-order.
-- The first statement of an observed completion's transaction: the item's library (key
-- share) and, when a write that skipped triggers (a restore, a replication apply)
-- created the library without one, its inventory state row, as a new library gets it.
-- An existing row is neither locked nor changed here.
INSERT INTO library_inventory_state (library_id)
SELECT l.id
FROM libraries l
WHERE l.id = (SELECT i.library_id FROM media_server_items i WHERE i.id = %(item_id)s)
FOR KEY SHARE
ON CONFLICT (library_id) DO NOTHING;

-- name: lock_observed_library
-- docs/provider-recovery.md#lock-order.
-- The second statement of an observed completion's transaction: the item's library (key
-- share: a deletion in flight is waited for, after which nothing is returned), then the
-- library's inventory state, in the profiles' lock order (library, state, then rows).
-- The library is locked in the scalar subquery, which runs before the state row is
-- read. The completion waits here holding no item, and then takes the item without
-- waiting (a sync program holds the items it writes until it commits).
SELECT s.library_id
FROM library_inventory_state s
WHERE s.library_id = (
    SELECT l.id
    FROM libraries l
    WHERE l.id = (SELECT i.library_id FROM media_server_items i WHERE i.id = %(item_id)s)
    FOR KEY SHARE
)
FOR NO KEY UPDATE;

-- name: complete_observed
-- docs/provider-recovery.md#completion-fence.
-- One guarded statement saves the validated observation, resolves an open
-- case, sets the recheck deadline, releases the lease and counts the attempt. Only the
-- current lease token and source generation match. An observation under an approved
-- replacement also records it as attempted and as replaced (the case resolves as
-- replaced, docs/identity-revalidation.md#replacement). Runs after
-- `lock_observed_library` in its transaction: the item must still be in the library
-- whose state that locked, and is locked without waiting (55P03 when a writer holds it:
-- the completion is retried).
WITH before AS (
    SELECT id, recovery_case_id, recovery_resolved_at, recovery_category, recovery_attempts
    FROM media_server_items
    WHERE id = %(item_id)s
      AND observation_lease_token = %(lease_token)s
      AND source_generation = %(source_generation)s
      AND library_id = %(library_id)s
      -- Nothing is applied without approval: an observation of another id than the
      -- item's own is saved only under an approved proposal of this source naming it.
      AND (tmdb_id_of(provider_id) = %(tmdb_id)s
           OR EXISTS (
               SELECT FROM replacement_proposals p
               WHERE p.item_id = %(item_id)s
                 AND p.source_generation = %(source_generation)s
                 AND p.state = 'approved'
                 AND p.candidate_tmdb_id = %(tmdb_id)s))
    FOR UPDATE NOWAIT
),
item AS (
    UPDATE media_server_items i
    SET original_language = COALESCE(%(original_language)s, i.original_language),
        observed_at = now(),
        last_attempt_at = now(),
        observation_due_at = now() + make_interval(secs => %(recheck_seconds)s),
        observation_lease_token = NULL,
        observation_lease_expires_at = NULL,
        observation_attempts = i.observation_attempts + 1,
        observation_successes = i.observation_successes + 1,
        recovery_resolved_at = CASE
            WHEN i.recovery_case_id IS NOT NULL AND i.recovery_resolved_at IS NULL THEN now()
            ELSE i.recovery_resolved_at END
    FROM before
    WHERE i.id = before.id
    RETURNING i.id, i.source_generation, i.observation_due_at
),
saved AS (
    INSERT INTO provider_observations AS o (
        item_id, source_generation, provider_kind, tmdb_id, title, genres, vote_average,
        vote_count, original_language, companies, release_date, status, observed_at,
        imdb_id, tvdb_id)
    SELECT item.id, item.source_generation, %(provider_kind)s, %(tmdb_id)s, %(title)s,
           %(genres)s, %(vote_average)s, %(vote_count)s, %(original_language)s,
           %(companies)s, %(release_date)s, %(status)s, now(), %(imdb_id)s, %(tvdb_id)s
    FROM item
    ON CONFLICT (item_id) DO UPDATE
    SET source_generation = EXCLUDED.source_generation,
        provider_kind = EXCLUDED.provider_kind,
        tmdb_id = EXCLUDED.tmdb_id,
        title = EXCLUDED.title,
        genres = EXCLUDED.genres,
        vote_average = EXCLUDED.vote_average,
        vote_count = EXCLUDED.vote_count,
        original_language = EXCLUDED.original_language,
        companies = EXCLUDED.companies,
        release_date = EXCLUDED.release_date,
        status = EXCLUDED.status,
        observed_at = EXCLUDED.observed_at,
        imdb_id = EXCLUDED.imdb_id,
        tvdb_id = EXCLUDED.tvdb_id
    RETURNING o.item_id
),
replacement AS (
    UPDATE replacement_proposals p
    SET attempted_at = COALESCE(p.attempted_at, now()),
        replaced_at = COALESCE(p.replaced_at, now())
    FROM item
    WHERE p.id = %(proposal_id)s::bigint
      AND p.item_id = item.id
      AND p.source_generation = item.source_generation
      AND p.state = 'approved'
    RETURNING p.id
)
SELECT item.id, item.observation_due_at,
       before.recovery_case_id AS case_id,
       before.recovery_case_id IS NOT NULL AND before.recovery_resolved_at IS NULL AS resolved,
       before.recovery_category AS previous_category,
       before.recovery_attempts AS attempts,
       (SELECT count(*) FROM saved) AS saved,
       (SELECT count(*) FROM replacement) > 0 AS replaced
FROM item, before;

-- name: complete_failed
-- docs/provider-recovery.md#completion-fence.
-- One guarded statement records the failure on the item's one recovery
-- record: a new case (fresh opaque id) when none is open, else the same case with its
-- attempts counted and its cause updated (the failures under the cause count anew when
-- it changes: each cause's backoff starts at its own start); the credential generation the request was
-- sent with (docs/credentials.md#release); the retry deadline; lease release; counters.
-- An attempt under an approved replacement records it as attempted. A not_found case
-- of two or more failures whose source was once observed with external ids is queued
-- for revalidation (docs/identity-revalidation.md#eligibility): at once when new, again
-- after each further failure when its record was set aside (a check concluded, or the
-- case was not eligible when walked, whatever faults came before), never while it is
-- proposed, due or waiting out a fault.
WITH before AS (
    SELECT id, recovery_case_id, recovery_resolved_at, recovery_category
    FROM media_server_items
    WHERE id = %(item_id)s
      AND observation_lease_token = %(lease_token)s
      AND source_generation = %(source_generation)s
    FOR UPDATE
),
item AS (
    UPDATE media_server_items i
    SET recovery_case_id = CASE
            WHEN before.recovery_case_id IS NULL OR before.recovery_resolved_at IS NOT NULL
            THEN gen_random_uuid() ELSE i.recovery_case_id END,
        recovery_provider = i.provider,
        recovery_provider_kind = i.provider_kind,
        recovery_provider_id = i.provider_id,
        recovery_category = %(category)s,
        recovery_attempts = CASE
            WHEN before.recovery_case_id IS NULL OR before.recovery_resolved_at IS NOT NULL
            THEN 1 ELSE i.recovery_attempts + 1 END,
        recovery_cause_attempts = CASE
            WHEN before.recovery_case_id IS NULL OR before.recovery_resolved_at IS NOT NULL
                 OR before.recovery_category IS DISTINCT FROM %(category)s
            THEN 1 ELSE i.recovery_cause_attempts + 1 END,
        recovery_first_failed_at = CASE
            WHEN before.recovery_case_id IS NULL OR before.recovery_resolved_at IS NOT NULL
            THEN now() ELSE i.recovery_first_failed_at END,
        recovery_last_failed_at = now(),
        recovery_credential_generation = %(credential_generation)s::uuid,
        recovery_resolved_at = NULL,
        observation_due_at = now() + make_interval(secs => %(delay_seconds)s),
        observation_lease_token = NULL,
        observation_lease_expires_at = NULL,
        last_attempt_at = now(),
        observation_attempts = i.observation_attempts + 1
    FROM before
    WHERE i.id = before.id
    RETURNING i.id, i.recovery_case_id, i.recovery_attempts, i.observation_due_at
),
replacement AS (
    UPDATE replacement_proposals p
    SET attempted_at = COALESCE(p.attempted_at, now())
    FROM item
    WHERE p.id = %(proposal_id)s::bigint
      AND p.item_id = item.id
      AND p.source_generation = %(source_generation)s
      AND p.state = 'approved'
    RETURNING p.id
),
revalidation AS (
    INSERT INTO identity_revalidations AS r (case_id, item_id, source_generation)
    SELECT item.recovery_case_id, item.id, %(source_generation)s
    FROM item
    WHERE %(category)s = 'not_found'
      AND item.recovery_attempts >= 2
      AND EXISTS (
          SELECT FROM provider_observations o
          WHERE o.item_id = item.id
            AND o.source_generation = %(source_generation)s
            AND (o.imdb_id IS NOT NULL OR o.tvdb_id IS NOT NULL))
    ON CONFLICT (case_id) DO UPDATE
    SET due_at = now()
    WHERE r.outcome IS DISTINCT FROM 'proposed' AND r.due_at IS NULL
    RETURNING r.case_id
)
SELECT item.id, item.recovery_case_id AS case_id, item.recovery_attempts AS attempts,
       item.observation_due_at,
       before.recovery_case_id IS NULL OR before.recovery_resolved_at IS NOT NULL AS opened,
       before.recovery_category AS previous_category,
       (SELECT count(*) FROM revalidation) > 0 AS revalidation_queued
FROM item, before;

-- name: release_claim
-- A claim whose request was never sent (admission paused or refused) goes back as it
-- came: lease cleared, no attempt counted, no case touched, due time unchanged, so the
-- item is first in line when admission resumes. Only the current lease token matches.
UPDATE media_server_items
SET observation_lease_token = NULL,
    observation_lease_expires_at = NULL
WHERE id = %(item_id)s
  AND observation_lease_token = %(lease_token)s
  AND source_generation = %(source_generation)s
RETURNING id;

-- name: give_back_interrupted
-- A claim whose answer could not be recorded (a transient database error: another
-- program's transaction holds what the completion needs) goes back with no attempt
-- counted and no case touched, due again no sooner than %(delay_seconds)s after it is
-- given back: the run that sent it does not send it again at once (no immediate retry
-- loop). The item is locked first and the clock read after: the give-back may wait for
-- the item behind a sync program's write for longer than the delay, and an UPDATE
-- computes its new values before it waits for the row.
WITH held AS (
    SELECT id
    FROM media_server_items
    WHERE (id, observation_lease_token, source_generation)
        = (%(item_id)s, %(lease_token)s, %(source_generation)s)
    FOR UPDATE
)
UPDATE media_server_items i
SET observation_lease_token = NULL,
    observation_lease_expires_at = NULL,
    observation_due_at = greatest(i.observation_due_at,
                                  clock_timestamp() + make_interval(secs => %(delay_seconds)s))
FROM held
WHERE i.id = held.id
RETURNING i.id, i.observation_due_at;

-- name: overdue_cases
-- Open cases an observation may claim (`observation_due`: an active library and server,
-- no live attempt) past their deadline by more than the grace: the observer is not
-- keeping up (or not running). The oldest `limit`, each with the whole count.
SELECT i.id, i.recovery_category, i.observation_due_at, count(*) OVER () AS total
FROM media_server_items i
JOIN libraries l ON l.id = i.library_id
JOIN media_servers m ON m.id = l.server_id
WHERE i.recovery_case_id IS NOT NULL
  AND i.recovery_resolved_at IS NULL
  AND i.observation_due_at < now() - make_interval(secs => %(grace_seconds)s)
  AND observation_due(i, l, m)
ORDER BY i.observation_due_at
LIMIT %(limit)s;

-- name: inactive_open_cases
-- Open cases no observation may claim because their library or server is inactive:
-- they wait for its owner, not for the observer.
SELECT count(*) AS waiting
FROM media_server_items i
JOIN libraries l ON l.id = i.library_id
JOIN media_servers m ON m.id = l.server_id
WHERE i.recovery_case_id IS NOT NULL
  AND i.recovery_resolved_at IS NULL
  AND NOT (l.active AND m.active);

-- name: case_overview
SELECT recovery_category AS category, count(*) AS open_cases
FROM media_server_items
WHERE recovery_case_id IS NOT NULL AND recovery_resolved_at IS NULL
GROUP BY recovery_category
ORDER BY recovery_category;

-- name: oldest_open_cases
-- The open cases failing longest, with what a person finds the item by: its title,
-- library and typed identity.
SELECT i.id AS item_id, i.title, l.name AS library, i.provider_kind, i.provider_id,
       i.recovery_category AS category, i.recovery_attempts AS attempts,
       i.recovery_first_failed_at AS first_failed_at, i.observation_due_at AS next_attempt_at
FROM media_server_items i
JOIN libraries l ON l.id = i.library_id
WHERE i.recovery_case_id IS NOT NULL AND i.recovery_resolved_at IS NULL
ORDER BY i.recovery_first_failed_at, i.id
LIMIT %(limit)s;

-- name: case_ages
-- The standing view of open cases: per category the count, the age of the oldest
-- (since its first failure) and how many are due for an attempt now.
SELECT recovery_category AS category,
       count(*) AS open_cases,
       floor(extract(epoch FROM now() - min(recovery_first_failed_at)))::bigint
           AS oldest_age_seconds,
       count(*) FILTER (WHERE observation_due_at <= now()) AS due_now
FROM media_server_items
WHERE recovery_case_id IS NOT NULL AND recovery_resolved_at IS NULL
GROUP BY recovery_category
ORDER BY recovery_category;
