-- Every statement of the inventory-driven profile refresh (docs/profiles.md).
-- Lock order everywhere (docs/profiles.md#lock-order): the libraries row (FOR KEY SHARE),
-- then its library_inventory_state row, then profile_refresh_requests rows, libraries in id
-- order. Deleting a library locks its row first and then cascades into state, requests
-- and profiles; the key-share lock is also what the foreign-key check of an insert
-- takes. Taking it before anything else of the library means a statement either holds
-- the library (the deletion waits for it) or never touches the library's rows (a
-- background statement skips it, a waiting one finds it gone). It does not block
-- ordinary updates of a library (name, active). Statements that touch only request rows
-- (expire_leases, fail_claim, claim_requests) never wait while holding another lock.

-- name: fold_changes
-- docs/profiles.md#change-capture: the captured change rows become revisions.
SELECT fold_inventory_changes() AS folded;

-- name: expire_leases
-- A running request whose lease ran out goes back to pending (or fails for good on its
-- last attempt). The database, not Dagster, decides that a run worker is gone.
UPDATE profile_refresh_requests r
SET status = CASE WHEN r.attempts >= r.max_attempts THEN 'failed' ELSE 'pending' END,
    finished_at = CASE WHEN r.attempts >= r.max_attempts THEN now() END,
    available_at = now() + make_interval(secs => %(retry_seconds)s * 2 ^ (r.attempts - 1)),
    lease_token = NULL,
    lease_expires_at = NULL,
    last_error = 'lease_expired',
    last_error_sqlstate = NULL
FROM (
    SELECT id FROM profile_refresh_requests
    WHERE status = 'running' AND lease_expires_at <= now()
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
) AS expired
WHERE r.id = expired.id
RETURNING r.id, r.library_id, r.status;

-- name: plan_inventory_requests
-- docs/profiles.md#planning.
-- Select the oldest 25 dirty active-library candidates, then lock them in
-- library-id order with SKIP LOCKED, and queue one inventory_change request each at
-- the revision seen under the lock. Libraries with active work, or whose latest
-- terminal request failed within the circuit probe interval, wait. Each row locks its
-- library before its state (locking clauses lock in the order they are written); a
-- library being deleted is skipped.
-- The walk of the dirty index starts after (after_since, after_id): a tick's next pass
-- continues where the previous one stopped instead of walking again every backlogged
-- library it already passed over. Every row reports how many candidates the pass found
-- and the last one's position (a pass that inserts nothing returns one row of NULLs).
WITH backlog AS (
    -- Dirty libraries of active servers without active work, oldest first. OFFSET 0
    -- keeps this a separate step, so the circuit probe below only runs for the libraries
    -- that pass it, not for every backlogged one.
    SELECT s.library_id, s.dirty_since
    FROM library_inventory_state s
    JOIN libraries l ON l.id = s.library_id
    JOIN media_servers m ON m.id = l.server_id
    WHERE s.revision > s.acknowledged_revision
      AND (s.dirty_since, s.library_id) > (%(after_since)s::timestamptz, %(after_id)s::bigint)
      AND l.active
      AND m.active
      AND NOT EXISTS (
          SELECT 1 FROM profile_refresh_requests a
          WHERE a.library_id = s.library_id AND a.status IN ('pending', 'running')
      )
    ORDER BY s.dirty_since, s.library_id
    OFFSET 0
),
candidate AS (
    SELECT b.library_id, b.dirty_since
    FROM backlog b
    WHERE NOT EXISTS (
          SELECT FROM recent_refresh_failure(b.library_id, %(circuit_probe_seconds)s)
      )
    ORDER BY b.dirty_since, b.library_id
    LIMIT %(limit)s
),
locked AS (
    SELECT s.library_id, s.revision
    FROM library_inventory_state s
    JOIN libraries l ON l.id = s.library_id
    WHERE s.library_id IN (SELECT library_id FROM candidate)
      AND s.revision > s.acknowledged_revision
    ORDER BY s.library_id
    FOR KEY SHARE OF l SKIP LOCKED
    FOR UPDATE OF s SKIP LOCKED
),
inserted AS (
    INSERT INTO profile_refresh_requests (library_id, kind, source, reason, inventory_revision)
    SELECT locked.library_id, 'inventory_change', %(source)s, %(reason)s, locked.revision
    FROM locked
    ORDER BY locked.library_id
    ON CONFLICT (library_id) WHERE status IN ('pending', 'running') DO NOTHING
    RETURNING id, library_id, inventory_revision
),
walked AS (
    SELECT count(*) AS candidates,
           max(c.dirty_since) AS last_since,
           (SELECT c2.library_id FROM candidate c2
            ORDER BY c2.dirty_since DESC, c2.library_id DESC LIMIT 1) AS last_id
    FROM candidate c
)
SELECT i.id, i.library_id, i.inventory_revision, w.candidates, w.last_since, w.last_id
FROM walked w
LEFT JOIN inserted i ON true
ORDER BY i.library_id;

