"""What must hold after quiescence, each check returning divergences as one line
apiece. `outstanding` is the quiescence test: the work still in flight."""

from __future__ import annotations

from typing import Any

from chaos.config import EXPECTED_RECORDED_SQLSTATES, RELEASE_JITTER_SECONDS, RETRY_POLICY
from inventory_pipeline.db import Connection, execute, fetch_all, fetch_one, jsonb
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.generator import generate_profile
from inventory_pipeline.stats import service

# The longest delay a case may legitimately wait: the retry cap, or the release jitter
# of an authentication case released after a verified key.
LONGEST_DELAY_SECONDS = max(RETRY_POLICY.cap_seconds, RELEASE_JITTER_SECONDS)

ACTIVE_LIBRARIES = (
    "SELECT l.id FROM libraries l JOIN media_servers m ON m.id = l.server_id"
    " WHERE l.active AND m.active ORDER BY l.id"
)


# An authentication case in a library of another media kind (an item moved there) is
# never woken by a verified key (docs/credentials.md#release: only cases in a library of
# their kind): it waits out its ordinary cooldown, a day or more.
AUTH_CASE_WAITS = (
    "(i.recovery_category = 'auth' AND i.provider_kind IS DISTINCT FROM"
    " (SELECT l.media_kind FROM libraries l WHERE l.id = i.library_id))"
)


def _count(conn: Connection, sql: str) -> int:
    row = fetch_one(conn, f"SELECT count(*) AS n FROM ({sql}) AS q")
    return 0 if row is None else int(row["n"])


def outstanding(conn: Connection) -> dict[str, int]:
    """Work not yet done; all zero means quiescent. Captured changes are folded first
    (the planner's first step): a change not yet folded is a dirty library too."""
    execute(conn, "SELECT fold_inventory_changes()")
    return {
        "dirty libraries": _count(
            conn,
            "SELECT 1 FROM library_inventory_state s WHERE s.library_id IN"
            f" ({ACTIVE_LIBRARIES}) AND s.acknowledged_revision < s.revision",
        ),
        # Pending work of an inactive library waits for it by design
        # (docs/profiles.md#claim-and-lease).
        "open profile requests": _count(
            conn,
            "SELECT 1 FROM profile_refresh_requests WHERE status IN ('pending', 'running')"
            f" AND (status = 'running' OR library_id IN ({ACTIVE_LIBRARIES}))",
        ),
        "users behind": _count(
            conn, "SELECT 1 FROM user_stats_refresh_state WHERE applied_version < requested_version"
        ),
        "open stats jobs": _count(
            conn,
            "SELECT 1 FROM user_exercise_stats_refresh_jobs"
            " WHERE status IN ('pending', 'processing')",
        ),
        "observable open cases": _count(
            conn,
            "SELECT 1 FROM media_server_items i"
            f" WHERE i.library_id IN ({ACTIVE_LIBRARIES}) AND i.recovery_case_id IS NOT NULL"
            " AND i.recovery_resolved_at IS NULL AND i.recovery_category <> 'not_found'"
            f" AND NOT {AUTH_CASE_WAITS}",
        ),
        # An item with a typed identity gets an attempt (an observation or a recovery
        # case) for its source; one that never does stops nothing else, but is lost.
        "items never attempted": _count(
            conn,
            "SELECT 1 FROM media_server_items i"
            f" WHERE i.library_id IN ({ACTIVE_LIBRARIES}) AND i.provider = 'tmdb'"
            " AND i.provider_kind IN ('movie', 'tv') AND i.observed_at IS NULL"
            " AND i.recovery_case_id IS NULL AND i.observation_due_at <= now()",
        ),
        # A dead worker's lease not yet taken over. Live leases are work in progress
        # that never stops: unresolved 404s and malformed identities are rechecked on
        # their backoff for good (seconds here). An item of an inactive library keeps
        # its expired lease until the library is active again (claim_due admits it).
        "expired observation leases": _count(
            conn,
            "SELECT 1 FROM media_server_items i WHERE i.observation_lease_token IS NOT NULL"
            " AND i.observation_lease_expires_at <= now()"
            f" AND i.library_id IN ({ACTIVE_LIBRARIES})",
        ),
    }


def describe_leases(conn: Connection) -> list[str]:
    """The leased items, for a run that did not quiesce."""
    return [
        f"item {r['id']}: lease {r['state']}, library {r['library_id']}"
        f" {'active' if r['active'] else 'inactive'}, due in {r['due_in']:.0f} s"
        for r in fetch_all(
            conn,
            "SELECT i.id, i.library_id, l.active AND m.active AS active,"
            " CASE WHEN i.observation_lease_expires_at > now() THEN 'live' ELSE 'expired' END"
            "   AS state,"
            " extract(epoch FROM i.observation_due_at - now())::float8 AS due_in"
            " FROM media_server_items i JOIN libraries l ON l.id = i.library_id"
            " JOIN media_servers m ON m.id = l.server_id"
            " WHERE i.observation_lease_token IS NOT NULL ORDER BY i.id LIMIT 10",
        )
    ]


