-- The identity revalidation schema as it runs now: every table, index, view, function,
-- trigger, grant and starting row this capability owns, in one file to read. The
-- database gets it from migrations/ (applied in order, never edited once applied); a
-- test builds a database from the schema files and one from the migrations and checks
-- that their catalogs agree (tests/db/test_schema_files.py). To change anything here,
-- change it in this file and write a new migration that carries only the difference.
--
-- Rules: docs/identity-revalidation.md.

-- One revalidation record per recovery case: when it is due, its lease, the last
-- conclusive check (which checks passed, the first reason it failed, when) and the
-- faults since. Rows are queued by the observation failure that makes a case eligible;
-- rows whose case ended are forgotten as they are met.
CREATE TABLE identity_revalidations (
    case_id uuid NOT NULL,
    item_id bigint NOT NULL,
    source_generation bigint NOT NULL,
    due_at timestamp with time zone DEFAULT now(),
    lease_token uuid,
    lease_expires_at timestamp with time zone,
    outcome text,
    reason text,
    external_source text,
    external_id text,
    old_tmdb_id integer,
    candidates integer,
    candidate_tmdb_id integer,
    single_candidate boolean,
    round_trip boolean,
    title_match boolean,
    year_match boolean,
    checked_at timestamp with time zone,
    faults integer DEFAULT 0 NOT NULL,
    last_fault text,
    faulted_at timestamp with time zone,
    CONSTRAINT identity_revalidations_pkey PRIMARY KEY (case_id),
    CONSTRAINT identity_revalidations_candidate_tmdb_id_check CHECK ((candidate_tmdb_id > 0)),
    CONSTRAINT identity_revalidations_candidates_check CHECK ((candidates >= 0)),
    CONSTRAINT identity_revalidations_checked CHECK ((((outcome IS NULL) = (checked_at IS NULL)) AND ((NOT (outcome IS DISTINCT FROM 'no_proposal'::text)) = (reason IS NOT NULL)) AND ((outcome IS DISTINCT FROM 'proposed'::text) OR (single_candidate AND round_trip AND title_match AND year_match)))),
    CONSTRAINT identity_revalidations_external_id_check CHECK ((external_id ~ '^(tt[0-9]{7,10}|[1-9][0-9]{0,9})$'::text)),
    CONSTRAINT identity_revalidations_external_source_check CHECK ((external_source = ANY (ARRAY['imdb_id'::text, 'tvdb_id'::text]))),
    CONSTRAINT identity_revalidations_faults CHECK ((((faults = 0) = (last_fault IS NULL)) AND ((last_fault IS NULL) = (faulted_at IS NULL)))),
    CONSTRAINT identity_revalidations_faults_check CHECK ((faults >= 0)),
    CONSTRAINT identity_revalidations_last_fault_check CHECK ((last_fault = ANY (ARRAY['not_found'::text, 'auth'::text, 'throttled'::text, 'transient'::text, 'invalid_response'::text, 'configuration'::text]))),
    CONSTRAINT identity_revalidations_lease CHECK (((lease_token IS NULL) = (lease_expires_at IS NULL))),
    CONSTRAINT identity_revalidations_old_tmdb_id_check CHECK ((old_tmdb_id > 0)),
    CONSTRAINT identity_revalidations_outcome_check CHECK ((outcome = ANY (ARRAY['proposed'::text, 'no_proposal'::text]))),
    CONSTRAINT identity_revalidations_reason_check CHECK ((reason = ANY (ARRAY['no_candidate'::text, 'ambiguous'::text, 'round_trip'::text, 'title'::text, 'year'::text])))
);
-- The claim walks due rows in this order; rows set aside (no due time) are not in it.
CREATE INDEX identity_revalidations_due ON identity_revalidations USING btree (due_at, case_id) WHERE (due_at IS NOT NULL);
CREATE INDEX identity_revalidations_item ON identity_revalidations USING btree (item_id);