-- name: plan_native_requests
-- The existing native-policy discovery: nonempty active libraries with an enabled
-- policy and active intent whose profile is missing or older than the native age.
-- Each library is locked (key share) before its request is inserted; a library being
-- deleted is skipped, so the foreign-key check never waits for a deletion and then
-- fails the whole batch.
INSERT INTO profile_refresh_requests (library_id, kind, source, reason)
SELECT l.id, 'native', %(source)s, %(reason)s
FROM libraries l
JOIN media_servers m ON m.id = l.server_id
JOIN library_policies p ON p.library_id = l.id
LEFT JOIN library_profiles pr ON pr.library_id = l.id
WHERE l.active
  AND m.active
  AND p.enabled
  AND p.intent = 'active'
  AND EXISTS (SELECT 1 FROM media_server_items i WHERE i.library_id = l.id)
  AND (pr.library_id IS NULL
       OR pr.generated_at < now() - make_interval(secs => %(native_max_age_seconds)s))
  AND NOT EXISTS (
      SELECT 1 FROM profile_refresh_requests a
      WHERE a.library_id = l.id AND a.status IN ('pending', 'running')
  )
  AND NOT EXISTS (SELECT FROM recent_refresh_failure(l.id, %(circuit_probe_seconds)s))
ORDER BY l.id
LIMIT %(limit)s
FOR KEY SHARE OF l SKIP LOCKED
ON CONFLICT (library_id) WHERE status IN ('pending', 'running') DO NOTHING
RETURNING id, library_id;

-- name: request_learning_refresh
-- The learning flow's entry point: a refresh carrying its learning identifiers.
INSERT INTO profile_refresh_requests
    (library_id, kind, source, reason, learning_id, classification_id, candidate_id)
VALUES (%(library_id)s, 'learning', %(source)s, %(reason)s,
        %(learning_id)s, %(classification_id)s, %(candidate_id)s)
ON CONFLICT (library_id) WHERE status IN ('pending', 'running') DO NOTHING
RETURNING id;

-- name: lock_states
-- An analyst's backfill locks each library (key share) and then its state, in
-- library-id order, before touching their requests. Without waiting: the repository
-- waits for a busy library alone (`wait_for_state`) and tries again, so the backfill
-- never waits while it holds another library (a deletion of several libraries in one
-- statement locks them in its own order).
SELECT s.library_id, s.revision, s.acknowledged_revision, l.active AND m.active AS active
FROM library_inventory_state s
JOIN libraries l ON l.id = s.library_id
JOIN media_servers m ON m.id = l.server_id
WHERE s.library_id = ANY (%(library_ids)s)
ORDER BY s.library_id
FOR KEY SHARE OF l SKIP LOCKED
FOR UPDATE OF s SKIP LOCKED;

-- name: present_states
-- The libraries of a backfill that exist (a deletion in flight still shows its library).
SELECT s.library_id
FROM library_inventory_state s
JOIN libraries l ON l.id = s.library_id
JOIN media_servers m ON m.id = l.server_id
WHERE s.library_id = ANY (%(library_ids)s)
ORDER BY s.library_id;

-- name: wait_for_state
-- Wait until one busy library can be locked: its deletion commits (no row) or rolls
-- back, or a writer commits. Taken in a savepoint the repository rolls back at once.
SELECT s.library_id
FROM library_inventory_state s
JOIN libraries l ON l.id = s.library_id
WHERE s.library_id = %(library_id)s
FOR KEY SHARE OF l
FOR UPDATE OF s;

