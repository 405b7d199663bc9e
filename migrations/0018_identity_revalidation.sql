-- External-id revalidation of unresolved 404 cases and the operator's gate before any
-- replacement identity is used (docs/identity-revalidation.md). Nothing here writes the
-- items' typed identity: other programs own it.

-- The external ids of a successful observation, in bounded typed fields and nothing else
-- of the response: an IMDb id is "tt" and 7 to 10 digits, a TVDB id a positive int32.
ALTER TABLE provider_observations
    ADD COLUMN imdb_id text
        CONSTRAINT provider_observations_imdb_id CHECK (imdb_id ~ '^tt[0-9]{7,10}$'),
    ADD COLUMN tvdb_id integer
        CONSTRAINT provider_observations_tvdb_id CHECK (tvdb_id > 0);

-- One revalidation record per recovery case: when it is due, its lease, the last
-- conclusive check (which checks passed, the first reason it failed, when) and the
-- faults since. Rows are queued by the observation failure that makes a case eligible;
-- rows whose case ended are forgotten as they are met.
CREATE TABLE identity_revalidations (
    case_id uuid PRIMARY KEY,
    item_id bigint NOT NULL,
    source_generation bigint NOT NULL,
    due_at timestamptz DEFAULT now(),  -- NULL: set aside until queued again
    lease_token uuid,
    lease_expires_at timestamptz,
    outcome text CHECK (outcome IN ('proposed', 'no_proposal')),
    reason text CHECK (reason IN ('no_candidate', 'ambiguous', 'round_trip', 'title', 'year')),
    external_source text CHECK (external_source IN ('imdb_id', 'tvdb_id')),
    external_id text CHECK (external_id ~ '^(tt[0-9]{7,10}|[1-9][0-9]{0,9})$'),
    old_tmdb_id integer CHECK (old_tmdb_id > 0),
    candidates integer CHECK (candidates >= 0),
    candidate_tmdb_id integer CHECK (candidate_tmdb_id > 0),
    single_candidate boolean,
    round_trip boolean,
    title_match boolean,
    year_match boolean,
    checked_at timestamptz,
    faults integer NOT NULL DEFAULT 0 CHECK (faults >= 0),
    last_fault text CHECK (last_fault IN (
        'not_found', 'auth', 'throttled', 'transient', 'invalid_response', 'configuration')),
    faulted_at timestamptz,
    CONSTRAINT identity_revalidations_lease CHECK (
        (lease_token IS NULL) = (lease_expires_at IS NULL)
    ),
    CONSTRAINT identity_revalidations_checked CHECK (
        (outcome IS NULL) = (checked_at IS NULL)
        AND (outcome IS NOT DISTINCT FROM 'no_proposal') = (reason IS NOT NULL)
        AND (outcome IS DISTINCT FROM 'proposed'
             OR (single_candidate AND round_trip AND title_match AND year_match))
    ),
    CONSTRAINT identity_revalidations_faults CHECK (
        (faults = 0) = (last_fault IS NULL) AND (last_fault IS NULL) = (faulted_at IS NULL)
    )
);
-- The claim walks due rows in this order; rows set aside (no due time) are not in it.
CREATE INDEX identity_revalidations_due
    ON identity_revalidations (due_at, case_id) WHERE due_at IS NOT NULL;
CREATE INDEX identity_revalidations_item ON identity_revalidations (item_id);

