"""One worker process of the harness: `python -m chaos.worker ROLE DB_URL PROVIDER_URL`.

Each role loops over the product's own service calls with the harness's short clocks
until it is killed. Errors are written to stderr as one line each and the loop goes on
with a fresh connection, as a supervised production worker would after a crash.
"""

from __future__ import annotations

import os
import random
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any
from uuid import UUID

from chaos.config import (
    DRAINER_IDLE_SECONDS,
    DRAINER_LIFETIME_SECONDS,
    DRAINER_RECHECK_SECONDS,
    LEASE_SECONDS,
    OBSERVER_MEMORY_GROWTH_MIB,
    PROFILE_POLICY,
    RETRY_POLICY,
    REVALIDATIONS_PER_HOUR,
    WAKEUP_BACKOFF_SECONDS,
    WAKEUP_RELEASE_LIMIT,
    WAKEUP_SPACING_SECONDS,
)
from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.credentials.models import ProbeNotSent
from inventory_pipeline.db import Connection, DatabaseUnavailable, connect, execute
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.generator import generate_profile
from inventory_pipeline.provider.models import Failure, FetchResult, FindAnswer
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.revalidation import service as revalidation
from inventory_pipeline.stats import maintenance
from inventory_pipeline.stats import service as stats_service
from inventory_pipeline.stats.models import DrainSummary

IDLE_SECONDS = 0.2
# The longest a worker waits between restarts of a loop that keeps failing at once.
MAX_RESTART_PAUSE_SECONDS = 3.2
PLANNER_TICK_SECONDS = 1.0
Step = Callable[[Connection], bool]  # True when the step found work


def swallowed(role: str, item_id: int, error: str) -> None:
    """An exception the product recorded as an invalid_response (its handling of an
    answer raised): a defect, never an outcome of the chaos, so this line fails the run."""
    print(
        f"{role}: UnhandledException: item {item_id}: invalid_response recorded from {error}",
        file=sys.stderr,
        flush=True,
    )


def declare(conn: Connection, token: UUID) -> None:
    """Tell the audit trail which claim this session completes next: the product's
    statements bind the token in their guards but write it nowhere."""
    execute(conn, "SELECT set_config('chaos.completing_token', %s, false)", (str(token),))


def planner(conn: Connection) -> bool:
    """One tick a second, like a sensor (every 5 s in production): an expired claim stays
    `running` until a tick recovers it, the window a late completion must not use."""
    profiles.plan(conn, PROFILE_POLICY)
    time.sleep(PLANNER_TICK_SECONDS)
    return True


def stall() -> None:
    """Outlive the lease: mostly only just (the lease has run out, no planner tick has
    recovered the claim yet), sometimes long enough for another worker to claim it."""
    time.sleep(random.uniform(LEASE_SECONDS + 0.05, LEASE_SECONDS + 1.5))


