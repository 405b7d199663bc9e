"""Revalidation's cost per case (docs/identity-revalidation.md), through the loopback
TMDb stand-in: a few hundred eligible cases (each a merged record: a lookup and the
candidate's details, then a proposal) beside ten thousand records set aside, as a
library's history leaves them.

Per size, in one run: the claim transaction (budget, walk, spend) per claimed case, the
whole check per case (claim, two requests, completion) and the client's CPU per case;
the claim statement's EXPLAIN (ANALYZE, BUFFERS), rolled back, before the run and after
every case was checked (some records queued again): the due-index rows it read per
claimed case (the walk stops at the batch: 1.00 whatever waits) and its buffers, which
stay flat as checks accumulate. Times on the shared machine are noisy; rows and buffers
are not. The admission limiter runs at 1,000 requests/s so that the figure is the
cost, not the rate.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass

from bench.common import Figure, Mode, over_runs, scratch_database
from inventory_pipeline.db import Connection, connect, execute, fetch_all
from inventory_pipeline.db.connection import execute_script
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.models import ProviderSettings
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.revalidation import repository, service

KEY = "bench-key"
RATE = 1000.0
WAITING = 10_000  # records set aside (checked, no proposal) of other cases
SURVIVOR = 1_000_000  # merged record X folds into X + SURVIVOR
LIBRARY = """
INSERT INTO media_servers (id, name, kind) VALUES (1, 'bench', 'plex');
INSERT INTO libraries (id, server_id, name, media_kind) VALUES (1, 1, 'movies', 'movie');
"""
# Items 1..cases are eligible cases (observed with an IMDb id, two 404s, queued now);
# the next WAITING items' cases concluded without a proposal (records set aside).
CASES = """
INSERT INTO media_server_items (id, library_id, title, year, provider, provider_kind,
    provider_id, observed_at, observation_due_at, recovery_case_id, recovery_provider,
    recovery_provider_kind, recovery_provider_id, recovery_category, recovery_attempts,
    recovery_first_failed_at, recovery_last_failed_at)
SELECT g, 1, 'Title ' || g, 2000, 'tmdb', 'movie', g::text, now() - interval '7 days',
       now() + interval '1 day', gen_random_uuid(), 'tmdb', 'movie', g::text, 'not_found', 2,
       now() - interval '2 days', now() - interval '1 day'
FROM generate_series(1, %(items)s) g;
INSERT INTO provider_observations (item_id, source_generation, provider_kind, tmdb_id, title,
    genres, companies, observed_at, imdb_id)
SELECT g, 1, 'movie', g, 'Title ' || g, '{}', '{}', now() - interval '7 days',
       'tt' || lpad(g::text, 7, '0')
FROM generate_series(1, %(items)s) g;
INSERT INTO identity_revalidations (case_id, item_id, source_generation, due_at, outcome,
    reason, checked_at, candidates, single_candidate)
SELECT i.recovery_case_id, i.id, 1,
       CASE WHEN i.id <= %(cases)s THEN now() END,
       CASE WHEN i.id > %(cases)s THEN 'no_proposal' END,
       CASE WHEN i.id > %(cases)s THEN 'no_candidate' END,
       CASE WHEN i.id > %(cases)s THEN now() END,
       CASE WHEN i.id > %(cases)s THEN 0 END,
       CASE WHEN i.id > %(cases)s THEN false END
FROM media_server_items i;
"""
_INDEX_ROWS = re.compile(
    r"Index Scan using identity_revalidations_due on identity_revalidations .*?"
    r"\(actual time=[0-9.]+\.\.[0-9.]+ rows=([0-9.]+) loops=1\)"
)


def due_index_rows(plan: str) -> float | None:
    match = _INDEX_ROWS.search(plan)
    return None if match is None else float(match.group(1))


_BUFFERS = re.compile(r"Buffers: shared hit=([0-9]+)")
# After the run: records of cases set aside without a proposal come due again, as their
# next failures would queue them, so that the claim is explained once more.
REARM = """
UPDATE identity_revalidations SET due_at = now()
WHERE case_id IN (SELECT case_id FROM identity_revalidations WHERE outcome = 'no_proposal'
                  ORDER BY item_id LIMIT %(n)s)
