-- A Dagster refresh run records its completions as materializations in batches; a run
-- that ends before recording a batch leaves those completions marked, and the next run
-- records them.
ALTER TABLE profile_refresh_requests
    ADD COLUMN materialization_due boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT profile_refresh_requests_materialization_due
        CHECK (NOT materialization_due OR status = 'succeeded');
CREATE INDEX profile_refresh_requests_materialization_due
    ON profile_refresh_requests (finished_at, id) WHERE materialization_due;
