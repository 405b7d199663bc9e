-- A case's backoff grows with the failures under its current cause, so each cause starts
-- at its own start (transient six hours, the others one day): a long not_found case that
-- turns transient is retried within 6-12 h, not after the days its not_found failures had
-- grown the window to. recovery_attempts still counts every failure of the case.
-- Open cases are taken to have failed under their current cause all along.
ALTER TABLE media_server_items
    ADD COLUMN recovery_cause_attempts integer DEFAULT 0 NOT NULL,
    ADD CONSTRAINT media_server_items_recovery_cause_attempts_check
        CHECK (recovery_cause_attempts >= 0 AND recovery_cause_attempts <= recovery_attempts);
UPDATE media_server_items SET recovery_cause_attempts = recovery_attempts
WHERE recovery_attempts > 0;

CREATE OR REPLACE FUNCTION advance_source_generation()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
BEGIN
    NEW.source_generation := OLD.source_generation + 1;
    NEW.observation_lease_token := NULL;
    NEW.observation_lease_expires_at := NULL;
    NEW.observation_due_at := now();
    NEW.observed_at := NULL;
    NEW.last_attempt_at := NULL;
    NEW.recovery_case_id := NULL;
    NEW.recovery_provider := NULL;
    NEW.recovery_provider_kind := NULL;
    NEW.recovery_provider_id := NULL;
    NEW.recovery_category := NULL;
    NEW.recovery_attempts := 0;
    NEW.recovery_cause_attempts := 0;
    NEW.recovery_first_failed_at := NULL;
    NEW.recovery_last_failed_at := NULL;
    NEW.recovery_resolved_at := NULL;
    RETURN NEW;
END
$function$;
