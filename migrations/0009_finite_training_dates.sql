-- Issue 8: PostgreSQL reads 'infinity' and '-infinity' as dates, so a write could store a
-- session or a manual PR at no real day, outside every period and PR window. Dates of
-- the training log are finite.
ALTER TABLE training_sessions
    ADD CONSTRAINT training_sessions_session_date_finite CHECK (isfinite(session_date));
ALTER TABLE user_manual_pr_records
    ADD CONSTRAINT user_manual_pr_records_recorded_on_finite CHECK (isfinite(recorded_on));
