"""The package explains itself from the repository: no comment, docstring or query file
cites a design document, decision or issue that is not in it, and every link into
`docs/` names a page and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "inventory_pipeline"
DOCS = ROOT / "docs"
# Applied migrations are history (their bytes are checksummed): they keep their wording.
HISTORY = PACKAGE / "migrations"
# Where code (and the README) links into docs/.
LINKING = (PACKAGE, ROOT / "chaos", ROOT / "bench", ROOT / "README.md")
TEXT_SUFFIXES = {".py", ".sql", ".yaml", ".yml", ".toml", ".md", ".txt", ".cfg", ".ini"}

# A design-document section, a decision code or an issue number: references a reader
# cannot follow from the repository.
REFERENCE = re.compile(r"seed 00|D0[0-9]|D1[0-9]|#1590|issue [0-9]|seed [0-9]")
LINK = re.compile(r"docs/([A-Za-z0-9_.-]+?\.md)(?:#([A-Za-z0-9_-]+))?")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def text_files(top: Path, skip: Path | None = None) -> list[Path]:
    """Text files under `top` (or `top` itself), without descending into `skip` (even
    through a symlink)."""
    if top.is_file():
        return [top]
    found = []
    for path in sorted(top.rglob("*")):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        if "__pycache__" in path.parts or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES:
            found.append(path)
    return found


def slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped,
    spaces as hyphens (GitHub's rule)."""
    text = re.sub(r"`|\*|_(?=\W)|(?<=\W)_", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, fenced code blocks excluded."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text("utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            found.add(slug(match.group(1)))
    return found


def test_the_package_cites_nothing_outside_the_repository() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in text_files(PACKAGE, skip=HISTORY)
        for number, line in enumerate(path.read_text("utf-8").splitlines(), start=1)
        if REFERENCE.search(line)
    ]
    assert hits == [], "references a reader cannot follow:\n" + "\n".join(hits)


def test_the_docs_cite_nothing_outside_the_repository() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(DOCS.glob("*.md"))
        for number, line in enumerate(path.read_text("utf-8").splitlines(), start=1)
        if REFERENCE.search(line)
    ]
    assert hits == [], "\n".join(hits)


def test_every_docs_link_resolves_to_a_page_and_a_heading() -> None:
    pages: dict[str, set[str]] = {}
    broken = []
    links = 0
    for top in LINKING:
        for path in text_files(top, skip=HISTORY):
            for number, line in enumerate(path.read_text("utf-8").splitlines(), start=1):
                for page, anchor in LINK.findall(line):
                    links += 1
                    where = f"{path.relative_to(ROOT)}:{number}: docs/{page}"
                    target = DOCS / page
                    if not target.is_file():
                        broken.append(f"{where}: no such page")
                        continue
                    if page not in pages:
                        pages[page] = anchors(target)
                    if anchor and anchor not in pages[page]:
                        broken.append(f"{where}#{anchor}: no such heading")
    assert links > 0, "the package links no docs page: the check would prove nothing"
    assert broken == [], "\n".join(broken)


def test_links_between_docs_pages_resolve() -> None:
    broken = []
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text("utf-8")
        for page, anchor in re.findall(r"\]\(([A-Za-z0-9_.-]+\.md)?(?:#([A-Za-z0-9_-]+))?\)", text):
            target = DOCS / page if page else path
            if not target.is_file():
                broken.append(f"{path.name}: {page}: no such page")
            elif anchor and anchor not in anchors(target):
                broken.append(f"{path.name}: {page or path.name}#{anchor}: no such heading")
    assert broken == [], "\n".join(broken)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Lock order", "lock-order"),
        ("Retry and circuit probe", "retry-and-circuit-probe"),
        ("The `library_profile` asset", "the-library_profile-asset"),
        ("What it checks: invariants", "what-it-checks-invariants"),
    ],
)
def test_slug_follows_the_markdown_rule(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_reference_or_a_broken_link_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Lock order\n\n```\n## not a heading\n```\n", "utf-8")
    assert anchors(page) == {"title", "lock-order"}
    assert REFERENCE.search("# seed 000: the oldest 25 candidates")
    assert REFERENCE.search("see issue 8")
    assert not REFERENCE.search("random.Random(seed)")
    assert LINK.findall("(docs/profiles.md#lock-order)") == [("profiles.md", "lock-order")]
    assert LINK.findall("see docs/deployment.md.") == [("deployment.md", "")]
