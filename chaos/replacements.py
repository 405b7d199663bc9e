"""Merges at TMDb and the operator's gate, under chaos (docs/identity-revalidation.md):
the workload folds observed records into others at the stand-in (some in ways that must
not be proposed), an operator reviews proposals, and after quiescence the checks hold
the product to an independent restatement of the corroboration rules over the harness's
own record of what it merged. Chaos titles differ from one another in more than case,
accents or punctuation, so exact equality restates the normalized comparison."""

from __future__ import annotations

import random
from collections import Counter

from chaos.config import MERGE_VARIANTS
from inventory_pipeline.db import Connection, execute, fetch_all, fetch_one
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.revalidation import service as revalidation
from inventory_pipeline.revalidation.models import ProposalRefused

OPERATOR = "chaos operator"
# The stand-in's demo catalog leaves ids divisible by this unknown (chaos/run.py).
MISSING_EVERY = 17
# Survivors and the extra record of an ambiguous lookup, far from the items' own ids:
# record X merges into BASE + 2X (+1 when the stand-in does not know that id), so no two
# records ever share a survivor (which carries one merged record's external ids).
SURVIVOR_BASE = 100_000
EXTRA_BASE = 600_000


# Items observed under their own id with external ids, in a library of their kind (the
# workload also syncs items into libraries of the other kind, which revalidation leaves
# alone): what a merge folds away.
OBSERVED = """
SELECT i.id, i.provider_kind AS kind, o.tmdb_id, i.title, i.year
FROM media_server_items i
JOIN libraries l ON l.id = i.library_id AND l.media_kind = i.provider_kind
JOIN provider_observations o ON o.item_id = i.id AND o.source_generation = i.source_generation
    AND o.tmdb_id = tmdb_id_of(i.provider_id)
WHERE i.provider = 'tmdb' AND (o.imdb_id IS NOT NULL OR o.tvdb_id IS NOT NULL)
"""


def _record_of(base: int, merged: int) -> int:
    """The id a merge of record `merged` uses above `base`: one of its own, that the
    stand-in knows (never divisible by MISSING_EVERY). Even ids of distinct records are
    distinct, and the odd step taken when one is unknown meets no other even id."""
    tmdb_id = base + 2 * merged
    return tmdb_id if tmdb_id % MISSING_EVERY else tmdb_id + 1


def merge(
    conn: Connection,
    standin: StandIn,
    rng: random.Random,
    done: set[tuple[str, int]],
    variant: str | None = None,
) -> str:
    """TMDb folds one observed record (kind, X) into a survivor, in the given variant (or
    a drawn one), and the items observed under X come due now (the harness's clock: their
    monthly recheck). Returns the variant ('' when nothing observed is left to merge)."""
    rows = fetch_all(conn, f"SELECT DISTINCT kind, tmdb_id FROM ({OBSERVED}) x ORDER BY 1, 2")
    candidates = [
        (r["kind"], int(r["tmdb_id"])) for r in rows if (r["kind"], r["tmdb_id"]) not in done
    ]
    if not candidates:
        return ""
    kind, merged = rng.choice(candidates)
    done.add((kind, merged))
    item = fetch_one(
        conn,
        f"SELECT title, year FROM ({OBSERVED}) x WHERE kind = %s AND tmdb_id = %s"
        " ORDER BY id LIMIT 1",
        (kind, merged),
    )
    if item is None:
        return ""
    if variant is None:
        variants = [v for v, _ in MERGE_VARIANTS]
        variant = rng.choices(variants, weights=[w for _, w in MERGE_VARIANTS])[0]
    into = _record_of(SURVIVOR_BASE, merged)
    title = item["title"] if variant != "title" else f"{item['title']} (director's cut)"
    year = item["year"] if variant != "year" or item["year"] is None else item["year"] + 3
    also = ((kind, _record_of(EXTRA_BASE, merged)),) if variant == "ambiguous" else ()
    standin.merge(
        kind, merged, into, title=title, year=year, round_trip=variant != "round_trip", also=also
    )
    execute(
        conn,
        "INSERT INTO chaos_merges (provider_kind, merged_id, into_id, title, year, variant,"
        " corroborated) VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (kind, merged, into, title, year, variant, variant == "corroborated"),
    )
    execute(
        conn,
        "UPDATE media_server_items SET observation_due_at = now() WHERE provider = 'tmdb'"
        " AND provider_kind = %s AND provider_id = %s",
        (kind, str(merged)),
    )
    return variant