def profiles_converged(conn: Connection) -> list[str]:
    """Every active library acknowledged at its revision, its profile equal to a
    from-scratch recomputation of its current projection (or absent when empty)."""
    execute(conn, "SELECT fold_inventory_changes()")
    out: list[str] = []
    for row in fetch_all(conn, ACTIVE_LIBRARIES):
        library_id = int(row["id"])
        state = fetch_one(
            conn,
            "SELECT revision, acknowledged_revision FROM library_inventory_state"
            " WHERE library_id = %s",
            (library_id,),
        )
        assert state is not None
        if state["acknowledged_revision"] != state["revision"]:
            out.append(
                f"library {library_id}: acknowledged {state['acknowledged_revision']}"
                f" != revision {state['revision']}"
            )
        library = profiles.read_snapshot(conn, library_id)
        expected = generate_profile(library.columns, library.rows) if library.rows else None
        stored = fetch_one(
            conn,
            "SELECT inventory_revision, item_count, profile = %s AS same"
            " FROM library_profiles WHERE library_id = %s",
            (jsonb(expected), library_id),
        )
        if expected is None:
            if stored is not None:
                out.append(f"library {library_id}: empty but a profile is stored")
        elif stored is None:
            out.append(f"library {library_id}: {len(library.rows)} items but no profile")
        elif not stored["same"] or stored["item_count"] != len(library.rows):
            out.append(f"library {library_id}: profile differs from a recomputation")
        elif stored["inventory_revision"] != library.revision:
            out.append(
                f"library {library_id}: profile of revision {stored['inventory_revision']},"
                f" library at {library.revision}"
            )
    return out


HARNESS_ACTOR = "chaos.%"
# Stats publications with the token their publisher declared: to the harness (a stepping
# worker), else to the product's fence (a drain loop, a Dagster run).
PUBLICATIONS = (
    "SELECT *, CASE WHEN completing_token <> '' THEN completing_token ELSE product_token END"
    " AS declared FROM chaos_stats_publications"
)


def no_lost_claim_acknowledged(conn: Connection) -> list[str]:
    """From the audit trail, ordered by its event sequence and timed by the event clock:
    each acknowledgement came from a running request's latest claim while its lease was
    live, by the token the worker declared; each stats publication begun under a live
    lease by its holder;
    each observation completion from the item's latest claim of the same source; no
    revision or version ever went back. Sessions that declare no token (Dagster runs)
    are judged by the latest claim and the lease alone."""
    out = [
        f"request {r['request_id']}: acknowledged by token {r['completing_token'] or '?'}"
        f" ({r['why']})"
        for r in fetch_all(
            conn,
            "SELECT a.request_id, a.completing_token, CASE"
            "  WHEN a.from_status IS DISTINCT FROM 'running' THEN"
            "    'from ' || coalesce(a.from_status, 'nothing') || ', not a running claim'"
            "  WHEN a.completing_token = '' AND a.actor LIKE %(harness)s"
            "    THEN 'a harness worker that declared no token'"
            "  WHEN a.completing_token <> '' AND a.completing_token <> a.lease_token::text"
            "    THEN 'not the live claim'"
            "  WHEN a.acked_at >= a.lease_expires_at THEN 'lease expired'"
            "  ELSE 'a newer claim existed' END AS why"
            " FROM chaos_profile_acks a"
            " WHERE a.from_status IS DISTINCT FROM 'running'"
            " OR (a.completing_token = '' AND a.actor LIKE %(harness)s)"
            " OR (a.completing_token <> '' AND a.completing_token <> a.lease_token::text)"
            " OR a.acked_at >= a.lease_expires_at OR a.lease_token IS DISTINCT FROM ("
            "   SELECT c.lease_token FROM chaos_profile_claims c"
            "   WHERE c.request_id = a.request_id AND c.seq < a.seq"
            "   ORDER BY c.seq DESC LIMIT 1)"
            " ORDER BY a.seq",
            {"harness": HARNESS_ACTOR},
        )
    ]
    out += [
        f"request {r['request_id']}: acknowledged {r['n']} times"
        for r in fetch_all(
            conn,
            "SELECT request_id, count(*) AS n FROM chaos_profile_acks"
            " GROUP BY request_id HAVING count(*) > 1 ORDER BY request_id",
        )
    ]
    out += [
        f"library {r['library_id']}: profile of revision {r['inventory_revision']} written"
        f" after one of revision {r['before']} ({r['operation']})"
        for r in fetch_all(
            conn,
            "SELECT library_id, inventory_revision, before, operation FROM ("
            "   SELECT library_id, inventory_revision, operation, seq,"
            "     max(inventory_revision) OVER (PARTITION BY library_id ORDER BY seq"
            "       ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before"
            "   FROM chaos_profile_writes) w"
            " WHERE operation <> 'DELETE' AND inventory_revision < before ORDER BY seq",
        )
    ]
    out += [
        f"stats run {r['run_id']}: published by {r['why']} (process {r['worker_pid']})"
        for r in fetch_all(
            conn,
            "SELECT run_id, worker_pid, CASE WHEN began_at >= lease_until"
            "   THEN 'its worker after the lease ended'"
            "   ELSE 'a worker that did not hold its lease' END AS why"
            f" FROM ({PUBLICATIONS}) p"
            " WHERE began_at >= lease_until"
            " OR (declared = '' AND actor LIKE %(harness)s)"
            " OR (declared <> '' AND declared <> lease_token::text)"
            " ORDER BY seq",
            {"harness": HARNESS_ACTOR},
        )
    ]
    out += [
        f"item {r['item_id']}: completed by a token that was not its latest claim"
        for r in fetch_all(
            conn,
            "SELECT c.item_id FROM chaos_item_completions c LEFT JOIN LATERAL ("
            "   SELECT k.lease_token, k.source_generation FROM chaos_item_claims k"
            "   WHERE k.item_id = c.item_id AND k.seq < c.seq"
            "   ORDER BY k.seq DESC LIMIT 1) k ON true"
            " WHERE c.completing_token <> coalesce(c.lease_token::text, '')"
            " OR (c.lease_token, c.source_generation)"
            "   IS DISTINCT FROM (k.lease_token, k.source_generation)"
            " ORDER BY c.seq",
        )
    ]
    out += [
        f"{r['what']}: {r['detail']}"
        for r in fetch_all(conn, "SELECT what, detail FROM chaos_regressions ORDER BY seq")
    ]
    return out


