"""Revalidation test helpers: items observed, then merged away at TMDb (the stand-in)
until their not_found case is eligible, driven through the product's own calls."""

from __future__ import annotations

from typing import Any

from inventory_pipeline.db import Connection, execute, fetch_all, fetch_one
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.models import ObservationResult
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.revalidation import service
from inventory_pipeline.revalidation.models import RevalidationSummary

POLICY = RetryPolicy()
PER_HOUR = 60


def item(
    conn: Connection,
    library_id: int,
    tmdb_id: int,
    kind: str = "movie",
    title: str = "Heat",
    year: int | None = 1995,
) -> int:
    """An item with a typed TMDb identity, a source title and year."""
    row = fetch_one(
        conn,
        "INSERT INTO media_server_items (library_id, title, year, provider, provider_kind,"
        " provider_id) VALUES (%s, %s, %s, 'tmdb', %s, %s) RETURNING id",
        (library_id, title, year, kind, str(tmdb_id)),
    )
    assert row is not None
    return int(row["id"])


def make_due(conn: Connection, item_id: int | None = None) -> None:
    """The test clock: the item's (or every item's) next attempt is now."""
    execute(
        conn,
        "UPDATE media_server_items SET observation_due_at = now()"
        " WHERE %(id)s::bigint IS NULL OR id = %(id)s",
        {"id": item_id},
    )


def observe(conn: Connection, client: TmdbClient) -> list[ObservationResult]:
    """Every item due now, observed once through the product's claim and attempt."""
    results = []
    settings = recovery.provider_settings(conn)
    while claims := recovery.claim(conn, 10):
        results += [recovery.observe_claim(conn, c, client, settings, POLICY) for c in claims]
    return results


def fail_twice(conn: Connection, client: TmdbClient, item_id: int) -> None:
    """Two more observation attempts of the item, whatever TMDb answers."""
    for _ in range(2):
        make_due(conn, item_id)
        observe(conn, client)


def merged(
    conn: Connection,
    client: TmdbClient,
    standin: StandIn,
    library_id: int,
    tmdb_id: int,
    into: int,
    kind: str = "movie",
    title: str = "Heat",
    year: int | None = 1995,
    survivor: dict[str, Any] | None = None,
) -> int:
    """An item `title` (`year`) observed under `tmdb_id` (its evidence kept), then TMDb
    merges that id into `into` (`survivor` varies the survivor: title, original_title,
    year, round_trip, also; by default it carries the item's title and year) and two
    observations answer 404: an eligible case."""
    item_id = item(conn, library_id, tmdb_id, kind, title, year)
    [first] = observe(conn, client)
    assert first.outcome == "observed", first
    merge = {"title": title, "year": year, **(survivor or {})}
    standin.merge(kind, tmdb_id, into, **merge)
    fail_twice(conn, client, item_id)
    row = case(conn, item_id)
    assert (row["recovery_category"], row["recovery_attempts"]) == ("not_found", 2), row
    return item_id


def case(conn: Connection, item_id: int) -> dict[str, Any]:
    row = fetch_one(conn, "SELECT * FROM media_server_items WHERE id = %s", (item_id,))
    assert row is not None
    return row


def revalidate(
    conn: Connection, client: TmdbClient, per_hour: int = PER_HOUR
) -> RevalidationSummary:
    return service.revalidate(conn, client, POLICY, per_hour)


def revalidation(conn: Connection, item_id: int) -> dict[str, Any] | None:
    """The item's revalidation record of its current case."""
    return fetch_one(
        conn,
        "SELECT r.* FROM identity_revalidations r JOIN media_server_items i"
        " ON i.id = r.item_id AND i.recovery_case_id = r.case_id WHERE r.item_id = %s",
        (item_id,),
    )


def proposals(conn: Connection, item_id: int | None = None) -> list[dict[str, Any]]:
    return fetch_all(
        conn,
        "SELECT * FROM replacement_proposals WHERE %(id)s::bigint IS NULL OR item_id = %(id)s"
        " ORDER BY id",
        {"id": item_id},
    )


def requested(standin: StandIn, start: int = 0) -> list[str]:
    """The paths the stand-in was asked for (from the `start`-th request on)."""
    with standin.state.lock:
        return standin.state.paths[start:]