-- name: request_backfill
-- Enqueue an inventory_change at the current revision, or join the active request.
-- Only for libraries this transaction holds (`lock_states`): one being deleted by
-- another session is skipped rather than waited for by the foreign-key check.
WITH inserted AS (
    INSERT INTO profile_refresh_requests (library_id, kind, source, reason, inventory_revision)
    SELECT s.library_id, 'inventory_change', %(source)s, %(reason)s, s.revision
    FROM library_inventory_state s
    JOIN libraries l ON l.id = s.library_id
    WHERE s.library_id = ANY (%(library_ids)s) AND s.revision > 0
    ORDER BY s.library_id
    FOR KEY SHARE OF l SKIP LOCKED
    ON CONFLICT (library_id) WHERE status IN ('pending', 'running') DO NOTHING
    RETURNING id, library_id
)
SELECT id, library_id, true AS enqueued FROM inserted
UNION ALL
SELECT r.id, r.library_id, false AS enqueued
FROM profile_refresh_requests r
WHERE r.library_id = ANY (%(library_ids)s)
  AND r.status IN ('pending', 'running')
  AND r.library_id NOT IN (SELECT library_id FROM inserted);

-- name: claim_requests
-- Claim a batch under one lease token in one server-side call (the function holds the
-- statement: oldest available first, SKIP LOCKED, one more attempt, the lease). New
-- claims pause while a library (or its server) is inactive; its running work can
-- finish. Named requests (an analyst's backfill) are claimed at once, even in
-- backoff.
SELECT id, library_id, kind, inventory_revision, attempts, lease_token, lease_expires_at
FROM claim_profile_requests(%(lease_token)s, %(lease_seconds)s, %(limit)s,
                            %(request_ids)s::bigint[]);

-- name: count_claimable
-- How many requests a run could claim now (the claim's own predicate), counted up to
-- a bound: the sensor only needs to know how many runs the backlog fills.
SELECT count(*) AS claimable
FROM (
    SELECT 1
    FROM profile_refresh_requests r
    JOIN libraries l ON l.id = r.library_id
    JOIN media_servers m ON m.id = l.server_id
    WHERE r.status = 'pending' AND r.available_at <= now() AND l.active AND m.active
    LIMIT %(limit)s
) AS claimable;

-- name: count_dirty
-- Libraries whose inventory is ahead of their profile, counted up to a bound (the
-- dirty index): what a tick with nothing to claim says is still being worked on.
SELECT count(*) AS dirty
FROM (
    SELECT 1 FROM library_inventory_state
    WHERE revision > acknowledged_revision
    LIMIT %(limit)s
) AS dirty;

-- name: read_revision
-- Read in the same REPEATABLE READ snapshot as the projection: the revision the
-- generated profile reflects, its change rows not yet folded included (a fold moves
-- them into the state row in one transaction, so a snapshot counts each once).
SELECT s.revision + (SELECT count(*) FROM library_inventory_changes c
                     WHERE c.library_id = s.library_id) AS revision
FROM library_inventory_state s
WHERE s.library_id = %(library_id)s;

-- name: read_snapshot
-- The profile reader: the shared projection of every item of one library.
SELECT o.provider, o.provider_kind, o.rating::double precision AS rating, o.genres,
       o.primary_studio, o.original_language
FROM media_server_items i
CROSS JOIN LATERAL (SELECT (inventory_observation_of(i)).*) AS o
WHERE i.library_id = %(library_id)s;

-- name: complete_claim
-- docs/profiles.md#completion-fence, docs/profiles.md#acknowledged-revision.
-- Complete the claim and acknowledge exactly its requested revision in one
-- statement, with GREATEST so a late claim cannot move acknowledgement backwards. A
-- lost claim (other token, expired lease, not running) matches no row and changes
-- nothing. The library (key share) and then its state row are locked first (lock
-- order library -> state -> request), waiting for a deletion in flight: once the
-- library is gone nothing matches and the claim is lost, with nothing to acknowledge.
-- The lease is checked against the clock read once the state row is held: a sync
-- program's transaction may hold it for longer than the lease, and now() is when the
-- statement began. Publication or the guarded deletion of an empty library's profile
-- happens only with the claim.
WITH state AS (
    SELECT s.library_id
    FROM library_inventory_state s
    JOIN libraries l ON l.id = s.library_id
    WHERE s.library_id = %(library_id)s
    FOR KEY SHARE OF l
    FOR UPDATE OF s
),
held AS (
    SELECT library_id, clock_timestamp() AS at FROM state
),
done AS (
    UPDATE profile_refresh_requests r
    SET status = 'succeeded',
        finished_at = held.at,
        lease_token = NULL,
        lease_expires_at = NULL,
        last_error = NULL,
        last_error_sqlstate = NULL,
        materialization_due = %(materialization_due)s
    FROM held
    WHERE r.id = %(request_id)s
      AND r.library_id = held.library_id
      AND r.status = 'running'
      AND r.lease_token = %(lease_token)s
      AND r.lease_expires_at > held.at
    RETURNING r.library_id, r.kind, r.inventory_revision
),
acknowledged AS (
    UPDATE library_inventory_state s
    SET acknowledged_revision = GREATEST(s.acknowledged_revision, done.inventory_revision),
        acknowledged_at = now(),
        dirty_since = CASE
            WHEN GREATEST(s.acknowledged_revision, done.inventory_revision) >= s.revision
            THEN NULL ELSE s.dirty_since END
    FROM done
    WHERE done.kind = 'inventory_change' AND s.library_id = done.library_id
    RETURNING s.acknowledged_revision, s.revision
),
published AS (
    INSERT INTO library_profiles AS p (library_id, inventory_revision, item_count, profile, generated_at)
    SELECT done.library_id, %(snapshot_revision)s, %(item_count)s, %(profile)s, now()
    FROM done
    WHERE %(item_count)s > 0
    ON CONFLICT (library_id) DO UPDATE
    SET inventory_revision = EXCLUDED.inventory_revision,
        item_count = EXCLUDED.item_count,
        profile = EXCLUDED.profile,
        generated_at = EXCLUDED.generated_at
    WHERE p.inventory_revision <= EXCLUDED.inventory_revision
    RETURNING p.library_id
),
removed AS (
    DELETE FROM library_profiles p
    USING done
    WHERE %(item_count)s = 0
      AND p.library_id = done.library_id
      AND p.inventory_revision <= %(snapshot_revision)s
    RETURNING p.library_id
)
SELECT done.library_id,
       (SELECT acknowledged_revision FROM acknowledged) AS acknowledged_revision,
       (SELECT revision FROM acknowledged) AS revision,
       EXISTS (SELECT 1 FROM published) AS published,
       EXISTS (SELECT 1 FROM removed) AS removed
FROM done;

-- name: fail_claim
-- A failed attempt: retry with doubling backoff, or fail for good on the last attempt
-- (or at once when retrying cannot help). Only the current lease holder can record it.
-- An analyst's backfill spends none of the automatic path's attempts
-- (docs/profiles.md#backfill): its failure is recorded, and the request goes back with
-- the attempts and the backoff it had.
UPDATE profile_refresh_requests r
SET status = CASE WHEN %(terminal)s OR (%(spends_attempt)s AND r.attempts >= r.max_attempts)
                  THEN 'failed' ELSE 'pending' END,
    finished_at = CASE WHEN %(terminal)s OR (%(spends_attempt)s AND r.attempts >= r.max_attempts)
                       THEN now() END,
    attempts = CASE WHEN %(terminal)s OR %(spends_attempt)s THEN r.attempts
                    ELSE r.attempts - 1 END,
    available_at = CASE WHEN %(terminal)s OR %(spends_attempt)s
                        THEN now() + make_interval(secs => %(retry_seconds)s * 2 ^ (r.attempts - 1))
                        ELSE r.available_at END,
    lease_token = NULL,
    lease_expires_at = NULL,
    last_error = %(error)s,
    last_error_sqlstate = %(sqlstate)s
WHERE r.id = %(request_id)s AND r.status = 'running' AND r.lease_token = %(lease_token)s
RETURNING r.status, r.attempts;

-- name: materializations_due
-- docs/profiles.md#dagster. Completions of Dagster refresh runs not yet recorded as
-- materializations, finished more than %(grace_seconds)s ago (a live run records its
-- own sooner), oldest first.
SELECT id, library_id
FROM profile_refresh_requests
WHERE materialization_due
  AND finished_at < now() - make_interval(secs => %(grace_seconds)s)
ORDER BY finished_at, id
LIMIT %(limit)s;

-- name: materialized
-- The completions a run has recorded as materializations.
UPDATE profile_refresh_requests
SET materialization_due = false
WHERE id = ANY (%(request_ids)s) AND materialization_due;

-- name: request_outcomes
-- Where the requests of a backfill stand.
SELECT id, library_id, status, lease_expires_at, last_error
FROM profile_refresh_requests
WHERE id = ANY (%(request_ids)s)
ORDER BY id;

-- name: compact_requests
-- Terminal inventory_change requests older than the retention, in bounded batches,
-- keeping the latest terminal record per library (its cooldown and last outcome) and
-- never touching active work. Learning and native records belong to their own flows
-- and are never deleted here.
WITH doomed AS (
    SELECT r.id
    FROM profile_refresh_requests r
    WHERE r.kind = 'inventory_change'
      AND r.status IN ('succeeded', 'failed')
      AND r.finished_at < now() - make_interval(days => %(retention_days)s)
      AND EXISTS (
          SELECT 1 FROM profile_refresh_requests newer
          WHERE newer.library_id = r.library_id
            AND newer.id > r.id
            AND newer.status IN ('succeeded', 'failed')
      )
    ORDER BY r.finished_at, r.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM profile_refresh_requests r
USING doomed
WHERE r.id = doomed.id;

-- name: library_ids_after
-- Libraries created after a known largest id (ids only grow), in id order.
SELECT id FROM libraries WHERE id > %(after_id)s ORDER BY id;

-- name: library_ranges
-- The id ranges of the given width that hold at least one library, by their lowest id
-- (one index-only scan; one row per range, not per library).
SELECT DISTINCT id / %(width)s * %(width)s AS low
FROM libraries
ORDER BY low;

-- name: library_ids_in_ranges
-- The libraries inside the given id ranges (lowest id, common width), in id order. The
-- last range of bigint ends at its largest value: its end is never computed past it.
SELECT l.id
FROM unnest(%(lows)s::bigint[]) AS r (low)
JOIN libraries l
  ON l.id >= r.low AND l.id <= r.low + least(%(width)s - 1, 9223372036854775807 - r.low)
ORDER BY l.id;

-- name: library_fingerprint
-- A cheap summary of the set of library ids (one index-only scan, no rows shipped):
-- any insertion or deletion changes the count or the sum of 64-bit id hashes, so the
-- partition sync only reads both full key sets when this changed.
SELECT count(*) AS libraries,
       COALESCE(max(id), 0) AS max_id,
       COALESCE(sum(hashint8extended(id, 0)), 0)::text AS digest
FROM libraries;

-- name: profile_status
-- Is each library's profile current with its revision, how long has it been dirty, and
-- what a reader needs to recognise it: name, media server, when its profile was
-- published and which traits it publishes. The change rows not yet folded count (a
-- fold skips a library whose state another transaction holds).
SELECT s.library_id, s.revision + c.changes AS revision, s.acknowledged_revision,
       p.inventory_revision AS profile_revision, p.item_count, p.generated_at,
       extract(epoch FROM now() - COALESCE(s.dirty_since, c.first_at))::float8 AS dirty_seconds,
       (SELECT count(*) FROM media_server_items i WHERE i.library_id = s.library_id) AS items,
       l.name, l.media_kind, m.name AS server_name, m.kind AS server_kind,
       NOT (l.active AND m.active) AS paused,
       ARRAY(SELECT t.key FROM jsonb_each(p.profile) t
             WHERE t.value ->> 'status' = 'published' ORDER BY t.key) AS published_traits
FROM library_inventory_state s
JOIN libraries l ON l.id = s.library_id
JOIN media_servers m ON m.id = l.server_id
LEFT JOIN library_profiles p ON p.library_id = s.library_id
CROSS JOIN LATERAL (
    SELECT count(*) AS changes, min(x.changed_at) AS first_at
    FROM library_inventory_changes x
    WHERE x.library_id = s.library_id
) AS c
WHERE s.library_id = ANY (%(library_ids)s)
ORDER BY s.library_id;

-- name: library_labels
-- Name and media server of each library, for what a reader of a profile sees.
SELECT l.id AS library_id, l.name, l.media_kind, m.name AS server_name, m.kind AS server_kind
FROM libraries l
JOIN media_servers m ON m.id = l.server_id
WHERE l.id = ANY (%(library_ids)s)
ORDER BY l.id;

-- name: stored_profile
-- The profile a library has now, as a reader of its latest materialization sees it.
SELECT library_id, inventory_revision, item_count, profile
FROM library_profiles
WHERE library_id = %(library_id)s;

-- name: stalled_libraries
-- Active libraries of active servers dirty for longer than the threshold, oldest first
-- (the dirty index), after a position: a caller pages through however many there are.
-- An inactive library or server waits by design: it is paused, not stalled.
SELECT s.library_id, s.revision, s.acknowledged_revision, s.dirty_since,
       floor(extract(epoch FROM now() - s.dirty_since))::bigint AS stalled_seconds
FROM library_inventory_state s
JOIN libraries l ON l.id = s.library_id
JOIN media_servers m ON m.id = l.server_id
WHERE s.revision > s.acknowledged_revision
  AND s.dirty_since < now() - make_interval(secs => %(stall_seconds)s)
  AND (s.dirty_since, s.library_id) > (%(after_since)s::timestamptz, %(after_id)s::bigint)
  AND l.active AND m.active
ORDER BY s.dirty_since, s.library_id
LIMIT %(limit)s;

-- name: acknowledged_revisions
-- How far each library is acknowledged, and whether it waits paused (its library or
-- server inactive); a deleted library is absent.
SELECT s.library_id, s.acknowledged_revision, NOT (l.active AND m.active) AS paused
FROM library_inventory_state s
JOIN libraries l ON l.id = s.library_id
JOIN media_servers m ON m.id = l.server_id
WHERE s.library_id = ANY (%(library_ids)s);

-- name: queue_overview
-- Figures for `inventory-pipeline status` and sensor metadata.
SELECT
    (SELECT count(*) FROM library_inventory_state WHERE revision > acknowledged_revision) AS dirty,
    (SELECT count(*) FROM profile_refresh_requests WHERE status = 'pending') AS pending,
    (SELECT count(*) FROM profile_refresh_requests
      WHERE status = 'pending' AND available_at <= now()) AS claimable,
    (SELECT count(*) FROM profile_refresh_requests WHERE status = 'running') AS running,
    (SELECT count(*) FROM profile_refresh_requests WHERE status = 'failed') AS failed,
    (SELECT min(dirty_since) FROM library_inventory_state
      WHERE revision > acknowledged_revision) AS oldest_dirty_since;

-- name: mark_libraries_dirty
-- After writes that skipped capture (a restore or replication apply with
-- session_replication_role = replica), advance the next batch of libraries after a
-- library id, in library-id order like capture. A library without a state row (created
-- while triggers were off) gets one; a revision never falls below a stored profile's,
-- whose publication guard would otherwise keep that profile forever. The libraries are
-- locked (key share) before their state rows, the order a library deletion takes.
INSERT INTO library_inventory_state AS s (library_id, revision, dirty_since, changed_at)
SELECT l.id,
       COALESCE((SELECT p.inventory_revision FROM library_profiles p WHERE p.library_id = l.id), 0) + 1,
       now(),
       now()
FROM libraries l
WHERE l.id > %(after_library_id)s
ORDER BY l.id
LIMIT %(limit)s
FOR KEY SHARE OF l
ON CONFLICT (library_id) DO UPDATE
SET revision = GREATEST(s.revision + 1, EXCLUDED.revision),
    changed_at = now(),
    dirty_since = COALESCE(s.dirty_since, now())
RETURNING s.library_id;