def no_attempt_burned_unworked(conn: Connection) -> list[str]:
    """No attempt spent on a lease that expired before work on it began. The harness's
    own workers begin at once (claim, then process in the same step), so their lapses
    are the faults it injects (kills, pauses, stalls, terminations). Anyone else's claim
    (a Dagster sensor or run) whose lease ran out with no write by its holder was never
    worked on in time, unless a server restart the harness caused fell inside its
    lease."""
    return [
        f"request {r['request_id']}: attempt {r['attempt']} spent on a lease that expired"
        f" before work began (claimed by {r['actor']}, {r['seconds']:.1f} s lease)"
        for r in fetch_all(
            conn,
            "SELECT c.request_id, c.attempt, c.actor,"
            " extract(epoch FROM c.lease_expires_at - c.claimed_at)::float8 AS seconds"
            " FROM chaos_profile_claims c"
            " JOIN chaos_profile_lapses l ON l.request_id = c.request_id"
            "   AND l.lease_token = c.lease_token"
            " WHERE c.actor NOT LIKE %(harness)s AND l.ended_at >= l.lease_expires_at"
            " AND l.completing_token IS DISTINCT FROM c.lease_token::text"
            " AND NOT EXISTS (SELECT 1 FROM chaos_faults f"
            "   WHERE f.started_at <= l.lease_expires_at AND f.ended_at >= c.claimed_at)"
            " ORDER BY l.seq",
            {"harness": HARNESS_ACTOR},
        )
    ]


