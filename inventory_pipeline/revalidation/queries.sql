-- Every statement of revalidation and replacement proposals
-- (docs/identity-revalidation.md).

-- name: due_revalidations
-- Revalidations due now, by the one definition the claim uses too
-- (`revalidation_verdict`, migration 0018).
SELECT count(*) AS due
FROM identity_revalidations r
LEFT JOIN media_server_items i ON i.id = r.item_id
LEFT JOIN libraries l ON l.id = i.library_id
LEFT JOIN media_servers m ON m.id = l.server_id
LEFT JOIN provider_observations o ON o.item_id = r.item_id
WHERE r.due_at <= now()
  AND (r.lease_token IS NULL OR r.lease_expires_at <= now())
  AND revalidation_verdict(r, i, l, m, o) = 'due';

-- name: budget_left
-- docs/identity-revalidation.md#budget.
-- How many revalidations the last hour leaves under `per_hour` (read only).
SELECT GREATEST(0, %(per_hour)s - (
           SELECT count(*) FROM unnest(b.recent_claims) AS t (claimed_at)
           WHERE t.claimed_at > now() - interval '1 hour'))::integer AS allowed
FROM revalidation_budget b
WHERE b.bucket = 'tmdb';

-- name: take_budget
-- The same, under the budget row's lock (held to the claim's commit): claimers take
-- turns, so no rolling hour ever holds more claims than the setting allows.
SELECT GREATEST(0, %(per_hour)s - (
           SELECT count(*) FROM unnest(b.recent_claims) AS t (claimed_at)
           WHERE t.claimed_at > now() - interval '1 hour'))::integer AS allowed
FROM revalidation_budget b
WHERE b.bucket = 'tmdb'
FOR UPDATE;

-- name: spend_budget
-- Record `spent` claims at the claim's time; claims older than an hour are dropped.
UPDATE revalidation_budget b
SET recent_claims = ARRAY(
        SELECT t.claimed_at FROM unnest(b.recent_claims) AS t (claimed_at)
        WHERE t.claimed_at > now() - interval '1 hour'
        ORDER BY t.claimed_at)
    || array_fill(now(), ARRAY[%(spent)s::integer])
WHERE b.bucket = 'tmdb';

-- name: claim_revalidations
-- docs/identity-revalidation.md#claim-and-lease.
-- Walk at most `limit` due records in the due index's order, SKIP LOCKED, and settle
-- each one walked: a moot record (its case ended) is forgotten, a waiting one set aside
-- until the case's next not_found failure queues it again, a due one claimed under a
-- fresh UUID and lease. Every row walked is consumed, so the walk costs the same per
-- row however many records wait. Items are read, not locked: the completion is fenced
-- by lease token, case and source generation. Returns every walked row with its
-- verdict and, for claims, the evidence of the last successful observation.
WITH walked AS (
    SELECT r.case_id
    FROM identity_revalidations r
    WHERE r.due_at <= now()
      AND (r.lease_token IS NULL OR r.lease_expires_at <= now())
    ORDER BY r.due_at, r.case_id
    LIMIT %(limit)s
    FOR UPDATE OF r SKIP LOCKED
),
judged AS (
    SELECT r.case_id, revalidation_verdict(r, i, l, m, o) AS verdict
    FROM walked w
    JOIN identity_revalidations r ON r.case_id = w.case_id
    LEFT JOIN media_server_items i ON i.id = r.item_id
    LEFT JOIN libraries l ON l.id = i.library_id
    LEFT JOIN media_servers m ON m.id = l.server_id
    LEFT JOIN provider_observations o ON o.item_id = r.item_id
),
forgotten AS (
    DELETE FROM identity_revalidations r
    USING judged j
    WHERE r.case_id = j.case_id AND j.verdict = 'moot'
),
set_aside AS (
    UPDATE identity_revalidations r
    SET due_at = NULL
    FROM judged j
    WHERE r.case_id = j.case_id AND j.verdict = 'waiting'
),
claimed AS (
    UPDATE identity_revalidations r
    SET lease_token = gen_random_uuid(),
        lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
    FROM judged j
    WHERE r.case_id = j.case_id AND j.verdict = 'due'
    RETURNING r.case_id, r.item_id, r.source_generation, r.lease_token, r.faults
)
SELECT j.case_id, j.verdict, c.item_id, c.source_generation, c.lease_token, c.faults,
       i.provider_kind, i.title, i.year, o.tmdb_id AS old_tmdb_id, o.imdb_id, o.tvdb_id
