"""The guard list stays true to the code: each guard's text is in its file exactly once
(an edit of the guarded statement must update the list), and each test it names exists.
Whether removing a guard is caught is `python -m chaos.mutations`' question."""

from __future__ import annotations

import ast
from pathlib import Path

from chaos.guards import GUARDS

ROOT = Path(__file__).resolve().parents[2]


def test_each_guard_is_found_once_where_the_list_says() -> None:
    for guard in GUARDS:
        for path, old, new in guard.edits:
            text = (ROOT / path).read_text("utf-8")
            assert text.count(old) == 1, f"{guard.name}: {old!r} in {path}"
            assert new != old


def test_a_guard_in_a_migration_is_in_the_last_one_that_defines_it() -> None:
    """Removing a guard from a migration a later one overrides would change nothing the
    database runs: no later migration may carry the guarded text again."""
    migrations = sorted((ROOT / "migrations").glob("*.sql"))
    for guard in GUARDS:
        for path, old, _ in guard.edits:
            if not path.startswith("migrations/"):
                continue
            later = [m for m in migrations if m.name > Path(path).name]
            again = [m.name for m in later if old in m.read_text("utf-8")]
            assert not again, f"{guard.name}: {path} is overridden by {again}"


def test_each_guard_names_tests_that_exist() -> None:
    names = [guard.name for guard in GUARDS]
    assert len(names) == len(set(names))
    for guard in GUARDS:
        assert guard.tests, guard.name
        for test in guard.tests:
            path, _, function = test.partition("::")
            assert (ROOT / path).is_file(), f"{guard.name}: {path}"
            if function:
                tree = ast.parse((ROOT / path).read_text("utf-8"))
                defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
                assert function.split("[")[0] in defined, f"{guard.name}: {test}"