def wakeups(conn: Connection, limit: int, spacing_seconds: float) -> list[str]:
    """docs/credentials.md#invariants from the audit trail: each verification made by the
    probe lease's holder while the lease was live, for the generation the lease and the
    settings name; each release of a generation verified before it; at most `limit`
    releases per batch; a batch no sooner than `spacing_seconds` after the previous batch
    began; one receipt per item per generation."""
    out = [
        f"generation {str(r['generation'])[:8]}: verified {r['why']}"
        for r in fetch_all(
            conn,
            "SELECT generation, CASE"
            "  WHEN lease_token IS NULL THEN 'without a probe lease'"
            "  WHEN completing_token <> lease_token::text THEN 'by a worker without the lease'"
            "  WHEN verified_at >= lease_expires_at THEN 'after the probe lease expired'"
            "  WHEN lease_generation IS DISTINCT FROM generation"
            "    THEN 'under a lease for another generation'"
            "  ELSE 'while the settings held another generation or were inactive' END AS why"
            " FROM chaos_verifications"
            " WHERE lease_token IS NULL OR completing_token <> lease_token::text"
            " OR verified_at >= lease_expires_at"
            " OR lease_generation IS DISTINCT FROM generation"
            " OR settings_generation IS DISTINCT FROM generation OR NOT settings_active"
            " ORDER BY seq",
        )
    ]
    out += [
        f"item {r['item_id']}: released for generation {str(r['generation'])[:8]}"
        " before it was verified"
        for r in fetch_all(
            conn,
            "SELECT r.item_id, r.generation FROM chaos_wakeup_releases r"
            " WHERE NOT EXISTS (SELECT 1 FROM chaos_verifications v"
            "   WHERE v.generation = r.generation AND v.seq < r.seq)"
            " ORDER BY r.seq",
        )
    ]
    out += [
        f"release batch of {r['n']} cases (limit {limit})"
        for r in fetch_all(
            conn,
            "SELECT batch, count(*) AS n FROM chaos_wakeup_releases"
            " GROUP BY batch HAVING count(*) > %s ORDER BY min(seq)",
            (limit,),
        )
    ]
    out += [
        f"release batch {r['gap']:.2f} s after the previous batch began"
        f" (spacing {spacing_seconds:g} s)"
        for r in fetch_all(
            conn,
            "SELECT extract(epoch FROM first_at - lag(started) OVER w)::float8 AS gap"
            " FROM (SELECT batch, min(seq) AS seq, min(released_at) AS first_at,"
            "   min(xact_start) AS started FROM chaos_wakeup_releases GROUP BY batch) b"
            " WINDOW w AS (ORDER BY seq)",
        )
        if r["gap"] is not None and r["gap"] < spacing_seconds
    ]
    out += [
        f"item {r['item_id']}: {r['n']} release receipts for generation {str(r['generation'])[:8]}"
        for r in fetch_all(
            conn,
            "SELECT item_id, generation, count(*) AS n FROM chaos_wakeup_releases"
            " GROUP BY item_id, generation HAVING count(*) > 1 ORDER BY item_id",
        )
    ]
    return out


def item_records_have_items(conn: Connection) -> list[str]:
    """What is kept by item id (an observation, a revalidation record, a standing
    proposal) belongs to an item that exists: a deleted, truncated or re-keyed item's
    records go with it, or an item reusing the id could match them."""
    out = []
    for table, standing in (
        ("provider_observations", "true"),
        ("identity_revalidations", "true"),
        ("replacement_proposals", "r.state <> 'superseded'"),
    ):
        out += [
            f"{table}: a record of item {r['item_id']}, which no longer exists"
            for r in fetch_all(
                conn,
                f"SELECT DISTINCT r.item_id FROM {table} r WHERE {standing}"
                " AND NOT EXISTS (SELECT 1 FROM media_server_items i WHERE i.id = r.item_id)"
                " ORDER BY r.item_id",
            )
        ]
    return out


# Open authentication cases recorded with another credential generation than the
# verified one, after its verification (a request sent with an older key answered 401
# late), that the release would take by every other rule (the product's own test with no
# time limit), and whether the release's own test takes them now: docs/credentials.md
# says they are released with the verified generation's cases.
LATE_AUTH_CASES = """
SELECT i.id, i.recovery_case_id, i.recovery_last_failed_at,
       authentication_case_releasable(i, l, m, w.verified_at, w.verified_generation)
           AS releasable
FROM media_server_items i
JOIN libraries l ON l.id = i.library_id
JOIN media_servers m ON m.id = l.server_id
JOIN credential_wakeups w ON w.provider = 'tmdb'
WHERE w.verified_generation IS NOT NULL
  AND i.recovery_credential_generation <> w.verified_generation
  AND i.recovery_last_failed_at > w.verified_at
  AND authentication_case_releasable(i, l, m, 'infinity', w.verified_generation)
"""


def late_auth_cases(conn: Connection) -> list[tuple[tuple[int, object, object], bool]]:
    """Each late authentication case, and whether the release would take it now."""
    return [
        ((int(r["id"]), r["recovery_case_id"], r["recovery_last_failed_at"]), r["releasable"])
        for r in fetch_all(conn, LATE_AUTH_CASES)
    ]


# A typed identity no TMDb id can be read from: anything but ASCII digits, or more
# digits than any id has. (Leading zeros and the int32 edge are left to the product.)
MALFORMED = "(i.provider_id !~ '^[0-9]+$' OR length(i.provider_id) > 10)"


