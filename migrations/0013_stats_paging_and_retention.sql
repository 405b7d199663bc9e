-- Bounded stats maintenance: every pass over users takes one owner per transaction and
-- keeps its position in a row, so a restart resumes where it stopped.

-- An operator's rebuild: one row per request. A pass over every user walks user ids by
-- keyset (`cursor`, the last user enqueued); a pass over a chosen list walks the sorted
-- list by `position`. Each step enqueues one user and moves the position in the same
-- transaction, so a killed pass neither repeats nor skips a user.
CREATE TABLE stats_rebuild_passes (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_ids uuid[],                       -- NULL: every user
    cursor uuid,                           -- every-user pass: the last user enqueued
    position integer NOT NULL DEFAULT 0,   -- list pass: users of the list done
    requested integer NOT NULL DEFAULT 0,  -- users enqueued so far
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    CONSTRAINT stats_rebuild_passes_list_sorted CHECK (
        user_ids IS NULL OR position BETWEEN 0 AND cardinality(user_ids))
);
CREATE INDEX stats_rebuild_passes_open ON stats_rebuild_passes (id) WHERE finished_at IS NULL;

-- The backfill scanner's keyset position over user ids: each tick looks at the next
-- page, so a page that fails cannot keep the scanner from the users after it.
CREATE TABLE stats_scan_cursor (
    id integer PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    cursor uuid,                           -- NULL: the next page starts a new lap
    laps bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO stats_scan_cursor DEFAULT VALUES;

-- "Is there a later job of this user" (retention keeps the latest job per user).
CREATE INDEX stats_jobs_user ON user_exercise_stats_refresh_jobs (user_id, id);
-- Rollover reads a user's manual PR records of a bounded date range.
CREATE INDEX user_manual_pr_records_user_day ON user_manual_pr_records (user_id, recorded_on);