-- One proposal per case: the old identity, the candidate and the evidence the checks
-- passed on, its state and who decided when. A proposal is bound to the item's source
-- generation: a change of the source supersedes it.
CREATE TABLE replacement_proposals (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    item_id bigint NOT NULL,
    case_id uuid NOT NULL UNIQUE,
    source_generation bigint NOT NULL,
    provider_kind text NOT NULL CHECK (provider_kind IN ('movie', 'tv')),
    old_tmdb_id integer NOT NULL CHECK (old_tmdb_id > 0),
    candidate_tmdb_id integer NOT NULL CHECK (candidate_tmdb_id > 0),
    external_source text NOT NULL CHECK (external_source IN ('imdb_id', 'tvdb_id')),
    external_id text NOT NULL CHECK (external_id ~ '^(tt[0-9]{7,10}|[1-9][0-9]{0,9})$'),
    source_title text NOT NULL CHECK (length(source_title) <= 500),
    source_year integer NOT NULL,
    candidate_title text NOT NULL CHECK (length(candidate_title) <= 500),
    candidate_original_title text CHECK (length(candidate_original_title) <= 500),
    candidate_year integer NOT NULL,
    checked_at timestamptz NOT NULL,
    state text NOT NULL DEFAULT 'proposed'
        CHECK (state IN ('proposed', 'approved', 'rejected', 'superseded')),
    proposed_at timestamptz NOT NULL DEFAULT now(),
    decided_by text CHECK (length(decided_by) BETWEEN 1 AND 64),
    decided_at timestamptz,
    -- The first observation under the candidate, and when one succeeded.
    attempted_at timestamptz,
    replaced_at timestamptz,
    superseded_at timestamptz,
    CONSTRAINT replacement_proposals_other_id CHECK (candidate_tmdb_id <> old_tmdb_id),
    CONSTRAINT replacement_proposals_decision CHECK (
        (decided_by IS NULL) = (decided_at IS NULL)
        AND (state NOT IN ('approved', 'rejected') OR decided_at IS NOT NULL)
        AND (state <> 'proposed' OR decided_at IS NULL)
    ),
    CONSTRAINT replacement_proposals_superseded CHECK (
        (state = 'superseded') = (superseded_at IS NOT NULL)
    ),
    CONSTRAINT replacement_proposals_applied CHECK (
        (attempted_at IS NULL OR decided_at IS NOT NULL)
        AND (replaced_at IS NULL OR attempted_at IS NOT NULL)
    )
);
CREATE INDEX replacement_proposals_item ON replacement_proposals (item_id, id);
-- Approved proposals by item (the override an observation claim uses), awaiting their
-- first observation (the prompt attempt after approval), and the live ones.
CREATE INDEX replacement_proposals_approved
    ON replacement_proposals (item_id, id) WHERE state = 'approved';
CREATE INDEX replacement_proposals_awaiting
    ON replacement_proposals (decided_at, id) WHERE state = 'approved' AND attempted_at IS NULL;
CREATE INDEX replacement_proposals_live
    ON replacement_proposals (id) WHERE state IN ('proposed', 'approved');

-- The hourly revalidation budget shared by every process: the claims of the last hour,
-- oldest first. A claim takes only what the last hour leaves under the setting.
CREATE TABLE revalidation_budget (
    bucket text PRIMARY KEY,
    recent_claims timestamptz[] NOT NULL DEFAULT '{}'
);
INSERT INTO revalidation_budget (bucket) VALUES ('tmdb');

-- A revalidation record whose case has ended: the item is gone, its source changed, or
-- the case was resolved or replaced by another.
CREATE FUNCTION revalidation_moot(r identity_revalidations, i media_server_items)
RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT i.id IS NULL
        OR i.source_generation <> r.source_generation
        OR i.recovery_case_id IS DISTINCT FROM r.case_id
        OR i.recovery_resolved_at IS NOT NULL
$$;