def malformed_identities(conn: Connection) -> list[str]:
    """An item whose typed identity is malformed is never observed (nothing is read as a
    TMDb id from it) and, in an active library, holds an open recovery case (the
    database allows only the allowlisted categories)."""
    out = [
        f"item {r['id']}: malformed identity {r['provider_id']!r} observed as TMDb {r['tmdb_id']}"
        for r in fetch_all(
            conn,
            "SELECT i.id, i.provider_id, o.tmdb_id FROM media_server_items i"
            " JOIN provider_observations o ON o.item_id = i.id"
            f" AND o.source_generation = i.source_generation WHERE {MALFORMED}"
            " ORDER BY i.id",
        )
    ]
    out += [
        f"item {r['id']}: malformed identity {r['provider_id']!r} without an open recovery case"
        for r in fetch_all(
            conn,
            "SELECT i.id, i.provider_id FROM media_server_items i"
            f" WHERE i.library_id IN ({ACTIVE_LIBRARIES}) AND i.provider = 'tmdb'"
            f" AND i.provider_kind IN ('movie', 'tv') AND {MALFORMED}"
            " AND (i.recovery_case_id IS NULL OR i.recovery_resolved_at IS NOT NULL)"
            " ORDER BY i.id",
        )
    ]
    return out


def recorded_errors(
    conn: Connection, expected: dict[str, frozenset[str]] = EXPECTED_RECORDED_SQLSTATES
) -> list[str]:
    """Database errors a product path recorded in a row (a failed attempt, a failed or
    rejected stats run) with a SQLSTATE that path does not expect: a swallowed
    deadlock, constraint or SQL error, or a guard's refusal."""
    rows = fetch_all(
        conn,
        "SELECT path, sqlstate, count(*) AS n, min(error) AS example FROM chaos_recorded_errors"
        " WHERE sqlstate IS NOT NULL GROUP BY path, sqlstate ORDER BY path, sqlstate",
    )
    return [
        f"{r['path']} recorded a database error it does not expect:"
        f" SQLSTATE {r['sqlstate']} x{r['n']} ({r['example']})"
        for r in rows
        if r["sqlstate"] not in expected.get(r["path"], frozenset())
    ]


def stats_leases(conn: Connection) -> list[str]:
    """docs/training-stats.md#leases-and-the-cap: leases granted under the current cap never
    outnumber it; a step of a live claim is taken by its lease holder (its transaction
    declared the run's token and began before the lease ended: the clock the stages
    check), unless it is the expiry recovery retiring a lapsed lease."""
    out = [
        f"stats run {r['run_id']}: granted a lease with {r['live']} active"
        f" ({r['earlier']} granted before the cap last changed), cap {r['cap']}"
        for r in fetch_all(
            conn,
            "SELECT run_id, live, earlier, cap FROM chaos_stats_grants"
            " WHERE NOT raced AND live - earlier > cap ORDER BY seq",
        )
    ]
    return out + [
        f"stats run {r['run_id']}: step to {r['phase']} {r['why']}"
        for r in fetch_all(
            conn,
            "SELECT run_id, phase, CASE WHEN product_token <> lease_token::text"
            "  THEN 'by a session without its lease token'"
            "  ELSE 'after its lease ended' END AS why"
            " FROM chaos_stats_steps"
            " WHERE from_phase IN ('claimed', 'computed')"
            " AND NOT (phase = 'failed' AND error = 'lease expired' AND at >= lease_until)"
            " AND (product_token <> lease_token::text OR began_at >= lease_until)"
            " ORDER BY seq",
        )
    ]


def _inactive(kind: str, column: str, written: str) -> str:
    """SQL: was the library or server in `column` inactive from the writing statement's
    start (statement_at, less the margin) until its write (`written`)? Activity changes
    are timed as they commit; a reactivation in that window raced the statement."""
    since = "c.statement_at - make_interval(secs => %(margin)s)"
    return (
        f"coalesce((SELECT a.active IS FALSE FROM chaos_activity a WHERE a.kind = '{kind}'"
        f" AND a.id = c.{column} AND a.at < {since} ORDER BY a.seq DESC LIMIT 1), false)"
        f" AND NOT EXISTS (SELECT 1 FROM chaos_activity a WHERE a.kind = '{kind}'"
        f" AND a.id = c.{column} AND a.at >= {since} AND a.at <= c.{written})"
    )


def release_rules(
    conn: Connection, jitter: tuple[int, int] = (1, 60), margin_seconds: float = 1.0
) -> list[str]:
    """docs/credentials.md#release: a verified key releases only open authentication
    cases, each in an active library (of an active server) of its own media kind, due
    again after a jitter of 1-60 s."""
    return [
        f"item {r['item_id']}: released {r['why']}"
        for r in fetch_all(
            conn,
            "SELECT item_id, CASE WHEN NOT open_auth THEN 'without an open authentication case'"
            "  WHEN NOT own_kind THEN 'in a library of another media kind'"
            "  WHEN library_inactive OR server_inactive THEN 'in an inactive library or server'"
            "  ELSE format('due after %%s s', round(jitter_seconds::numeric, 1)) END AS why"
            f" FROM (SELECT c.*, {_inactive('library', 'library_id', 'released_at')}"
            f"   AS library_inactive, {_inactive('server', 'server_id', 'released_at')}"
            "   AS server_inactive FROM chaos_wakeup_releases c) r"
            " WHERE NOT open_auth OR NOT own_kind OR library_inactive OR server_inactive"
            " OR jitter_seconds NOT BETWEEN %(low)s AND %(high)s ORDER BY seq",
            {"low": jitter[0], "high": jitter[1], "margin": margin_seconds},
        )
    ]


