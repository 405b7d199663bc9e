-- A run's next batch keeps its lease slot locked to its commit.
--
-- A batch's transaction is several statements sent by the worker, so no margin bounds
-- how long it runs: a lease far from its end when the batch started could still lapse
-- before the batch commits, and a claim made after the lapse would then fill the slot
-- the lease held while the batch renewed it, two active leases where the cap allows
-- one. A batch whose lease is active therefore first locks the slot it holds (the lock
-- a claim takes to fill a slot, kept to the commit), confirmed after the lock, in
-- statements of their own, still active by the clock and held by no other lease. When
-- it cannot (the lease lapsed, its run waits out a retry time, holds no slot, or the
-- slot is being filled), the batch renews its lease only into a free slot under the cap
-- (stats_renew_lapsed_lease).

CREATE FUNCTION stats_hold_lease_slot(p_run_id bigint) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_slot integer;
BEGIN
    SELECT r.lease_slot INTO v_slot
    FROM user_stats_projection_runs r
    WHERE r.id = p_run_id
      AND stats_run_is_active(r.phase, r.lease_until, r.retry_not_before);
    IF v_slot IS NULL
       OR NOT pg_try_advisory_xact_lock(hashtext('stats_lease_slots'), v_slot) THEN
        RETURN false;
    END IF;
    -- After the lock: a claim that saw the lease lapsed may have filled the slot before
    -- it; from the lock on, none can.
    IF stats_lease_slot_held_by_another(v_slot, p_run_id) THEN
        RETURN false;
    END IF;
    RETURN EXISTS (
        SELECT 1 FROM user_stats_projection_runs r
        WHERE r.id = p_run_id AND r.lease_until > clock_timestamp());
END
$$;

REVOKE ALL ON FUNCTION stats_hold_lease_slot(bigint) FROM PUBLIC;
