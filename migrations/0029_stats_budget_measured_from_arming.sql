-- A stage's statement budget is measured from when the call was armed. A statement
-- timeout and a client's or operator's cancel share SQLSTATE 57014, and the handler
-- tells them apart by the time the call ran. The server starts a statement's timer at
-- its first protocol message (Bind), but statement_timestamp() is taken again at its
-- Execute; under load the gap between them made a timeout that fired on time read as a
-- cancel a few milliseconds early, and the stage re-raised it instead of counting an
-- attempt. arm_stage records the instant it armed the budget, before the stage's timer
-- starts; a call made by hand, never armed, is measured from its statement's start.
CREATE OR REPLACE FUNCTION stats_budget_spent(p_stage text) RETURNS boolean
LANGUAGE sql VOLATILE
AS $function$
    SELECT clock_timestamp()
           - coalesce(nullif(current_setting('inventory.stats_armed_at', true), '')::timestamptz,
                      statement_timestamp())
           >= make_interval(secs => CASE p_stage
                                        WHEN 'claim' THEN st.claim_budget_ms
                                        WHEN 'compute' THEN st.compute_budget_ms
                                        WHEN 'publish' THEN st.publish_budget_ms
                                    END / 1000.0)
    FROM stats_projection_worker_settings st WHERE st.id = 1
$function$;
