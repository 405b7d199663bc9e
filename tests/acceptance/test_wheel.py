"""The package reads its migrations and instance file from itself (never from a path
outside it). That the wheel carries them byte for byte is checked where the wheel is
built, once per CI run: `.ci/wheel_smoke.py`."""

from __future__ import annotations

from pathlib import Path

from inventory_pipeline.db.migrator import discover

SHIPPED = ("dagster.yaml",)


def repo_files(root: Path) -> dict[str, bytes]:
    files = {name: (root / name).read_bytes() for name in SHIPPED}
    for path in sorted((root / "migrations").glob("*.sql")):
        files[f"migrations/{path.name}"] = path.read_bytes()
    return files


def test_package_reads_its_own_copies(repo_root: Path) -> None:
    from inventory_pipeline.deployment import packaged

    expected = repo_files(repo_root)
    for name in SHIPPED:
        assert packaged(name) == expected[name]
    assert {f"migrations/{m.filename}": m.sql.encode() for m in discover()} == {
        name: data for name, data in expected.items() if name.startswith("migrations/")
    }