-- One proposal per case: the old identity, the candidate and the evidence the checks
-- passed on, its state and who decided when. A proposal is bound to the item's source
-- generation: a change of the source supersedes it.
CREATE TABLE replacement_proposals (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    item_id bigint NOT NULL,
    case_id uuid NOT NULL,
    source_generation bigint NOT NULL,
    provider_kind text NOT NULL,
    old_tmdb_id integer NOT NULL,
    candidate_tmdb_id integer NOT NULL,
    external_source text NOT NULL,
    external_id text NOT NULL,
    source_title text NOT NULL,
    source_year integer NOT NULL,
    candidate_title text NOT NULL,
    candidate_original_title text,
    candidate_year integer NOT NULL,
    checked_at timestamp with time zone NOT NULL,
    state text DEFAULT 'proposed'::text NOT NULL,
    proposed_at timestamp with time zone DEFAULT now() NOT NULL,
    decided_by text,
    decided_at timestamp with time zone,
    attempted_at timestamp with time zone,
    replaced_at timestamp with time zone,
    superseded_at timestamp with time zone,
    CONSTRAINT replacement_proposals_pkey PRIMARY KEY (id),
    CONSTRAINT replacement_proposals_case_id_key UNIQUE (case_id),
    CONSTRAINT replacement_proposals_applied CHECK ((((attempted_at IS NULL) OR (decided_at IS NOT NULL)) AND ((replaced_at IS NULL) OR (attempted_at IS NOT NULL)))),
    CONSTRAINT replacement_proposals_candidate_original_title_check CHECK ((length(candidate_original_title) <= 500)),
    CONSTRAINT replacement_proposals_candidate_title_check CHECK ((length(candidate_title) <= 500)),
    CONSTRAINT replacement_proposals_candidate_tmdb_id_check CHECK ((candidate_tmdb_id > 0)),
    CONSTRAINT replacement_proposals_decided_by_check CHECK (((length(decided_by) >= 1) AND (length(decided_by) <= 64))),
    CONSTRAINT replacement_proposals_decision CHECK ((((decided_by IS NULL) = (decided_at IS NULL)) AND ((state <> ALL (ARRAY['approved'::text, 'rejected'::text])) OR (decided_at IS NOT NULL)) AND ((state <> 'proposed'::text) OR (decided_at IS NULL)))),
    CONSTRAINT replacement_proposals_external_id_check CHECK ((external_id ~ '^(tt[0-9]{7,10}|[1-9][0-9]{0,9})$'::text)),
    CONSTRAINT replacement_proposals_external_source_check CHECK ((external_source = ANY (ARRAY['imdb_id'::text, 'tvdb_id'::text]))),
    CONSTRAINT replacement_proposals_old_tmdb_id_check CHECK ((old_tmdb_id > 0)),
    CONSTRAINT replacement_proposals_other_id CHECK ((candidate_tmdb_id <> old_tmdb_id)),
    CONSTRAINT replacement_proposals_provider_kind_check CHECK ((provider_kind = ANY (ARRAY['movie'::text, 'tv'::text]))),
    CONSTRAINT replacement_proposals_source_title_check CHECK ((length(source_title) <= 500)),
    CONSTRAINT replacement_proposals_state_check CHECK ((state = ANY (ARRAY['proposed'::text, 'approved'::text, 'rejected'::text, 'superseded'::text]))),
    CONSTRAINT replacement_proposals_superseded CHECK (((state = 'superseded'::text) = (superseded_at IS NOT NULL)))
);
-- Approved proposals by item (the override an observation claim uses), awaiting their
-- first observation (the prompt attempt after approval), and the live ones.
CREATE INDEX replacement_proposals_approved ON replacement_proposals USING btree (item_id, id) WHERE (state = 'approved'::text);
CREATE INDEX replacement_proposals_awaiting ON replacement_proposals USING btree (decided_at, id) WHERE ((state = 'approved'::text) AND (attempted_at IS NULL));
CREATE INDEX replacement_proposals_item ON replacement_proposals USING btree (item_id, id);
CREATE INDEX replacement_proposals_live ON replacement_proposals USING btree (id) WHERE (state = ANY (ARRAY['proposed'::text, 'approved'::text]));

-- The hourly revalidation budget shared by every process: the claims of the last hour,
-- oldest first. A claim takes only what the last hour leaves under the setting.
CREATE TABLE revalidation_budget (
    bucket text NOT NULL,
    recent_claims timestamp with time zone[] DEFAULT '{}'::timestamp with time zone[] NOT NULL,
    CONSTRAINT revalidation_budget_pkey PRIMARY KEY (bucket)
);

-- A revalidation record whose case has ended: the item is gone, its source changed, or
-- the case was resolved or replaced by another.
CREATE FUNCTION revalidation_moot(r identity_revalidations, i media_server_items)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
    SELECT i.id IS NULL
        OR i.source_generation <> r.source_generation
        OR i.recovery_case_id IS DISTINCT FROM r.case_id
        OR i.recovery_resolved_at IS NOT NULL