def inactive_claims(conn: Connection, margin_seconds: float = 1.0) -> list[str]:
    """docs/profiles.md: a claim never starts at a library (or a server) inactive by
    then; its running work may finish. A change is timed as it committed and a claim
    from its statement's start (its reads are no older) to its write: the claim broke
    the rule when its library or server had turned inactive `margin_seconds` before the
    statement began and stayed so until the write."""
    rows = fetch_all(
        conn,
        "SELECT * FROM (SELECT c.seq, c.request_id, c.library_id, c.server_id, c.actor,"
        f" {_inactive('library', 'library_id', 'claimed_at')} AS library_inactive,"
        f" {_inactive('server', 'server_id', 'claimed_at')} AS server_inactive"
        " FROM chaos_profile_claims c) q"
        " WHERE library_inactive OR server_inactive ORDER BY seq",
        {"margin": margin_seconds},
    )
    return [
        f"request {r['request_id']}: claimed by {r['actor']} while "
        + (f"library {r['library_id']}" if r["library_inactive"] else f"server {r['server_id']}")
        + " was inactive"
        for r in rows
    ]


def interruptions(conn: Connection) -> tuple[list[str], int]:
    """An observation whose answer could not be saved (a sync program held its library
    past the completion's tries) goes back due RETRY_POLICY.interrupted_seconds later,
    so no run sends it again at once (docs/provider-recovery.md#database-errors); a
    claim under an approved replacement is due whatever its item's due time. Also how
    many interrupted claims were given back: a run with none proves nothing here."""
    rows = fetch_all(
        conn,
        "SELECT x.item_id, g.due_in_seconds FROM chaos_interruptions x"
        " JOIN chaos_item_givebacks g ON g.lease_token = x.lease_token"
        " WHERE NOT x.replacement ORDER BY g.seq",
    )
    least = RETRY_POLICY.interrupted_seconds - 0.5
    out = [
        f"item {r['item_id']}: an interrupted observation was given back due in"
        f" {r['due_in_seconds']:.1f} s, not {RETRY_POLICY.interrupted_seconds} s"
        for r in rows
        if r["due_in_seconds"] < least
    ]
    return out, len(rows)


def nothing_stuck(conn: Connection) -> list[str]:
    """Whatever is left open has a due retry within the longest legitimate delay (an
    inactive library's cases wait for it, as its profile requests do)."""
    out = [
        f"item {r['id']}: open {r['recovery_category']} case without a due retry"
        for r in fetch_all(
            conn,
            "SELECT i.id, i.recovery_category FROM media_server_items i"
            " WHERE i.recovery_case_id IS NOT NULL AND i.recovery_resolved_at IS NULL"
            f" AND i.library_id IN ({ACTIVE_LIBRARIES}) AND NOT {AUTH_CASE_WAITS}"
            " AND i.observation_due_at > now() + make_interval(secs => %s)",
            (LONGEST_DELAY_SECONDS + 1,),
        )
    ]
    out += [
        f"stats job {r['id']}: {r['status']} for user {r['user_id']}"
        for r in fetch_all(
            conn,
            "SELECT id, status, user_id FROM user_exercise_stats_refresh_jobs"
            " WHERE status IN ('pending', 'processing', 'failed')"
            " AND NOT EXISTS (SELECT 1 FROM user_stats_refresh_state s"
            "   WHERE s.user_id = user_exercise_stats_refresh_jobs.user_id"
            "   AND s.applied_version >= user_exercise_stats_refresh_jobs.requested_version)",
        )
    ]
    out += [
        f"stats run {r['id']}: still {r['phase']}"
        for r in fetch_all(
            conn,
            "SELECT id, phase FROM user_stats_projection_runs"
            " WHERE phase IN ('claimed', 'computed') AND lease_until > now()",
        )
    ]
    return out


# Stats worker processes of the harness holding a live claim (the run's lease names the
# process that claimed it), those caught inside a transaction first.
CLAIM_HOLDERS = (
    "SELECT substring(a.application_name FROM '[.]([0-9]+)$')::integer AS worker_pid,"
    " a.xact_start IS NOT NULL AS in_transaction"
    " FROM pg_stat_activity a JOIN user_stats_projection_runs r"
    "   ON r.lock_owner = 'chaos-' || substring(a.application_name FROM '[.]([0-9]+)$')"
    " WHERE a.datname = current_database()"
    " AND a.application_name ~ '^chaos[.](stats|drainer)[.][0-9]+$'"
    " AND r.phase IN ('claimed', 'computed') AND r.lease_until > now()"
    " ORDER BY a.xact_start IS NULL, a.xact_start LIMIT 1"
)


