"""The named-query loader and the query files it reads."""

from __future__ import annotations

import pytest

from inventory_pipeline.db.queries import load_queries, parse_queries


def test_parse_named_blocks() -> None:
    text = "-- name: first\n-- what it does\nSELECT 1;\n\n-- name: second\nSELECT 2\n"
    queries = parse_queries(text)
    assert list(queries) == ["first", "second"]
    assert queries["first"].endswith("SELECT 1")
    assert queries["second"] == "SELECT 2"


@pytest.mark.parametrize(
    "text", ["-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;", "-- name: empty\n;\n"]
)
def test_duplicate_or_empty_blocks_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_queries(text)


@pytest.mark.parametrize(
    ("package", "filename"),
    [
        ("inventory_pipeline.profiles", "queries.sql"),
        ("inventory_pipeline.db", "migrator.sql"),
        ("inventory_pipeline", "demo.sql"),
    ],
)
def test_project_query_files_load(package: str, filename: str) -> None:
    queries = load_queries(package, filename)
    assert queries
    for body in queries.values():
        # Values reach SQL only as bound parameters: no str.format placeholders.
        assert "{" not in body.replace("'{}'", "")
