"""Named SQL blocks loaded once from a capability's `queries.sql`.

Format (after Procrastinate's `queries.sql`): a header line `-- name: plan_inventory`
starts a block; the comment lines after it describe the statement; the block runs to
the next header.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType

_HEADER = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def parse_queries(text: str) -> Mapping[str, str]:
    """Split a query file into its named statements; duplicate names are an error."""
    parts = _HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        statement = body.strip().rstrip(";").strip()
        if not statement:
            raise ValueError(f"query {name!r} is empty")
        queries[name] = statement
    return MappingProxyType(queries)


def load_queries(package: str, filename: str = "queries.sql") -> Mapping[str, str]:
    return parse_queries(resources.files(package).joinpath(filename).read_text("utf-8"))