FROM judged j
LEFT JOIN claimed c ON c.case_id = j.case_id
LEFT JOIN media_server_items i ON i.id = c.item_id
LEFT JOIN provider_observations o ON o.item_id = c.item_id
ORDER BY j.case_id;

-- name: complete_revalidation
-- docs/identity-revalidation.md#completion-fence.
-- One guarded statement records a conclusive check (which rules held, the first that
-- failed, when), sets the record aside, releases its lease and, when every rule held,
-- writes the case's one proposal. Only the current lease token, case and source
-- generation match. The item row is locked (share) first: a concurrent source change
-- waits for this commit, or this statement for it and then matches nothing. The item
-- is only locked, never written, so its library is not. A live claim whose case ended
-- meanwhile (source changed, item gone, case resolved) forgets the record instead.
WITH item AS (
    SELECT i.id, i.title, i.year
    FROM media_server_items i
    WHERE i.id = %(item_id)s
      AND i.source_generation = %(source_generation)s
      AND i.recovery_case_id = %(case_id)s
      AND i.recovery_resolved_at IS NULL
    FOR SHARE
),
recorded AS (
    UPDATE identity_revalidations r
    SET lease_token = NULL,
        lease_expires_at = NULL,
        due_at = NULL,
        outcome = %(outcome)s,
        reason = %(reason)s,
        external_source = %(external_source)s,
        external_id = %(external_id)s,
        old_tmdb_id = %(old_tmdb_id)s,
        candidates = %(candidates)s,
        candidate_tmdb_id = %(candidate_tmdb_id)s,
        single_candidate = %(single_candidate)s,
        round_trip = %(round_trip)s,
        title_match = %(title_match)s,
        year_match = %(year_match)s,
        checked_at = now(),
        faults = 0,
        last_fault = NULL,
        faulted_at = NULL
    FROM item
    WHERE r.case_id = %(case_id)s
      AND r.item_id = item.id
      AND r.lease_token = %(lease_token)s
      AND r.source_generation = %(source_generation)s
    RETURNING r.case_id
),
forgotten AS (
    DELETE FROM identity_revalidations r
    WHERE r.case_id = %(case_id)s
      AND r.lease_token = %(lease_token)s
      AND NOT EXISTS (SELECT FROM item)
),
proposal AS (
    INSERT INTO replacement_proposals (
        item_id, case_id, source_generation, provider_kind, old_tmdb_id, candidate_tmdb_id,
        external_source, external_id, source_title, source_year, candidate_title,
        candidate_original_title, candidate_year, checked_at)
    SELECT item.id, %(case_id)s, %(source_generation)s, %(provider_kind)s, %(old_tmdb_id)s,
           %(candidate_tmdb_id)s, %(external_source)s, %(external_id)s, left(item.title, 500),
           item.year, left(%(candidate_title)s, 500), left(%(candidate_original_title)s, 500),
           %(candidate_year)s, now()
    FROM item, recorded
    WHERE %(outcome)s = 'proposed'
    ON CONFLICT (case_id) DO NOTHING
    RETURNING id
)
SELECT (SELECT count(*) FROM recorded) > 0 AS recorded,
       (SELECT id FROM proposal) AS proposal_id;

-- name: fault_revalidation
-- A check that could not conclude (a fault of the provider or of its answer) waits for
-- its retry deadline; the last conclusive check stays as it was. Only the current lease
-- token matches.
UPDATE identity_revalidations r
SET lease_token = NULL,
    lease_expires_at = NULL,
    due_at = now() + make_interval(secs => %(delay_seconds)s),
    faults = r.faults + 1,
    last_fault = %(category)s,
    faulted_at = now()
