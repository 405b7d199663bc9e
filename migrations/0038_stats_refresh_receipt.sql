-- Every writer records a mutation receipt with the generation it asked for; an explicit
-- refresh request (request_stats_refresh) recorded none. Its receipt changes no fact, so
-- it names no session or manual PR record.
ALTER TABLE stats_mutation_receipts
    DROP CONSTRAINT stats_mutation_receipts_one_subject,
    DROP CONSTRAINT stats_mutation_receipts_operation_check,
    ADD CONSTRAINT stats_mutation_receipts_one_subject CHECK (
        num_nonnulls(session_id, manual_pr_record_id)
            = CASE WHEN operation = 'refresh' THEN 0 ELSE 1 END),
    ADD CONSTRAINT stats_mutation_receipts_operation_check CHECK (
        operation IN ('save', 'delete', 'refresh'));

CREATE OR REPLACE FUNCTION request_stats_refresh(p_user_id uuid, p_from_date date, p_exercise_ids text[], p_reason text)
 RETURNS jsonb
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
DECLARE
    v_version bigint;
    v_job bigint;
    v_receipt bigint;
BEGIN
    PERFORM stats_check_owner(p_user_id, p_user_id);
    IF p_from_date IS NOT NULL THEN
        PERFORM stats_checked_date('from_date', p_from_date::text);
    END IF;
    v_version := bump_stats_requested_version(p_user_id);
    v_job := enqueue_user_exercise_stats_refresh_job(
        p_user_id, 'manual_refresh', p_from_date, coalesce(p_exercise_ids, '{}'),
        coalesce(p_reason, 'manual refresh'), NULL, v_version);
    INSERT INTO stats_mutation_receipts (user_id, operation, requested_version)
    VALUES (p_user_id, 'refresh', v_version)
    RETURNING id INTO v_receipt;
    RETURN jsonb_build_object('job_id', v_job, 'requested_version', v_version,
                              'receipt_id', v_receipt);
END
$function$;

