"""A small, deterministic demo: enough libraries to see profiles publish, traits held
back by the coverage contract and an empty library, in two partitions; a training log
for three users so the stats projections and PR overview fill in; and items whose TMDb
records were merged, with a history that happened just before the load (every age the
UI shows is real)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any
from uuid import UUID

from inventory_pipeline.db import Connection, execute, fetch_one, jsonb, transaction
from inventory_pipeline.db.queries import load_queries
from inventory_pipeline.provider.standin import StandIn, external_ids

QUERIES = load_queries("inventory_pipeline", "demo.sql")

GENRES = {
    "movie": ("Drama", "Comedy", "Action", "Thriller", "Science Fiction", "Romance", "Horror"),
    "tv": ("Drama", "Comedy", "Crime", "Animation", "Documentary", "Reality"),
    "music": ("Jazz", "Rock", "Electronic", "Classical", "Hip-Hop"),
}
STUDIOS = (
    "A24",
    "Pixar",
    "Studio Ghibli",
    "Warner Bros.",
    "Universal",
    "Toho",
    "Gaumont",
    "BBC",
    "HBO",
    "Netflix",
    "Canal+",
    "StudioCanal",
)
LANGUAGES = ("en", "fr", "ja", "ko", "de", "es", "it", "sv")


@dataclass(frozen=True)
class DemoLibrary:
    server: str
    name: str
    media_kind: str
    items: int
    coverage: float  # share of items carrying rating/studio/identity
    policy: bool = False


LIBRARIES = (
    DemoLibrary("Living Room Plex", "Films", "movie", 800, 0.95, policy=True),
    DemoLibrary("Living Room Plex", "Series", "tv", 300, 0.9),
    DemoLibrary("Living Room Plex", "Music Videos", "music", 200, 0.2),
    DemoLibrary("Living Room Plex", "Kids", "movie", 4, 1.0),
    DemoLibrary("Living Room Plex", "Archive", "movie", 0, 1.0),
    DemoLibrary("Cabin Jellyfin", "Documentaries", "movie", 150, 0.4),
    DemoLibrary("Cabin Jellyfin", "Anime", "tv", 120, 0.85),
    DemoLibrary("Cabin Jellyfin", "Classics", "movie", 90, 0.9),
    DemoLibrary("Cabin Jellyfin", "Concerts", "music", 40, 0.3),
    DemoLibrary("Office Emby", "Westerns", "movie", 60, 0.9),
    DemoLibrary("Office Emby", "Nature", "tv", 30, 0.8),
)
# Eleven libraries: ids 1 to 11 span two partitions (ranges of ten ids), so a
# backfill of more than one partition can be tried.


def _items(rng: random.Random, library: DemoLibrary) -> list[dict[str, Any]]:
    rows = []
    for i in range(library.items):
        carries = rng.random() < library.coverage
        kind = library.media_kind if library.media_kind != "music" else None
        rows.append(
            {
                "title": f"{library.name} #{i + 1}",
                "year": rng.randint(1960, 2026),
                "provider": "tmdb" if carries and kind else None,
                "provider_kind": kind if carries and kind else None,
                "provider_id": str(rng.randint(1, 900_000)) if carries and kind else None,
                "rating": round(rng.triangular(2, 10, 7), 1) if carries else None,
                "genres": rng.sample(GENRES[library.media_kind], rng.randint(1, 3)),
                "primary_studio": rng.choice(STUDIOS) if carries else None,
                "original_language": rng.choices(LANGUAGES, weights=(8, 2, 2, 1, 1, 1, 1, 1))[0],
                "plot": "A demo item.",
            }
        )
    return rows


@dataclass(frozen=True)
class DemoMerge:
    """A demo item whose TMDb record (`kind`, `merged`) the stand-in folds into `into`:
    the survivor carries the item's title and `year`; `also` adds a second record to the
    lookup (an ambiguous one)."""

    library: str
    title: str
    year: int
    kind: str
    merged: int
    into: int
    survivor_year: int | None = None
    also: tuple[tuple[str, int], ...] = ()


# Three corroborated merges (proposed for an operator), an ambiguous lookup and a
# survivor of another year (no proposal, with the reason shown). No id is divisible by
# the stand-in's 17 (those are unknown in the demo).
DEMO_MERGES = (
    DemoMerge("Films", "Heat", 1995, "movie", 949, 1949),
    DemoMerge("Films", "The Matrix", 1999, "movie", 603, 1603),
    DemoMerge("Series", "Mad Men", 2007, "tv", 1104, 11104),
    DemoMerge("Films", "Ronin", 1998, "movie", 8195, 18195, also=(("movie", 28195),)),
    DemoMerge("Films", "Alien", 1979, "movie", 348, 1348, survivor_year=1986),
)


def apply_merges(standin: StandIn) -> None:
    """The demo's merges, as TMDb made them (every start: the stand-in keeps nothing)."""
    for m in DEMO_MERGES:
        standin.merge(
            m.kind, m.merged, m.into, title=m.title, year=m.survivor_year or m.year, also=m.also
        )