$function$;

-- What a walked revalidation record is now: 'moot' (forget it), 'due' (claim it) or
-- 'waiting' (set aside until the case's next not_found failure queues it again). Due
-- needs an open not_found case of two or more failures, on the item's valid typed
-- identity, in an active library of its kind on an active server, with the external
-- ids of a successful observation of the same source (a movie's IMDb id; a show's TVDB
-- or IMDb id), and no proposal for the case yet. The sensor's count and the claim both
-- ask it.
CREATE FUNCTION revalidation_verdict(r identity_revalidations, i media_server_items, l libraries, m media_servers, o provider_observations)
 RETURNS text
 LANGUAGE sql
 STABLE
AS $function$
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
$function$;

-- A proposal's state as it stands: a proposed or approved proposal whose item is gone or
-- whose source changed is superseded, and so is a proposed one whose case ended before
-- a decision. The stored state catches up when the revalidation run sweeps.
CREATE FUNCTION replacement_proposal_state(p replacement_proposals, i media_server_items)
 RETURNS text
 LANGUAGE sql
 STABLE
AS $function$
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
$function$;

-- The replacement an observation of the item's current source uses: its latest approved
-- proposal of that source generation (none: the item's own typed identity).
CREATE FUNCTION approved_replacement(p_item_id bigint, p_source_generation bigint)
 RETURNS TABLE(proposal_id bigint, tmdb_id integer)
 LANGUAGE sql
 STABLE
AS $function$
    SELECT p.id, p.candidate_tmdb_id
    FROM replacement_proposals p
    WHERE p.item_id = p_item_id
      AND p.source_generation = p_source_generation
      AND p.state = 'approved'
    ORDER BY p.id DESC
    LIMIT 1
$function$;

-- An approved replacement awaits its first observation: the item still has the source
-- it was approved for, holds no live lease, and sits in an active movie/TV library of an
-- active server (the library terms of `observation_due`). The observation sensor's count
-- and the replacement claim both ask it.
CREATE FUNCTION replacement_due(p replacement_proposals, i media_server_items, l libraries, m media_servers)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $function$
    SELECT p.state = 'approved'
       AND p.attempted_at IS NULL
       AND p.source_generation = i.source_generation
       AND i.provider = 'tmdb'
       AND i.provider_kind = p.provider_kind
       AND (i.observation_lease_token IS NULL OR i.observation_lease_expires_at <= now())
       AND l.active AND m.active AND l.media_kind IN ('movie', 'tv')
$function$;

CREATE FUNCTION forget_deleted_replacements()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
 SET jit TO 'off'
AS $function$
BEGIN
    DELETE FROM identity_revalidations r USING old_rows d WHERE r.item_id = d.id;
    UPDATE replacement_proposals p
    SET state = 'superseded', superseded_at = now()
    FROM old_rows d
    WHERE p.item_id = d.id AND p.state <> 'superseded';
    RETURN NULL;
END
$function$;

CREATE FUNCTION forget_all_replacements()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
BEGIN
    DELETE FROM identity_revalidations;
    UPDATE replacement_proposals
    SET state = 'superseded', superseded_at = now()
    WHERE state <> 'superseded';
    RETURN NULL;
END
$function$;

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
  WHERE p.state = 'approved'::text AND p.replaced_at IS NOT NULL AND NOT (EXISTS ( SELECT
           FROM replacement_proposals q
          WHERE q.item_id = p.item_id AND q.source_generation = p.source_generation AND q.state = 'approved'::text AND q.id > p.id));

CREATE TRIGGER media_server_items_forget_replacements AFTER DELETE ON media_server_items REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION forget_deleted_replacements();
CREATE TRIGGER media_server_items_forget_all_replacements BEFORE TRUNCATE ON media_server_items FOR EACH STATEMENT EXECUTE FUNCTION forget_all_replacements();

REVOKE ALL ON FUNCTION
    revalidation_moot(identity_revalidations,media_server_items),
    revalidation_verdict(identity_revalidations,media_server_items,libraries,media_servers,provider_observations),
    replacement_proposal_state(replacement_proposals,media_server_items),
    approved_replacement(bigint,bigint),
    replacement_due(replacement_proposals,media_server_items,libraries,media_servers),
    forget_deleted_replacements(),
    forget_all_replacements()
FROM PUBLIC;

-- == The rows it starts from ==========================================================

INSERT INTO revalidation_budget (bucket) VALUES ('tmdb');