WHERE r.case_id = %(case_id)s
  AND r.lease_token = %(lease_token)s
  AND r.source_generation = %(source_generation)s
RETURNING r.due_at;

-- name: release_revalidation
-- A claim whose requests were never sent (admission paused) goes back as it came: lease
-- cleared, no fault counted, due time unchanged.
UPDATE identity_revalidations
SET lease_token = NULL, lease_expires_at = NULL
WHERE case_id = %(case_id)s AND lease_token = %(lease_token)s
RETURNING case_id;

-- name: give_back_interrupted_revalidation
-- A check a transient database error interrupted goes back with no fault counted, due
-- again no sooner than %(delay_seconds)s from now: the run that sent its requests does
-- not send them again at once.
UPDATE identity_revalidations
SET lease_token = NULL, lease_expires_at = NULL,
    due_at = greatest(due_at, now() + make_interval(secs => %(delay_seconds)s))
WHERE case_id = %(case_id)s AND lease_token = %(lease_token)s
RETURNING case_id;

-- name: supersede_proposals
-- docs/identity-revalidation.md#the-gate.
-- Proposals superseded by a change of the item's source (or, undecided, by the end of
-- their case) take the state as stored. Every reader and guard already asks
-- `replacement_proposal_state`; this keeps the stored state in step.
WITH stale AS (
    SELECT p.id
    FROM replacement_proposals p
    LEFT JOIN media_server_items i ON i.id = p.item_id
    WHERE p.state IN ('proposed', 'approved')
      AND replacement_proposal_state(p, i) = 'superseded'
    ORDER BY p.id
    LIMIT %(limit)s
    FOR UPDATE OF p SKIP LOCKED
)
UPDATE replacement_proposals p
SET state = 'superseded', superseded_at = now()
FROM stale
WHERE p.id = stale.id
RETURNING p.id;

-- name: forget_revalidations
-- Records whose case ended are forgotten, those set aside (no due time) included,
-- which no claim walks.
WITH moot AS (
    SELECT r.case_id
    FROM identity_revalidations r
    LEFT JOIN media_server_items i ON i.id = r.item_id
    WHERE revalidation_moot(r, i)
    ORDER BY r.case_id
    LIMIT %(limit)s
    FOR UPDATE OF r SKIP LOCKED
)
DELETE FROM identity_revalidations r
USING moot
WHERE r.case_id = moot.case_id
RETURNING r.case_id;

-- name: prune_proposals
-- Superseded proposals, and rejected ones whose item moved on, are kept for
-- `retention_days` after that, then deleted.
DELETE FROM replacement_proposals p
WHERE p.id IN (
    SELECT q.id
    FROM replacement_proposals q
    LEFT JOIN media_server_items i ON i.id = q.item_id
    WHERE (q.state = 'superseded'
           AND q.superseded_at < now() - make_interval(days => %(retention_days)s))
       OR (q.state = 'rejected'
           AND q.decided_at < now() - make_interval(days => %(retention_days)s)
           AND (i.id IS NULL OR i.source_generation <> q.source_generation))
    ORDER BY q.id
    LIMIT %(limit)s)
RETURNING p.id;

-- name: proposals
-- Proposals in `states` (their state as it stands; `stored` are the stored states that
-- can stand as one of them), newest first.
SELECT p.id, p.item_id, i.library_id, l.name AS library, p.provider_kind, p.old_tmdb_id,
       p.candidate_tmdb_id, p.external_source, p.external_id, p.source_title, p.source_year,
       p.candidate_title, p.candidate_original_title, p.candidate_year,
       replacement_proposal_state(p, i) AS state, p.proposed_at, p.checked_at, p.decided_by,
       p.decided_at, p.replaced_at,
       floor(extract(epoch FROM now() - p.proposed_at))::bigint AS age_seconds
