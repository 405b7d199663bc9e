-- A PR overview whose window holds no exercise could not say it was stale: `stale` was a
-- column of the rows only. A user whose published window is empty (every session deleted,
-- or only warm-ups logged) who then saved a 140 kg squat read "no records" as current
-- until that save was published. get_pr_overview_status is the overview's header (the
-- generation served, stale, the exercises it holds), failing closed as the reader does;
-- get_pr_overview reads it first, so the fail-closed rule has one source.
-- The PR overview's header for one date: the applied generation whose window serves it,
-- whether the user's stats are stale (a newer generation requested, or a range owed),
-- and how many exercises the window holds. It says stale even when the window holds no
-- exercise, where no row of get_pr_overview could. Fails closed with 55000 unless the
-- applied generation has a window for exactly that date: no other date's window, and no
-- computing at read time.
CREATE OR REPLACE FUNCTION get_pr_overview_status(p_user_id uuid, p_as_of date)
 RETURNS TABLE(generation bigint, as_of_date date, stale boolean, exercise_count integer)
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
#variable_conflict use_column
BEGIN
    PERFORM stats_check_owner(p_user_id, p_user_id);
    RETURN QUERY
    SELECT h.generation, h.as_of_date, stats_user_is_stale(p_user_id), h.exercise_count
    FROM user_stats_refresh_state st
    JOIN user_pr_overview_snapshot_headers h
      ON h.user_id = st.user_id AND h.generation = st.applied_version AND h.as_of_date = p_as_of
    WHERE st.user_id = p_user_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no PR overview snapshot for % in the applied generation', p_as_of
            USING ERRCODE = '55000';
    END IF;
END
$function$;

-- The PR overview for one date: one row per exercise of the applied generation's window,
-- each saying whether the stats are stale (get_pr_overview_status, which it reads first,
-- fails closed and says it for a window without rows).
CREATE OR REPLACE FUNCTION get_pr_overview(p_user_id uuid, p_as_of date)
 RETURNS TABLE(exercise_id text, best_e1rm_all_time numeric, best_e1rm_30d numeric, best_e1rm_30d_prior_year numeric, heaviest_kg numeric, stale boolean)
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'public', 'pg_temp'
AS $function$
DECLARE
    v_header record;
BEGIN
    SELECT o.generation, o.stale INTO v_header FROM get_pr_overview_status(p_user_id, p_as_of) o;
    RETURN QUERY
    SELECT s.exercise_id, s.best_e1rm_all_time, s.best_e1rm_30d, s.best_e1rm_30d_prior_year,
           s.heaviest_kg, v_header.stale
    FROM user_pr_exercise_summary_snapshots s
    WHERE s.user_id = p_user_id AND s.generation = v_header.generation
      AND s.as_of_date = p_as_of
    ORDER BY s.exercise_id;
END
$function$;

REVOKE ALL ON FUNCTION get_pr_overview_status(p_user_id uuid, p_as_of date) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION get_pr_overview_status(p_user_id uuid, p_as_of date) TO inventory_app;
