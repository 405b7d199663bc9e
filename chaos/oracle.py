"""An independent oracle for library profiles: the expected profile of every active
library, computed in plain Python from the raw item columns, without the product's
projection function, its reader or its generator.

It restates the profile contract: per trait (genres, rating, primary studio, original
language, typed identity) the contributors (items carrying the field), the coverage
(contributors / items, four decimals) and, only where coverage >= 0.5 and at least five
items contribute, the distribution (`published`); otherwise `insufficient`. Genres and
identities list every value's share of contributors; studios and languages the ten
largest (ties by name), and what the others hold together as `rest_share`, beside the
shares (a studio may be called "other"); ratings their mean, median, 10th and 90th
percentile (linear interpolation between closest ranks). A genres array of any
dimension contributes the distinct names it holds; a NULL or blank name (empty or
whitespace only) is no value in any trait. Shares and statistics are
rounded to four decimals, so the comparison allows one unit in the last place.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Any

from inventory_pipeline.db import Connection, fetch_all

MIN_COVERAGE = 0.5
MIN_CONTRIBUTORS = 5
TOP_VALUES = 10
TOLERANCE = 1.5e-4  # one unit in the fourth decimal, plus float noise

# Raw columns only: no inventory_observation_of(), no product query.
RAW_ITEMS = (
    "SELECT i.library_id, i.provider, i.provider_kind, i.rating, i.genres,"
    " i.primary_studio, i.original_language"
    " FROM media_server_items i JOIN libraries l ON l.id = i.library_id"
    " JOIN media_servers m ON m.id = l.server_id WHERE l.active AND m.active"
)
ACTIVE = (
    "SELECT l.id FROM libraries l JOIN media_servers m ON m.id = l.server_id"
    " WHERE l.active AND m.active"
)


def _r(value: float) -> float:
    return round(value, 4)


def _ordered(counts: Counter[str]) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def _trait(contributors: int, items: int, published: dict[str, Any]) -> dict[str, Any]:
    coverage = contributors / items
    body: dict[str, Any] = {"coverage": _r(coverage), "contributors": contributors}
    if coverage >= MIN_COVERAGE and contributors >= MIN_CONTRIBUTORS:
        return {"status": "published", **body, **published}
    return {"status": "insufficient", **body}


def _shares(counts: Counter[str], contributors: int) -> dict[str, float]:
    return {k: _r(v / contributors) for k, v in _ordered(counts)}


def _blank(value: object) -> bool:
    return value is None or str(value).strip() == ""


def _leaves(array: object) -> Iterable[object]:
    """Every element of a nested array, depth first."""
    stack = [array]
    while stack:
        top = stack.pop()
        if isinstance(top, list):
            stack.extend(reversed(top))
        else:
            yield top


def _percentile(ordered: Sequence[float], q: float) -> float:
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _rating(values: list[float], items: int) -> dict[str, Any]:
    published: dict[str, Any] = {}
    if values:
        ordered = sorted(values)
        published = {
            "mean": _r(math.fsum(values) / len(values)),
            "median": _r(_percentile(ordered, 0.5)),
            "p10": _r(_percentile(ordered, 0.1)),
            "p90": _r(_percentile(ordered, 0.9)),
        }
    return _trait(len(values), items, published)


def _categorical(values: list[str], items: int) -> dict[str, Any]:
    published: dict[str, Any] = {}
    if values:
        counts = Counter(values)
        top = dict(_ordered(counts)[:TOP_VALUES])
        published["share"] = _shares(Counter(top), len(values))
        rest = len(values) - sum(top.values())
        if rest:
            published["rest_share"] = _r(rest / len(values))
    return _trait(len(values), items, published)


def expected_profile(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The profile of one library's raw item rows; None for an empty library."""
    items = len(rows)
    if not items:
        return None
    genre_counts: Counter[str] = Counter()
    genre_items = 0
    for row in rows:
        genres = {str(g) for g in _leaves(row["genres"] or []) if not _blank(g)}
        genre_counts.update(genres)
        genre_items += bool(genres)
    identities = Counter(
        f"{row['provider']}:{row['provider_kind']}"
        for row in rows
        if row["provider"] is not None and row["provider_kind"] is not None
    )
    n_identities = sum(identities.values())
    return {
        "genres": _trait(
            genre_items,
            items,
            {"share": _shares(genre_counts, genre_items)} if genre_items else {},
        ),
        "rating": _rating(
            [float(Decimal(row["rating"])) for row in rows if row["rating"] is not None], items
        ),
        "primary_studio": _categorical(
            [row["primary_studio"] for row in rows if not _blank(row["primary_studio"])], items
        ),
        "original_language": _categorical(
            [row["original_language"] for row in rows if not _blank(row["original_language"])],
            items,
        ),
        "identity": _trait(
            n_identities,
            items,
            {"share": _shares(identities, n_identities)} if n_identities else {},
        ),
    }


def differences(expected: Any, stored: Any, path: str = "") -> Iterable[str]:
    """Where two profiles differ: keys, statuses, counts exactly; numbers within one
    unit of the fourth decimal."""
    if isinstance(expected, dict) and isinstance(stored, dict):
        for key in sorted(set(expected) | set(stored)):
            where = f"{path}.{key}" if path else key
            if key not in stored:
                yield f"{where} missing"
            elif key not in expected:
                yield f"{where} unexpected"
            else:
                yield from differences(expected[key], stored[key], where)
    elif isinstance(expected, float) or isinstance(stored, float):
        if not (
            isinstance(stored, int | float)
            and isinstance(expected, int | float)
            and abs(float(expected) - float(stored)) <= TOLERANCE
        ):
            yield f"{path}: expected {expected!r}, stored {stored!r}"
    elif expected != stored:
        yield f"{path}: expected {expected!r}, stored {stored!r}"


def check(conn: Connection) -> list[str]:
    """Every active library's stored profile (and item count) against the oracle."""
    by_library: dict[int, list[dict[str, Any]]] = {
        int(r["id"]): [] for r in fetch_all(conn, ACTIVE)
    }
    for row in fetch_all(conn, RAW_ITEMS):
        by_library[int(row["library_id"])].append(row)
    stored = {
        int(r["library_id"]): r
        for r in fetch_all(
            conn,
            "SELECT library_id, item_count, profile FROM library_profiles"
            " WHERE library_id = ANY(%s)",
            (list(by_library),),
        )
    }
    out: list[str] = []
    for library_id, rows in sorted(by_library.items()):
        expected = expected_profile(rows)
        have = stored.get(library_id)
        if expected is None:
            if have is not None:
                out.append(f"library {library_id}: oracle: empty, yet a profile is stored")
            continue
        if have is None:
            out.append(f"library {library_id}: oracle: {len(rows)} items, no profile stored")
            continue
        found = list(differences(expected, have["profile"]))
        if have["item_count"] != len(rows):
            found.insert(0, f"item_count: expected {len(rows)}, stored {have['item_count']}")
        if found:
            shown = "; ".join(found[:3]) + (f"; +{len(found) - 3} more" if len(found) > 3 else "")
            out.append(f"library {library_id}: oracle: {shown}")
    return out