FROM replacement_proposals p
LEFT JOIN media_server_items i ON i.id = p.item_id
LEFT JOIN libraries l ON l.id = i.library_id
WHERE p.state = ANY (%(stored)s::text[])
  AND replacement_proposal_state(p, i) = ANY (%(states)s::text[])
ORDER BY p.id DESC
LIMIT %(limit)s;

-- name: proposal_states
-- How many proposals stand in each state.
SELECT replacement_proposal_state(p, i) AS state, count(*) AS n
FROM replacement_proposals p
LEFT JOIN media_server_items i ON i.id = p.item_id
GROUP BY 1
ORDER BY 1;

-- name: unproposed
-- The latest conclusive checks that proposed nothing, of cases still open, with why.
SELECT r.item_id, i.library_id, l.name AS library, i.provider_kind, r.old_tmdb_id,
       r.external_source, r.external_id, r.reason, r.candidates, r.single_candidate,
       r.round_trip, r.title_match, r.year_match, r.checked_at
FROM identity_revalidations r
JOIN media_server_items i ON i.id = r.item_id
JOIN libraries l ON l.id = i.library_id
WHERE r.outcome = 'no_proposal' AND NOT revalidation_moot(r, i)
ORDER BY r.checked_at DESC, r.case_id
LIMIT %(limit)s;

-- name: unproposed_reasons
SELECT r.reason, count(*) AS n
FROM identity_revalidations r
LEFT JOIN media_server_items i ON i.id = r.item_id
WHERE r.outcome = 'no_proposal' AND NOT revalidation_moot(r, i)
GROUP BY r.reason
ORDER BY r.reason;

-- name: faulted
-- Open cases whose latest check could not conclude, by the fault.
SELECT r.last_fault AS category, count(*) AS n
FROM identity_revalidations r
LEFT JOIN media_server_items i ON i.id = r.item_id
WHERE r.faults > 0 AND NOT revalidation_moot(r, i)
GROUP BY r.last_fault
ORDER BY r.last_fault;

-- name: lock_proposal_items
-- docs/identity-revalidation.md#decisions.
-- A decision first locks the chosen proposals' items (share), all or none: NOWAIT, so a
-- decision never waits on one item while holding another, and so never joins a
-- deadlock with a program writing several items in an order of its own (the caller
-- retries the whole statement until the writer commits). Once taken, no source change
-- can commit before the decision does, and the next statement reads the items as they
-- are.
SELECT i.id
FROM media_server_items i
WHERE i.id IN (SELECT p.item_id FROM replacement_proposals p WHERE p.id = ANY (%(ids)s))
ORDER BY i.id
FOR SHARE OF i NOWAIT;

-- name: chosen_proposals
-- The chosen proposals, locked, with their state as it stands.
SELECT p.id, replacement_proposal_state(p, i) AS state
FROM replacement_proposals p
LEFT JOIN media_server_items i ON i.id = p.item_id
WHERE p.id = ANY (%(ids)s)
ORDER BY p.id
FOR UPDATE OF p;

-- name: decide_proposals
-- Approve or reject proposals that still stand as proposed (the statements before made
-- sure all of them do); who decided and when.
UPDATE replacement_proposals p
SET state = CASE WHEN p.id = ANY (%(approve)s::bigint[]) THEN 'approved' ELSE 'rejected' END,
    decided_by = %(decided_by)s,
    decided_at = now()
FROM media_server_items i
WHERE p.id = ANY (%(approve)s::bigint[] || %(reject)s::bigint[])
  AND i.id = p.item_id
  AND replacement_proposal_state(p, i) = 'proposed'
RETURNING p.id, p.item_id, p.state, p.old_tmdb_id, p.candidate_tmdb_id;

-- name: replacements
-- The published replacements (the `identity_replacements` view), by item.
SELECT item_id, library_id, provider, provider_kind, provider_id, replacement_provider_id,
       proposal_id, approved_by, approved_at, observed_at
FROM identity_replacements
ORDER BY item_id;