def review(conn: Connection, rng: random.Random, approve_share: float = 0.75) -> Counter[str]:
    """An operator's pass over the proposals awaiting a decision: most approved, some
    rejected, one decision each; a proposal superseded meanwhile is refused."""
    decided: Counter[str] = Counter()
    for proposal in revalidation.proposals(conn, ("proposed",), limit=50):
        approve = rng.random() < approve_share
        try:
            revalidation.decide(
                conn,
                approve=[proposal.id] if approve else [],
                reject=[] if approve else [proposal.id],
                decided_by=OPERATOR,
            )
            decided["approved" if approve else "rejected"] += 1
        except ProposalRefused:
            decided["refused"] += 1
    return decided


# Items a corroborated merge folded away, as they stand now: an item of the merge's kind
# and id, the survivor's exact title and a year within one of it, in an active library of
# its kind on an active server, with the external ids of an observation of its current
# source (the evidence: observed before the merge, as nothing answers X after it).
CORROBORATED = """
SELECT DISTINCT ON (i.id) i.id AS item_id, i.source_generation, g.into_id
FROM chaos_merges g
JOIN media_server_items i ON i.provider = 'tmdb' AND i.provider_kind = g.provider_kind
    AND tmdb_id_of(i.provider_id) = g.merged_id AND i.title = g.title
    AND abs(i.year - g.year) <= 1
JOIN libraries l ON l.id = i.library_id AND l.active AND l.media_kind = i.provider_kind
JOIN media_servers m ON m.id = l.server_id AND m.active
JOIN provider_observations o ON o.item_id = i.id AND o.source_generation = i.source_generation
    AND (o.imdb_id IS NOT NULL OR o.tvdb_id IS NOT NULL)
WHERE g.corroborated
ORDER BY i.id, g.seq
"""

# Approved proposals of an item's current source, in an active movie/TV library of an
# active server (where observation reaches it).
APPROVED = """
SELECT p.id, p.item_id, p.case_id, p.candidate_tmdb_id, p.replaced_at,
       i.recovery_case_id, i.recovery_resolved_at,
       (SELECT o.tmdb_id FROM provider_observations o
        WHERE o.item_id = p.item_id AND o.source_generation = p.source_generation) AS observed
FROM replacement_proposals p
JOIN media_server_items i ON i.id = p.item_id AND i.source_generation = p.source_generation
JOIN libraries l ON l.id = i.library_id AND l.active AND l.media_kind IN ('movie', 'tv')
JOIN media_servers m ON m.id = l.server_id AND m.active
WHERE p.state = 'approved'
ORDER BY p.id
"""


def _count(conn: Connection, sql: str) -> int:
    row = fetch_one(conn, f"SELECT count(*) AS n FROM ({sql}) AS x")
    return 0 if row is None else int(row["n"])


def outstanding(conn: Connection) -> dict[str, int]:
    """Replacement work in flight: first checks due or waiting out a fault, corroborated
    merges not yet proposed, proposals awaiting the operator, approvals not yet
    observed."""
    return {
        # A first check (or one after a fault) still to come. A case that concluded
        # without a proposal is checked again after each further failure, for good (its
        # not_found rechecks never end): that is not work to wait for.
        "revalidations due": _count(
            conn,
            "SELECT 1 FROM identity_revalidations r"
            " LEFT JOIN media_server_items i ON i.id = r.item_id"
            " LEFT JOIN libraries l ON l.id = i.library_id"
            " LEFT JOIN media_servers m ON m.id = l.server_id"
            " LEFT JOIN provider_observations o ON o.item_id = r.item_id"
            " WHERE (r.due_at IS NOT NULL OR r.lease_token IS NOT NULL) AND r.outcome IS NULL"
            " AND revalidation_verdict(r, i, l, m, o) = 'due'",
        ),
        "corroborated merges not proposed": _count(
            conn,
            f"SELECT 1 FROM ({CORROBORATED}) c WHERE NOT EXISTS ("
            " SELECT 1 FROM replacement_proposals p WHERE p.item_id = c.item_id"
            " AND p.source_generation = c.source_generation)",
        ),
        "proposals awaiting review": len(revalidation.proposals(conn, ("proposed",), 1000)),
        "approved replacements not observed": _count(
            conn, f"SELECT 1 FROM ({APPROVED}) a WHERE a.replaced_at IS NULL"
        ),
    }