def stats_users(conn: Connection) -> list[Any]:
    """Every user the stats know of, those whose sessions were all deleted included."""
    return [
        r["user_id"]
        for r in fetch_all(
            conn,
            "SELECT user_id FROM user_stats_refresh_state UNION SELECT user_id"
            " FROM training_sessions ORDER BY user_id",
        )
    ]


# Ranges owed, judged from the queue and the runs alone: jobs that ended failed whose
# range (dates and exercises; no exercises: period stats only) no run of their user
# published that began after their own last run (after they failed, when they never
# ran), whatever the product records as owed.
OWED = (
    "SELECT f.id AS job_id, f.user_id, f.from_date, f.requested_version,"
    " CASE WHEN f.exercise_ids IS NULL THEN 'none'"
    "   WHEN cardinality(f.exercise_ids) = 0 THEN 'all'"
    "   ELSE array_to_string(f.exercise_ids[1:3], ',')"
    "     || CASE WHEN cardinality(f.exercise_ids) > 3 THEN ',...' ELSE '' END END"
    "   AS exercises"
    " FROM user_exercise_stats_refresh_jobs f"
    " LEFT JOIN LATERAL (SELECT max(x.id) AS last_run FROM user_stats_projection_runs x"
    "   WHERE x.job_id = f.id) own ON true"
    " WHERE f.status = 'failed' AND NOT EXISTS ("
    "   SELECT 1 FROM user_stats_projection_runs r"
    "   WHERE r.user_id = f.user_id AND r.phase = 'published'"
    "   AND (r.id > own.last_run"
    "        OR (own.last_run IS NULL AND r.created_at > f.completed_at))"
    "   AND (r.from_date IS NULL OR r.from_date <= f.from_date)"
    "   AND (f.exercise_ids IS NULL OR cardinality(r.exercise_ids) = 0"
    "        OR (cardinality(f.exercise_ids) > 0 AND f.exercise_ids <@ r.exercise_ids)))"
)


def owed_ranges(conn: Connection) -> list[str]:
    """No range owed once the run settles (`OWED`)."""
    return [
        f"user {r['user_id']}: range of failed job {r['job_id']} (from"
        f" {r['from_date'] or 'the start'}, exercises {r['exercises']},"
        f" generation {r['requested_version']}) never published after it failed"
        for r in fetch_all(conn, f"{OWED} ORDER BY f.id")
    ]


def current_while_owed(conn: Connection) -> list[str]:
    """A user's stats never read as current while a range is owed (`OWED`): sampled
    through the run, one consistent snapshot each time."""
    return [
        f"user {r['user_id']}: stats read as current while the range of failed job"
        f" {r['job_id']} was owed"
        for r in fetch_all(
            conn, f"SELECT * FROM ({OWED}) o WHERE NOT stats_user_is_stale(o.user_id)"
        )
    ]


def nothing_owed(conn: Connection) -> list[str]:
    """What the product itself records, once settled: no owed range, no user it calls
    stale, and its status function saying so."""
    out = [
        f"user {r['user_id']}: owes a range (from {r['from_date'] or 'the start'},"
        f" failed jobs {r['failed_job_ids']}) after settling"
        for r in fetch_all(
            conn,
            "SELECT user_id, from_date, failed_job_ids FROM user_stats_owed_ranges"
            " ORDER BY user_id",
        )
    ]
    out += [
        f"user {r['user_id']}: stats stale after settling"
        for r in fetch_all(
            conn,
            "SELECT user_id FROM user_stats_refresh_state WHERE stats_user_is_stale(user_id)"
            " ORDER BY user_id",
        )
    ]
    status = service.worker_status(conn)
    out += [
        f"status function: {key} = {status.get(key)} after settling"
        for key in ("owed_users", "stale_users")
        if status.get(key)
    ]
    return out


