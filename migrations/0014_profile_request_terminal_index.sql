-- The planner's circuit probe reads each dirty library's latest terminal request. With
-- an index that matches both its predicate and its order, that read is one index
-- descent whatever the statistics say; without it, a plan made while few requests were
-- terminal scans every terminal request once per dirty library.
CREATE INDEX profile_refresh_requests_library_terminal
    ON profile_refresh_requests (library_id, id) WHERE status IN ('succeeded', 'failed');