-- What a walked revalidation record is now: 'moot' (forget it), 'due' (claim it) or
-- 'waiting' (set aside until the case's next not_found failure queues it again). Due
-- needs an open not_found case of two or more failures, on the item's valid typed
-- identity, in an active library of its kind on an active server, with the external
-- ids of a successful observation of the same source (a movie's IMDb id; a show's TVDB
-- or IMDb id), and no proposal for the case yet. The sensor's count and the claim both
-- ask it.
CREATE FUNCTION revalidation_verdict(
    r identity_revalidations,
    i media_server_items,
    l libraries,
    m media_servers,
    o provider_observations
) RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT CASE
        WHEN revalidation_moot(r, i) THEN 'moot'
        WHEN i.recovery_category = 'not_found' AND i.recovery_attempts >= 2
             AND i.provider = 'tmdb' AND i.provider_kind IN ('movie', 'tv')
             AND tmdb_id_of(i.provider_id) IS NOT NULL
             AND (i.recovery_provider, i.recovery_provider_kind, i.recovery_provider_id)
                 = (i.provider, i.provider_kind, i.provider_id)
             AND l.active AND m.active AND l.media_kind = i.provider_kind
             AND o.source_generation = i.source_generation
             AND o.provider_kind = i.provider_kind
             AND (o.imdb_id IS NOT NULL OR (i.provider_kind = 'tv' AND o.tvdb_id IS NOT NULL))
             AND NOT EXISTS (SELECT FROM replacement_proposals p WHERE p.case_id = r.case_id)
        THEN 'due'
        ELSE 'waiting'
    END
$$;

-- A proposal's state as it stands: a proposed or approved proposal whose item is gone or
-- whose source changed is superseded, and so is a proposed one whose case ended before
-- a decision. The stored state catches up when the revalidation run sweeps.
CREATE FUNCTION replacement_proposal_state(p replacement_proposals, i media_server_items)
RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT CASE
        WHEN p.state IN ('proposed', 'approved')
             AND (i.id IS NULL OR i.source_generation <> p.source_generation)
        THEN 'superseded'
        WHEN p.state = 'proposed'
             AND (i.recovery_case_id IS DISTINCT FROM p.case_id
                  OR i.recovery_resolved_at IS NOT NULL)
        THEN 'superseded'
        ELSE p.state
    END
$$;

-- The replacement an observation of the item's current source uses: its latest approved
-- proposal of that source generation (none: the item's own typed identity).
CREATE FUNCTION approved_replacement(p_item_id bigint, p_source_generation bigint)
RETURNS TABLE (proposal_id bigint, tmdb_id integer)
LANGUAGE sql STABLE
AS $$
    SELECT p.id, p.candidate_tmdb_id
    FROM replacement_proposals p
    WHERE p.item_id = p_item_id
      AND p.source_generation = p_source_generation
      AND p.state = 'approved'
    ORDER BY p.id DESC
    LIMIT 1
$$;

-- An approved replacement awaits its first observation: the item still has the source
-- it was approved for, holds no live lease, and sits in an active movie/TV library of an
-- active server (the library terms of `observation_due`). The observation sensor's count
-- and the replacement claim both ask it.
CREATE FUNCTION replacement_due(
    p replacement_proposals,
    i media_server_items,
    l libraries,
    m media_servers
) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT p.state = 'approved'
       AND p.attempted_at IS NULL
       AND p.source_generation = i.source_generation
       AND i.provider = 'tmdb'
       AND i.provider_kind = p.provider_kind
       AND (i.observation_lease_token IS NULL OR i.observation_lease_expires_at <= now())
       AND l.active AND m.active AND l.media_kind IN ('movie', 'tv')
$$;

-- The approved replacements observed under their new id, for the syncing program that
-- owns the typed identity to adopt: one row per item, its current source and the TMDb id
-- to adopt. A row leaves when the source changes (adopting it is such a change). A
-- program reading it needs SELECT on this view only.
CREATE VIEW identity_replacements AS
SELECT i.id AS item_id,
       i.library_id,
       i.provider,
       i.provider_kind,
       i.provider_id,
       p.candidate_tmdb_id::text AS replacement_provider_id,
       p.id AS proposal_id,
       p.decided_by AS approved_by,
       p.decided_at AS approved_at,
       p.replaced_at AS observed_at
FROM replacement_proposals p
JOIN media_server_items i ON i.id = p.item_id AND i.source_generation = p.source_generation
WHERE p.state = 'approved'
  AND p.replaced_at IS NOT NULL
  AND NOT EXISTS (
      SELECT FROM replacement_proposals q
      WHERE q.item_id = p.item_id
        AND q.source_generation = p.source_generation
        AND q.state = 'approved'
        AND q.id > p.id
  );

REVOKE ALL ON FUNCTION
    revalidation_moot(identity_revalidations, media_server_items),
    revalidation_verdict(
        identity_revalidations, media_server_items, libraries, media_servers,
        provider_observations),
    replacement_proposal_state(replacement_proposals, media_server_items),
    approved_replacement(bigint, bigint),
    replacement_due(replacement_proposals, media_server_items, libraries, media_servers)
FROM PUBLIC;