def stats_generations(conn: Connection) -> list[str]:
    """Generations never go back, from the audit trail and at rest:
    - every publication made its target the applied generation, and a user's
      publications are strictly newer one after the other;
    - in every generation-labelled table (exercise and period projections, PR overview
      headers, rollover state) no write labels a user's rows older than one before it;
    - at rest, no projection row and no rollover state newer than the applied
      generation, and PR overview headers of the applied generation only."""
    out = [
        f"stats run {r['run_id']}: user {r['user_id']} published generation"
        f" {r['target_version']} (base {r['base_version']}) {r['why']}"
        f" (process {r['worker_pid']}, backend {r['backend_pid']})"
        for r in fetch_all(
            conn,
            "SELECT run_id, user_id, target_version, base_version, worker_pid, backend_pid,"
            " CASE WHEN applied_version IS DISTINCT FROM target_version"
            "   THEN 'under applied ' || coalesce(applied_version::text, 'none')"
            "   ELSE 'after generation ' || before END AS why"
            " FROM (SELECT *, max(target_version) OVER (PARTITION BY user_id ORDER BY seq"
            "   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before"
            "   FROM chaos_stats_publications) p"
            " WHERE applied_version IS DISTINCT FROM target_version OR target_version <= before"
            " ORDER BY seq",
        )
    ]
    out += [
        f"{r['what']}: user {r['user_id']} labelled generation {r['min_generation']}"
        f" after generation {r['before']}"
        for r in fetch_all(
            conn,
            "SELECT what, user_id, min_generation, before FROM ("
            "   SELECT what, user_id, min_generation, seq,"
            "     max(max_generation) OVER (PARTITION BY what, user_id ORDER BY seq"
            "       ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before"
            "   FROM chaos_generation_writes) w"
            " WHERE min_generation < before ORDER BY seq",
        )
    ]
    out += [
        f"{r['what']}: user {r['user_id']} holds generation {r['generation']}"
        f" under applied {r['applied_version']}"
        for r in fetch_all(
            conn,
            "SELECT 'user_exercise_stats' AS what, e.user_id, max(e.generation) AS generation,"
            "   s.applied_version"
            " FROM user_exercise_stats e JOIN user_stats_refresh_state s USING (user_id)"
            " GROUP BY e.user_id, s.applied_version HAVING max(e.generation) > s.applied_version"
            " UNION ALL"
            " SELECT 'user_training_period_stats', p.user_id, max(p.generation),"
            "   s.applied_version"
            " FROM user_training_period_stats p JOIN user_stats_refresh_state s USING (user_id)"
            " GROUP BY p.user_id, s.applied_version HAVING max(p.generation) > s.applied_version"
            " UNION ALL"
            " SELECT 'user_pr_overview_snapshot_headers', h.user_id, h.generation,"
            "   s.applied_version"
            " FROM user_pr_overview_snapshot_headers h"
            " JOIN user_stats_refresh_state s USING (user_id)"
            " WHERE h.generation <> s.applied_version"
            " UNION ALL"
            " SELECT 'user_pr_overview_rollover_state', r.user_id, r.snapshot_generation,"
            "   s.applied_version"
            " FROM user_pr_overview_rollover_state r"
            " JOIN user_stats_refresh_state s USING (user_id)"
            " WHERE r.snapshot_generation > s.applied_version"
            " ORDER BY 1, 2",
        )
    ]
    return out


def stats_versions(conn: Connection) -> list[str]:
    return [
        f"user {r['user_id']}: applied {r['applied_version']} != requested {r['requested_version']}"
        for r in fetch_all(
            conn,
            "SELECT user_id, applied_version, requested_version FROM user_stats_refresh_state"
            " WHERE applied_version <> requested_version ORDER BY user_id",
        )
    ]


PROJECTION_SNAPSHOT = {
    "exercise stats": "SELECT user_id, exercise_id, sessions, working_sets, reps, volume,"
    " heaviest_kg, best_e1rm_kg, first_date, last_date FROM user_exercise_stats"
    " ORDER BY user_id, exercise_id",
    "period stats": "SELECT user_id, period, period_start, sessions, working_sets, reps, volume"
    " FROM user_training_period_stats ORDER BY user_id, period, period_start",
    "PR overview": "SELECT s.user_id, p.exercise_id, p.best_e1rm_all_time, p.best_e1rm_30d,"
    " p.best_e1rm_30d_prior_year, p.heaviest_kg"
    " FROM user_stats_refresh_state s, get_pr_overview(s.user_id, stats_clock_date()) p"
    " ORDER BY s.user_id, p.exercise_id",
}


def projections(conn: Connection) -> dict[str, list[dict[str, Any]]]:
    """The public stats projections and today's PR overview through the fail-closed
    reader (which raises if the applied generation has no snapshot for today)."""
    return {name: fetch_all(conn, sql) for name, sql in PROJECTION_SNAPSHOT.items()}


def projections_equal(
    incremental: dict[str, list[dict[str, Any]]], rebuilt: dict[str, list[dict[str, Any]]]
) -> list[str]:
    out = []
    for name in PROJECTION_SNAPSHOT:
        before, after = incremental[name], rebuilt[name]
        if before != after:
            changed = sum(1 for row in before if row not in after) + sum(
                1 for row in after if row not in before
            )
            out.append(f"{name}: {changed} rows differ from a full recomputation")
    return out
