"""Every value the consumed columns' types accept, written by several statement shapes on
real PostgreSQL, ends in a profile equal to the independent oracle's (chaos/oracle.py):
no value a program can write stops a library's profile (docs/profiles.md#coverage-contract).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos import oracle
from inventory_pipeline.db import Connection, execute, fetch_all, fetch_one
from tests import factories as f
from tests.db.test_interleavings import process_all

# text admits any character but NUL; names a profile must tell apart from none (blank)
# and from the rest of a distribution ("other").
# Every string a text column admits: any code point but NUL and the surrogates (which
# UTF-8, the database's encoding, cannot hold).
TEXT = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=12)
NAMES = st.one_of(
    st.none(),
    st.sampled_from(["", " ", "\t\n", "\u3000", "other", "Other", "Drama", "x" * 2000]),
    TEXT,
)


@st.composite
def genres(draw: st.DrawFn) -> list[Any] | None:
    """NULL, or a rectangular text[] of one to three dimensions with NULL and blank
    elements (PostgreSQL refuses ragged arrays)."""
    if draw(st.booleans()) and draw(st.booleans()):
        return None
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))

    def fill(dims: list[int]) -> list[Any]:
        if len(dims) == 1:
            return [draw(NAMES) for _ in range(dims[0])]
        return [fill(dims[1:]) for _ in range(dims[0])]

    return [] if draw(st.integers(0, 9)) == 0 else fill(shape)


ITEM = st.fixed_dictionaries(
    {
        "genres": genres(),
        "primary_studio": NAMES,
        "original_language": NAMES,
        # The column's check refuses NaN and values outside 0-10.
        "rating": st.one_of(st.none(), st.decimals(0, 10, places=2, allow_nan=False)),
    }
)


def write(conn: Connection, library: int, items: list[dict[str, Any]], shape: str) -> None:
    """The items into `library` through one statement shape: one INSERT per item, one
    multi-row INSERT, or placeholder rows then an UPDATE per item."""
    columns = "library_id, title, genres, primary_studio, original_language, rating"
    values = "(%s, %s, %s::text[], %s, %s, %s::numeric)"
    rows = [
        (library, f"t{n}", i["genres"], i["primary_studio"], i["original_language"], i["rating"])
        for n, i in enumerate(items)
    ]
    if shape == "insert":
        for row in rows:
            execute(conn, f"INSERT INTO media_server_items ({columns}) VALUES {values}", row)
    elif shape == "multi-row insert":
        execute(
            conn,
            f"INSERT INTO media_server_items ({columns}) VALUES " + ", ".join([values] * len(rows)),
            tuple(v for row in rows for v in row),
        )
    else:
        for library_id, title, *rest in rows:
            placed = fetch_one(
                conn,
                "INSERT INTO media_server_items (library_id, title) VALUES (%s, %s) RETURNING id",
                (library_id, title),
            )
            assert placed is not None
            execute(
                conn,
                "UPDATE media_server_items SET genres = %s::text[], primary_studio = %s,"
                " original_language = %s, rating = %s::numeric WHERE id = %s",
                (*rest, placed["id"]),
            )


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    items=st.lists(ITEM, min_size=1, max_size=30),
    shape=st.sampled_from(["insert", "multi-row insert", "update"]),
)
def test_every_written_value_ends_in_the_oracles_profile(
    conn: Connection, items: list[dict[str, Any]], shape: str
) -> None:
    library = f.library(conn, name=f"values {shape}")
    write(conn, library, items, shape)
    process_all(conn)
    state = fetch_one(
        conn,
        "SELECT revision, acknowledged_revision FROM library_inventory_state WHERE library_id = %s",
        (library,),
    )
    assert state is not None and state["acknowledged_revision"] == state["revision"]
    stored = fetch_one(
        conn, "SELECT profile FROM library_profiles WHERE library_id = %s", (library,)
    )
    assert stored is not None
    rows = fetch_all(conn, oracle.RAW_ITEMS + " AND i.library_id = %s", (library,))
    expected = oracle.expected_profile(rows)
    assert list(oracle.differences(expected, stored["profile"])) == []