def _merged_items(conn: Connection, libraries: dict[str, int]) -> None:
    for m in DEMO_MERGES:
        ids = external_ids(m.kind, m.merged)
        execute(
            conn,
            QUERIES["insert_merged_item"],
            {
                "library_id": libraries[m.library],
                "title": m.title,
                "year": m.year,
                "kind": m.kind,
                "tmdb_id": m.merged,
                "imdb_id": ids["imdb_id"],
                "tvdb_id": ids["tvdb_id"],
            },
        )


EXERCISES = ("back_squat", "bench_press", "deadlift", "overhead_press", "barbell_row", "pull_up")
DEMO_USERS = (
    UUID("00000000-0000-4000-8000-000000000001"),
    UUID("00000000-0000-4000-8000-000000000002"),
    UUID("00000000-0000-4000-8000-000000000003"),
)


def _training_log(conn: Connection, rng: random.Random) -> None:
    """A few weeks of workouts for three users, saved like an app would save them."""
    for exercise in EXERCISES:
        execute(
            conn,
            QUERIES["insert_exercise"],
            {"id": exercise, "name": exercise.replace("_", " ").title()},
        )
    start = date.today() - timedelta(days=60)
    for user in DEMO_USERS:
        for n in range(20):
            chosen = rng.sample(EXERCISES, 3)
            sets = [
                {
                    "exercise_id": e,
                    "weight_kg": rng.randint(4, 30) * 5,
                    "reps": rng.randint(1, 12),
                    "warmup": k == 0,
                }
                for e in chosen
                for k in range(4)
            ]
            session = {
                "user_id": str(user),
                "session_date": str(start + timedelta(days=3 * n)),
                "sets": sets,
            }
            execute(conn, QUERIES["save_session"], {"user_id": user, "session": jsonb(session)})


def load_demo(conn: Connection, seed: int = 2026) -> int:
    """Load the demo inventory once; returns the number of libraries created (0 when the
    database already holds media servers)."""
    rng = random.Random(seed)
    with transaction(conn):
        present = fetch_one(conn, QUERIES["has_inventory"])
        if present is not None and present["present"]:
            return 0
        servers: dict[str, int] = {}
        libraries: dict[str, int] = {}
        for library in LIBRARIES:
            if library.server not in servers:
                kind = library.server.split()[-1].lower()
                row = fetch_one(
                    conn, QUERIES["insert_server"], {"name": library.server, "kind": kind}
                )
                assert row is not None
                servers[library.server] = int(row["id"])
            row = fetch_one(
                conn,
                QUERIES["insert_library"],
                {
                    "server_id": servers[library.server],
                    "name": library.name,
                    "media_kind": library.media_kind,
                },
            )
            assert row is not None
            library_id = int(row["id"])
            libraries[library.name] = library_id
            if library.policy:
                execute(conn, QUERIES["insert_policy"], {"library_id": library_id})
            if library.items:
                execute(
                    conn,
                    QUERIES["insert_items"],
                    {"library_id": library_id, "items": jsonb(_items(rng, library))},
                )
        _merged_items(conn, libraries)
        _training_log(conn, rng)
    return len(LIBRARIES)