"""


@dataclass(frozen=True)
class SizeResult:
    claim_ms: list[float]  # per claim batch: milliseconds per claimed case
    check_ms: list[float]  # per case: the whole check
    cpu_ms: float  # the client's CPU per case
    plan: str  # the claim statement's EXPLAIN (ANALYZE, BUFFERS), before the run
    plan_after: str  # and after every case was checked


def buffers(plan: str) -> int | None:
    """The statement's shared buffers hit (the plan's first Buffers line is its total)."""
    match = _BUFFERS.search(plan)
    return None if match is None else int(match.group(1))


def explain(conn: Connection) -> str:
    with conn.transaction(force_rollback=True):
        return "\n".join(
            r["QUERY PLAN"]
            for r in fetch_all(
                conn,
                "EXPLAIN (ANALYZE, BUFFERS) " + repository.QUERIES["claim_revalidations"],
                {"limit": service.CLAIM_BATCH, "lease_seconds": 300},
            )
        )


def measure(admin_url: str, cases: int) -> SizeResult:
    """One size: per claim batch its milliseconds per claimed case, per case its whole
    check's milliseconds, the client's CPU per case, and the claim's plan."""
    with (
        scratch_database(admin_url) as url,
        connect(url) as conn,
        StandIn(api_key=KEY) as standin,
        TmdbClient(standin.url) as client,
    ):
        execute_script(conn, LIBRARY)
        for statement in CASES.split(";\n"):
            if statement.strip():
                execute(conn, statement, {"items": cases + WAITING, "cases": cases})
        execute(conn, "VACUUM ANALYZE")
        recovery.save_provider_settings(conn, ProviderSettings(KEY, True, None))
        admission.set_rate(conn, RATE)
        for n in range(1, cases + 1):
            standin.merge("movie", n, SURVIVOR + n, title=f"Title {n}", year=2000)
        plan = explain(conn)
        settings = recovery.provider_settings(conn)
        policy = RetryPolicy()
        claim_ms: list[float] = []
        check_ms: list[float] = []
        proposed = 0
        cpu = time.process_time()
        while True:
            start = time.perf_counter()
            batch, walked = service.claim(conn, service.CLAIM_BATCH, per_hour=3600)
            claimed = time.perf_counter()
            if not walked:
                break
            claim_ms.append((claimed - start) * 1000 / max(1, len(batch)))
            for claim in batch:
                begun = time.perf_counter()
                result = service.revalidate_claim(conn, claim, client, settings, policy)
                check_ms.append((time.perf_counter() - begun) * 1000)
                proposed += result.outcome == "proposed"
        cpu = time.process_time() - cpu
        if proposed != cases:
            raise RuntimeError(f"proposed {proposed} of {cases} cases")
        execute(conn, REARM, {"n": service.CLAIM_BATCH})
        return SizeResult(claim_ms, check_ms, cpu * 1000 / cases, plan, explain(conn))


def run(admin_url: str, mode: Mode) -> list[Figure]:
    sizes = mode.pick(smoke=(20, 60), default=(100, 300, 900))
    results = {n: measure(admin_url, n) for n in sizes}
    figures: list[Figure] = []
    for n in sizes:
        r = results[n]
        print(
            f"-- claim_revalidations at {n} due cases, {WAITING:,} set aside:"
            " EXPLAIN (ANALYZE, BUFFERS)",
            flush=True,
        )
        print(r.plan, flush=True)
        print(f"-- the same after {n} checks:", flush=True)
        print(r.plan_after, flush=True)
        read = due_index_rows(r.plan)
        before, after = buffers(r.plan), buffers(r.plan_after)
        figures += [
            over_runs(
                f"revalidation claim per claimed case ({n} due, {WAITING:,} set aside)",
                r.claim_ms,
                " ms",
                f"budget, walk and spend in one transaction; batches of {service.CLAIM_BATCH}",
            ),
            over_runs(
                f"revalidation per case, claim to proposal ({n} due)",
                r.check_ms,
                " ms",
                "a lookup and the candidate's details over loopback HTTP, the completion",
            ),
            Figure(
                f"revalidation client CPU per case ({n} due)",
                r.cpu_ms,
                " ms",
                "process CPU of the whole run divided by the cases",
            ),
            Figure(
                f"revalidation claim: buffers per claim after {n} checks vs before",
                -1.0 if not before or after is None else after / before,
                "x",
                f"goal <= 1.5: flat as checks accumulate ({before} buffers before, {after}"
                " after, EXPLAIN ANALYZE of a batch)",
                None if mode.smoke or not before or after is None else after / before <= 1.5,
            ),
            Figure(
                f"revalidation claim: due-index rows read per claimed case ({n} due)",
                -1.0 if read is None else read / service.CLAIM_BATCH,
                "",
                "goal 1.00: the due index walked in order, stopping at the batch",
                None if mode.smoke else read == service.CLAIM_BATCH,
            ),
        ]
    smallest, largest = sizes[0], sizes[-1]
    figures.append(
        Figure(
            f"revalidation claim per case, {largest} vs {smallest} due cases",
            statistics.median(results[largest].claim_ms)
            / statistics.median(results[smallest].claim_ms),
            "x",
            "medians of one run: wall time on the shared machine, not judged; the rows and"
            " buffers above are the flat measure",
        )
    )
    return figures
