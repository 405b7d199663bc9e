-- Statements of the demo inventory loader (`inventory-pipeline dev --demo`).

-- name: has_inventory
SELECT EXISTS (SELECT 1 FROM media_servers) AS present;

-- name: insert_server
INSERT INTO media_servers (name, kind) VALUES (%(name)s, %(kind)s) RETURNING id;

-- name: insert_library
INSERT INTO libraries (server_id, name, media_kind) VALUES (%(server_id)s, %(name)s, %(media_kind)s)
RETURNING id;

-- name: insert_policy
INSERT INTO library_policies (library_id, enabled, intent) VALUES (%(library_id)s, true, 'active');

-- name: insert_items
-- One statement per library: change capture advances the library once.
INSERT INTO media_server_items (library_id, title, year, provider, provider_kind, provider_id,
                                rating, genres, primary_studio, original_language, plot)
SELECT %(library_id)s, x.title, x.year, x.provider, x.provider_kind, x.provider_id, x.rating,
       x.genres, x.primary_studio, x.original_language, x.plot
FROM jsonb_to_recordset(%(items)s) AS x (
    title text, year int, provider text, provider_kind text, provider_id text, rating numeric,
    genres text[], primary_studio text, original_language text, plot text
);

-- name: insert_exercise
INSERT INTO exercises (id, name) VALUES (%(id)s, %(name)s) ON CONFLICT (id) DO NOTHING;

-- name: save_session
-- Through the write surface any application uses (canonical rows, receipt, queue).
SELECT save_training_session(%(user_id)s, %(session)s);

-- name: insert_merged_item
-- An item of the demo's history (docs/identity-revalidation.md): observed with its
-- external ids, then its TMDb record was merged away and an observation answered 404,
-- so the next one (due now) makes its case eligible for revalidation. Written as those
-- observations would have left it just before the load, so the ages the UI and
-- `status` show (failing since, observed) are real, not a made-up past.
WITH item AS (
    INSERT INTO media_server_items (
        library_id, title, year, provider, provider_kind, provider_id, rating, genres,
        original_language, plot, observed_at, last_attempt_at, observation_due_at,
        observation_attempts, observation_successes, recovery_case_id, recovery_provider,
        recovery_provider_kind, recovery_provider_id, recovery_category, recovery_attempts,
        recovery_cause_attempts, recovery_first_failed_at, recovery_last_failed_at)
    VALUES (%(library_id)s, %(title)s, %(year)s, 'tmdb', %(kind)s, %(tmdb_id)s::text, 7.5,
            ARRAY['Drama'], 'en', 'A demo item TMDb merged into another record.',
            now(), now(), now(), 2, 1,
            gen_random_uuid(), 'tmdb', %(kind)s, %(tmdb_id)s::text, 'not_found', 1,
            1, now(), now())
    RETURNING id, source_generation
)
INSERT INTO provider_observations (item_id, source_generation, provider_kind, tmdb_id, title,
                                   genres, companies, observed_at, imdb_id, tvdb_id)
SELECT item.id, item.source_generation, %(kind)s, %(tmdb_id)s, %(title)s, ARRAY['Drama'],
       '{}', now(), %(imdb_id)s, %(tvdb_id)s
FROM item;
