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
