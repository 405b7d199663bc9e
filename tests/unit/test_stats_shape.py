"""The stats package's shape: every named statement is used, the worker's modules call
typed repository functions, and errors are read by their SQLSTATE."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import inventory_pipeline
from inventory_pipeline.db.queries import load_queries

PACKAGE = Path(inventory_pipeline.__file__).parent
WORKER_MODULES = ("runbook", "service")


def python_sources() -> dict[Path, str]:
    return {p: p.read_text("utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def unused(names: list[str], sources: str) -> list[str]:
    """Names no Python source quotes."""
    return [name for name in names if not re.search(rf"""["']{name}["']""", sources)]


def test_every_named_stats_query_is_used() -> None:
    sources = "\n".join(python_sources().values())
    assert unused(list(load_queries("inventory_pipeline.stats")), sources) == []


def test_an_unquoted_name_counts_as_unused() -> None:
    sources = "\n".join(python_sources().values())
    assert unused(["lock_job", "lock_jobs", "no_such_statement"], sources) == [
        "lock_jobs",
        "no_such_statement",
    ]


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_worker_modules_use_typed_repository_calls(module: str) -> None:
    text = (PACKAGE / "stats" / f"{module}.py").read_text("utf-8")
    assert not re.search(r"repo\.(one|many|run)\(conn, \"(?!request_rebuild\")", text)
    assert "__cause__" not in text
    assert "is_error" not in text
