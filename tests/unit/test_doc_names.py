"""Every name the README and docs/ give a reader to follow resolves: a dotted Python name
(`profiles.service.refresh`, `defs.profiles.log_completions`), a file path
(`deploy/workspace.yaml`) and a SQL or Python function called by name
(`get_pr_overview(user_id, as_of)`). A rename that leaves the map behind fails here."""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "inventory_pipeline"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"`([^`\n]+)`")
# A dotted name that starts with the package or one of its top-level modules.
DOTTED = re.compile(r"^[a-z_][a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
# A call by name: `name(…)` with anything (or nothing) between the parentheses.
CALL = re.compile(r"^([a-z_][a-z0-9_]*)\(.*\)$")
# A path into the repository: a known top folder, then anything without spaces.
TOP = ("inventory_pipeline/", "migrations/", "deploy/", "docs/", "tests/", "chaos/", "bench/")
SUFFIXES = (".py", ".sql", ".yaml", ".yml", ".md", ".toml", ".txt", ".json", ".png", ".sh")
# Functions of PostgreSQL, Python or argparse that the docs call by name.
STANDARD = frozenset({"clock_timestamp", "now", "ceil", "round", "set_defaults"})


@cache
def top_modules() -> frozenset[str]:
    """The package's top-level modules and subpackages (`profiles`, `defs`, `cli`, ...)."""
    base = ROOT / PACKAGE
    names = {p.stem for p in base.glob("*.py")} | {
        p.name for p in base.iterdir() if (p / "__init__.py").exists()
    }
    return frozenset(names - {"__init__"})


@cache
def sql_functions() -> frozenset[str]:
    """Every function a migration or query file of the package defines."""
    found: set[str] = set()
    pattern = re.compile(r"FUNCTION\s+(?:public\.)?([a-z_][a-z0-9_]*)\s*\(", re.IGNORECASE)
    for path in [*(ROOT / "migrations").glob("*.sql"), *(ROOT / PACKAGE).rglob("*.sql")]:
        found.update(m.lower() for m in pattern.findall(path.read_text("utf-8")))
    return frozenset(found)


@cache
def python_functions() -> frozenset[str]:
    """Every function or method the package, its harnesses and benchmarks define."""
    found: set[str] = set()
    for folder in (PACKAGE, "chaos", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text("utf-8"))
            found.update(
                node.name
                for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            )
    return frozenset(found)


def resolves(dotted: str) -> bool:
    """Import the longest module prefix, then walk attributes."""
    parts = dotted.split(".")
    if parts[0] != PACKAGE:
        parts = [PACKAGE, *parts]
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def followed(span: str) -> str | None:
    """Why a code span a reader would follow does not resolve; None when it does, or
    when it is not such a name."""
    span = span.strip()
    if DOTTED.match(span) and span.split(".")[0] in {PACKAGE, *top_modules()}:
        if span.endswith(SUFFIXES):
            return (
                None
                if (ROOT / PACKAGE / span).exists() or (ROOT / span).exists()
                else ("no such file")
            )
        return None if resolves(span) else "no such Python name"
    if span.startswith(TOP) and " " not in span and not re.search(r"[<*{$]", span):
        path = span.split("#")[0].split(":")[0]
        if path.startswith("migrations/") and "." not in path and path != "migrations/":
            # A migration by its number: `migrations/0018`.
            return None if list(ROOT.glob(f"{path}_*.sql")) else "no such migration"
        if not path.endswith((*SUFFIXES, "/")):
            return None  # a tag or key that looks like a path (`inventory_pipeline/queue`)
        return None if (ROOT / path.rstrip("/")).exists() else "no such file"
    call = CALL.match(span)
    if call:
        name = call.group(1)
        if name in STANDARD or name in sql_functions() or name in python_functions():
            return None
        return "no such SQL or Python function"
    return None


def test_every_name_in_the_docs_resolves() -> None:
    missing = []
    for page in PAGES:
        fenced = False
        for number, line in enumerate(page.read_text("utf-8").splitlines(), start=1):
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
                continue
            if fenced:
                continue
            for span in CODE.findall(line):
                why = followed(span)
                if why:
                    missing.append(f"{page.relative_to(ROOT)}:{number}: `{span}`: {why}")
    assert missing == [], "names a reader cannot follow:\n" + "\n".join(missing)


def test_the_check_finds_what_does_not_exist() -> None:
    assert followed("profiles.generator.frame_from_rows") == "no such Python name"
    assert followed("profiles.service.refresh") is None
    assert followed("inventory_pipeline/provider/standin.py") is None
    assert followed("inventory_pipeline/provider/gone.py") == "no such file"
    assert followed("get_pr_overview(user_id, as_of)") is None
    assert followed("stats_compute_everything()") == "no such SQL or Python function"
    assert followed("SELECT 1") is None
    assert followed("migrations/0018") is None and followed("migrations/0099") is not None
    assert followed("inventory_pipeline/queue") is None  # a run tag, not a path