def slow_generate(columns: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
    """The product's generator, now and then slower than the lease: the completion that
    follows must find its claim lost and change nothing."""
    if random.random() < 0.15:
        stall()
    return generate_profile(columns, rows)


def refresher(conn: Connection) -> bool:
    """One claim of a refresh run through the run's own call, `profiles.refresh`, with
    the slow generator and each claim's token declared for the audit before its work.
    Planning stays with the planner role's tick (`replan=False`): an expired claim stays
    `running` until that tick recovers it, the window a late completion must not use."""
    run = profiles.refresh(
        conn,
        PROFILE_POLICY,
        max_claims=1,
        generate=slow_generate,
        replan=False,
        on_claim=lambda claim: declare(conn, claim.lease_token),
    )
    return bool(run.completions)


class StallingClient(TmdbClient):
    """The product's client, now and then stalling past the lease after the answer: the
    item is due again at once and another observer may take it, so the completion that
    follows must find its claim lost and change nothing."""

    def fetch(self, *args: Any, **kwargs: Any) -> FetchResult:
        result = super().fetch(*args, **kwargs)
        if random.random() < 0.05:
            stall()
        return result

    def find(self, *args: Any, **kwargs: Any) -> FindAnswer | Failure:
        result = super().find(*args, **kwargs)
        if random.random() < 0.05:
            stall()
        return result


def peak_mib() -> int:
    """The most memory this process has held (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def observer(provider_url: str) -> Step:
    """What an observation run does, one batch per step through the same service calls
    (take nothing while the provider's throttling pauses admission; one attempt per
    claim), with each claim's token declared for the audit, each interrupted claim
    reported to it, and the process's peak memory checked after every answer."""
    client = StallingClient(provider_url, timeout_seconds=1.0, max_body_bytes=64 * 1024)
    bound = peak_mib() + OBSERVER_MEMORY_GROWTH_MIB

    def step(conn: Connection) -> bool:
        nonlocal bound
        if recovery.admission_paused_seconds(conn) > 0:
            return False
        claims = recovery.claim(conn, 4, LEASE_SECONDS)
        settings = recovery.provider_settings(conn)
        for claim in claims:
            declare(conn, claim.lease_token)
            result = recovery.observe_claim(conn, claim, client, settings, RETRY_POLICY)
            if result.outcome == "failed" and result.error is not None:
                swallowed("observer", result.item_id, result.error)
            if result.outcome == "interrupted":
                execute(
                    conn,
                    "INSERT INTO chaos_interruptions (item_id, lease_token, replacement)"
                    " VALUES (%s, %s, %s)",
                    (claim.item_id, claim.lease_token, claim.replacement is not None),
                )
            if peak_mib() > bound:
                print(
                    f"observer: MemoryBound: item {claim.item_id}: peak {peak_mib()} MiB,"
                    f" over its bound of {bound} MiB",
                    file=sys.stderr,
                    flush=True,
                )
                bound = peak_mib()  # one line per excess
        return bool(claims)

    return step


def revalidator(provider_url: str) -> Step:
    """What a revalidation run does, a claim of two cases per step through the same
    service calls (the sweep first; nothing while admission is paused), with each
    claim's token declared; the client now and then stalls past the lease, so a
    completion must find its claim lost."""
    client = StallingClient(provider_url, timeout_seconds=1.0, max_body_bytes=64 * 1024)

    def step(conn: Connection) -> bool:
        if recovery.admission_paused_seconds(conn) > 0:
            return False
        revalidation.sweep(conn)
        claims, walked = revalidation.claim(conn, 2, REVALIDATIONS_PER_HOUR, LEASE_SECONDS)
        settings = recovery.provider_settings(conn)
        for claim in claims:
            declare(conn, claim.lease_token)
            result = revalidation.revalidate_claim(conn, claim, client, settings, RETRY_POLICY)
            if result.outcome == "fault" and result.error is not None:
                swallowed("revalidator", result.item_id, result.error)
        return walked > 0

    return step


def prober(provider_url: str) -> Step:
    """The credential wakeup job's two steps with the harness's clocks: verify the
    current generation (claim, probe, complete, declaring the probe lease's token), then
    one release batch."""
    client = credentials.probe_client(provider_url)

    def step(conn: Connection) -> bool:
        claim = None
        if recovery.admission_paused_seconds(conn) <= 0:  # as verify(): wait out a pause
            claim = credentials.claim_probe(conn, lease_seconds=LEASE_SECONDS)
        if claim is not None:
            probed = credentials.probe(conn, claim, client)
            if random.random() < 0.05:
                stall()  # the probe lease runs out: the completion must not verify
            declare(conn, claim.lease_token)
            if isinstance(probed, ProbeNotSent):
                credentials.give_back_probe(conn, claim)
            else:
                outcome, retry_after = probed
                credentials.complete_probe(
                    conn, claim, outcome, retry_after, backoff=WAKEUP_BACKOFF_SECONDS
                )
        released = credentials.release(
            conn, limit=WAKEUP_RELEASE_LIMIT, spacing_seconds=WAKEUP_SPACING_SECONDS
        )
        return claim is not None or bool(released and released.released)

    return step


def stats(conn: Connection) -> bool:
    """One claim through the drain's own path, or stepped by hand with a stall past the
    lease before computing or before publishing (the later stage must find the lease
    lost or renew it under the fence, never publish for a lost claim)."""
    claim = stats_service.claim(conn, f"chaos-{os.getpid()}")
    if claim is None:
        return False
    declare(conn, claim.lease_token)
    if random.random() < 0.5:
        stats_service.process(conn, claim)
        return True
    if random.random() < 0.08:
        stall()
    result = stats_service.compute(conn, claim)
    while result.status == "batch_pending":
        result = stats_service.compute(conn, claim)
    if result.status == "computed":
        if random.random() < 0.08:
            stall()
        stats_service.publish(conn, claim)
    return True


def drainer(conn: Connection) -> bool:
    """The drain op's own path: a drain kept alive (passes of a few rounds of claim,
    compute in committed batches and publish, then a wait on LISTEN for the database's
    notification of new work), with short idle and lifetime limits; two of these run at
    once beside the stepping workers. It declares nothing to the harness: its
    publications are judged by the token its publish stage declared for the fence."""
    done: list[DrainSummary] = []
    stats_service.keep_draining(
        conn,
        f"chaos-{os.getpid()}",
        idle_seconds=DRAINER_IDLE_SECONDS,
        lifetime_seconds=DRAINER_LIFETIME_SECONDS,
        report=done.append,
        max_rounds=5,
        recheck_seconds=DRAINER_RECHECK_SECONDS,
    )
    return any(summary.rounds for summary in done)


def maintainer(conn: Connection) -> bool:
    rolled = maintenance.rollover(conn).requested
    return bool(rolled + maintenance.process_catalog(conn))


def role_step(role: str, provider_url: str) -> Step:
    steps: dict[str, Step] = {
        "planner": planner,
        "refresher": refresher,
        "stats": stats,
        "drainer": drainer,
        "maintainer": maintainer,
    }
    if role == "observer":
        return observer(provider_url)
    if role == "prober":
        return prober(provider_url)
    if role == "revalidator":
        return revalidator(provider_url)
    return steps[role]


ROLES = (
    "planner",
    "refresher",
    "observer",
    "prober",
    "revalidator",
    "stats",
    "drainer",
    "maintainer",
)


def error_line(role: str, exc: BaseException) -> str:
    """`role: Type [SQLSTATE]: first line of the message` (no brackets without a code):
    the harness judges by type and SQLSTATE, people read the message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    sqlstate = getattr(exc, "sqlstate", None)
    code = f" [{sqlstate}]" if sqlstate else ""
    return f"{role}: {type(exc).__name__}{code}: {first}"


def application_name(role: str, pid: int) -> str:
    """The session name the audit records as the actor and the harness terminates by:
    the role and the worker's process id."""
    return f"chaos.{role}.{pid}"


def restart_pause(unreachable: int) -> float:
    """How long a worker waits before restarting its loop after `unreachable` failures
    in a row to reach the server: doubling from IDLE_SECONDS up to
    MAX_RESTART_PAUSE_SECONDS, as a supervisor backs off, so a server that is down for a
    while (a restart under load) costs each worker a few error lines. Any other error
    restarts after IDLE_SECONDS, so a loop failing on a live server still shows at its
    full rate against the harness's error bound."""
    return min(IDLE_SECONDS * 2.0 ** max(unreachable - 1, 0), MAX_RESTART_PAUSE_SECONDS)


def main(argv: list[str]) -> int:
    role, db_url, provider_url = argv
    step = role_step(role, provider_url)
    unreachable = 0
    while True:
        try:
            with connect(db_url, application_name=application_name(role, os.getpid())) as conn:
                while True:
                    stepped = step(conn)
                    unreachable = 0
                    if not stepped:
                        time.sleep(IDLE_SECONDS)
        except Exception as exc:  # a crashed loop restarts, as under a supervisor
            print(error_line(role, exc), file=sys.stderr, flush=True)
            unreachable = unreachable + 1 if isinstance(exc, DatabaseUnavailable) else 0
            time.sleep(restart_pause(unreachable))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
