-- A stage budget is at least 100 ms. A budget of 1 ms was accepted and every call of its
-- stage ran out of it: a claim budget of 1 ms made a drain publish nothing. A claim, a
-- small account's compute step or publication takes about a millisecond on an idle
-- server and a 100-exercise account's tens, so 100 ms is a floor a stage can work under;
-- above it the budget is the operator's choice (docs/training-stats.md#settings).
ALTER TABLE stats_projection_worker_settings
    DROP CONSTRAINT stats_projection_worker_settings_claim_budget_ms_check,
    DROP CONSTRAINT stats_projection_worker_settings_compute_budget_ms_check,
    DROP CONSTRAINT stats_projection_worker_settings_publish_budget_ms_check,
    ADD CONSTRAINT stats_projection_worker_settings_claim_budget_ms_check
        CHECK (claim_budget_ms >= 100),
    ADD CONSTRAINT stats_projection_worker_settings_compute_budget_ms_check
        CHECK (compute_budget_ms >= 100),
    ADD CONSTRAINT stats_projection_worker_settings_publish_budget_ms_check
        CHECK (publish_budget_ms >= 100 AND publish_budget_ms < 8000);
