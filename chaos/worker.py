"""One worker process of the harness: `python -m chaos.worker ROLE DB_URL PROVIDER_URL`.

Each role loops over the product's own service calls with the harness's short clocks
until it is killed. Errors are written to stderr as one line each and the loop goes on
with a fresh connection, as a supervised production worker would after a crash.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import pandas as pd

from chaos.config import LEASE_SECONDS, PROFILE_POLICY, RETRY_POLICY
from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.db import Connection, connect
from inventory_pipeline.profiles import service as profiles
from inventory_pipeline.profiles.generator import generate_profile
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.stats import maintenance, processors
from inventory_pipeline.stats import service as stats_service

IDLE_SECONDS = 0.2
Step = Callable[[Connection], bool]  # True when the step found work


def planner(conn: Connection) -> bool:
    return profiles.plan(conn, PROFILE_POLICY).planned > 0


def slow_generate(frame: pd.DataFrame) -> dict[str, Any]:
    """The product's generator, now and then slower than the lease: the completion that
    follows must find its claim lost and change nothing."""
    if random.random() < 0.08:
        time.sleep(LEASE_SECONDS + 0.5)
    return generate_profile(frame)


def refresher(conn: Connection) -> bool:
    batch = profiles.claim(conn, PROFILE_POLICY, limit=3)
    profiles.process_batch(conn, batch.lease_token, PROFILE_POLICY, slow_generate)
    return bool(batch.claims)


def observer(provider_url: str) -> Step:
    client = TmdbClient(provider_url, timeout_seconds=1.0, max_body_bytes=64 * 1024)

    def step(conn: Connection) -> bool:
        claims = recovery.claim(conn, 4, LEASE_SECONDS)
        for claim in claims:
            settings = recovery.provider_settings(conn)
            recovery.observe_claim(conn, claim, client, settings, RETRY_POLICY)
        return bool(claims)

    return step


def prober(provider_url: str) -> Step:
    client = credentials.probe_client(provider_url)

    def step(conn: Connection) -> bool:
        verified = credentials.verify(conn, client, lease_seconds=LEASE_SECONDS)
        released = credentials.release(conn)
        return verified is not None or bool(released and released.released)

    return step


def stats(conn: Connection) -> bool:
    """The drain loop, or one claim stepped by hand with a stall past the lease before
    computing or before publishing (the later stage must find the lease lost or renew
    it under the fence, never publish for a lost claim)."""
    owner = f"chaos-{os.getpid()}"
    if random.random() < 0.5:
        return processors.drain(conn, owner, max_rounds=5).rounds > 0
    claim = stats_service.claim(conn, owner)
    if claim is None:
        return False
    if random.random() < 0.08:
        time.sleep(LEASE_SECONDS + 0.5)
    result = stats_service.compute(conn, claim)
    while result.status == "batch_pending":
        result = stats_service.compute(conn, claim)
    if result.status == "computed":
        if random.random() < 0.08:
            time.sleep(LEASE_SECONDS + 0.5)
        stats_service.publish(conn, claim)
    return True


def maintainer(conn: Connection) -> bool:
    rolled = maintenance.rollover(conn).requested
    return bool(rolled + maintenance.process_catalog(conn))


def role_step(role: str, provider_url: str) -> Step:
    steps: dict[str, Step] = {
        "planner": planner,
        "refresher": refresher,
        "stats": stats,
        "maintainer": maintainer,
    }
    if role == "observer":
        return observer(provider_url)
    if role == "prober":
        return prober(provider_url)
    return steps[role]


ROLES = ("planner", "refresher", "observer", "prober", "stats", "maintainer")


def main(argv: list[str]) -> int:
    role, db_url, provider_url = argv
    step = role_step(role, provider_url)
    while True:
        try:
            with connect(db_url) as conn:
                while True:
                    if not step(conn):
                        time.sleep(IDLE_SECONDS)
        except Exception as exc:  # a crashed loop restarts, as under a supervisor
            print(f"{role}: {type(exc).__name__}: {str(exc).splitlines()[:1]}", file=sys.stderr)
            time.sleep(IDLE_SECONDS)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
