-- A batch that keeps its lease holds the lease's slot to its commit.
--
-- A batch's step is several statements sent by the worker, and its commit may wait on
-- a caller's own transaction or a stalled worker, so no margin bounds when it commits:
-- its lease may lapse first, and a claim made then would fill the slot the step's
-- renewal keeps. So, after its work, the step locks its lease's slot (the lock a claim
-- takes to fill a slot, kept to the commit) and confirms, after the lock, that the
-- lease (its end as others see it, passed in) is still active and no other lease holds
-- the slot: from the lock on, no claim can take it. A slot above a lowered cap is no
-- claim's to fill, and is not locked.

CREATE FUNCTION stats_hold_lease_slot(p_run_id bigint, p_lease_until timestamptz)
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_slot integer;
BEGIN
    SELECT r.lease_slot INTO v_slot
    FROM user_stats_projection_runs r
    JOIN stats_projection_worker_settings st ON st.id = 1
    WHERE r.id = p_run_id AND r.lease_slot BETWEEN 1 AND st.active_lease_cap;
    IF v_slot IS NULL
       OR NOT pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), v_slot) THEN
        RETURN false;
    END IF;
    -- After the lock, in statements of their own.
    IF p_lease_until <= clock_timestamp() THEN
        RETURN false;
    END IF;
    RETURN NOT stats_lease_slot_held_by_another(v_slot, p_run_id);
END
$$;

REVOKE ALL ON FUNCTION stats_hold_lease_slot(bigint, timestamptz) FROM PUBLIC;