def checks(conn: Connection) -> list[str]:
    """After quiescence: every corroborated merge proposed, naming its survivor; no
    proposal the merges do not corroborate; nothing observed under another id without an
    approval of that source naming it; every approval observed, its case resolved as
    replaced."""
    out = [
        f"item {r['item_id']}: corroborated merge into TMDb {r['into_id']} not proposed"
        f" ({r['why']})"
        for r in fetch_all(
            conn,
            "SELECT c.item_id, c.into_id, CASE WHEN p.id IS NULL THEN 'no proposal'"
            "   ELSE 'proposal ' || p.id || ' names ' || p.candidate_tmdb_id END"
            # Where the item stands, so the report says which step did not come.
            "   || '; item: case ' || coalesce(i.recovery_category, 'none')"
            "   || ' x' || i.recovery_attempts"
            "   || CASE WHEN i.recovery_resolved_at IS NOT NULL THEN ' resolved' ELSE '' END"
            "   || ', due in ' || round(extract(epoch FROM i.observation_due_at - now()))"
            "   || ' s, lease ' || CASE WHEN i.observation_lease_token IS NULL THEN 'none'"
            "     WHEN i.observation_lease_expires_at > now() THEN 'live' ELSE 'expired' END"
            "   || coalesce('; revalidation: ' || coalesce("
            "     'due in ' || round(extract(epoch FROM r.due_at - now())) || ' s', 'set aside')"
            "   || ', outcome ' || coalesce(r.outcome || '/' || coalesce(r.reason, '-'), 'none')"
            "   || ', faults ' || r.faults || coalesce(' (' || r.last_fault || ')', '')"
            "   || CASE WHEN r.lease_token IS NOT NULL THEN ', leased' ELSE '' END"
            "   || CASE WHEN r.source_generation <> i.source_generation"
            "     THEN ', of an older source' ELSE '' END, '; no revalidation of its case')"
            "   AS why"
            f" FROM ({CORROBORATED}) c JOIN media_server_items i ON i.id = c.item_id"
            " LEFT JOIN identity_revalidations r ON r.case_id = i.recovery_case_id"
            " LEFT JOIN replacement_proposals p"
            "  ON p.item_id = c.item_id AND p.source_generation = c.source_generation"
            " WHERE p.id IS NULL OR p.candidate_tmdb_id <> c.into_id ORDER BY c.item_id",
        )
    ]
    out += [
        f"proposal {r['id']}: item {r['item_id']} TMDb {r['old_tmdb_id']} ->"
        f' {r["candidate_tmdb_id"]} ("{r["source_title"]}" {r["source_year"]}) proposed'
        " without a corroborated merge"
        for r in fetch_all(
            conn,
            "SELECT p.* FROM replacement_proposals p WHERE NOT EXISTS ("
            " SELECT 1 FROM chaos_merges g WHERE g.corroborated"
            " AND g.provider_kind = p.provider_kind AND g.merged_id = p.old_tmdb_id"
            " AND g.into_id = p.candidate_tmdb_id AND g.title = p.source_title"
            " AND abs(g.year - p.source_year) <= 1) ORDER BY p.id",
        )
    ]
    out += [
        f"item {r['item_id']}: observed under TMDb {r['tmdb_id']} (its own id"
        f" {r['own_tmdb_id']}) without an approval naming it, by {r['actor']}"
        for r in fetch_all(
            conn,
            "SELECT * FROM chaos_observation_writes"
            " WHERE tmdb_id IS DISTINCT FROM own_tmdb_id AND NOT approved ORDER BY seq",
        )
    ]
    for r in fetch_all(conn, APPROVED):
        if r["replaced_at"] is None or r["observed"] != r["candidate_tmdb_id"]:
            out.append(
                f"proposal {r['id']}: approved, item {r['item_id']} not observed under"
                f" TMDb {r['candidate_tmdb_id']} (observed {r['observed']})"
            )
        elif r["recovery_case_id"] == r["case_id"] and r["recovery_resolved_at"] is None:
            out.append(f"proposal {r['id']}: replaced, but its case is still open")
    return out


def summary(conn: Connection) -> dict[str, object]:
    """For the report: merges by variant, proposals by stored state, replaced ones."""
    merges = {
        r["variant"]: int(r["n"])
        for r in fetch_all(conn, "SELECT variant, count(*) AS n FROM chaos_merges GROUP BY 1")
    }
    states = {
        r["state"]: int(r["n"])
        for r in fetch_all(
            conn, "SELECT state, count(*) AS n FROM replacement_proposals GROUP BY 1"
        )
    }
    row = fetch_one(
        conn,
        "SELECT count(*) FILTER (WHERE replaced_at IS NOT NULL) AS replaced,"
        " (SELECT count(*) FROM identity_revalidations WHERE outcome = 'no_proposal')"
        "   AS unproposed,"
        " (SELECT count(*) FROM chaos_observation_writes WHERE tmdb_id <> own_tmdb_id)"
        "   AS observed_under_replacement"
        " FROM replacement_proposals",
    )
    return {"merges": merges, "proposals": states, **(dict(row) if row else {})}
