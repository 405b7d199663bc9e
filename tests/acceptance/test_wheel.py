"""The wheel ships the repository's migrations and instance files, byte for byte, and
the package reads them from itself (never from a path outside it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from inventory_pipeline import __version__
from inventory_pipeline.db.migrator import discover

SHIPPED = ("dagster.yaml",)
SOURCES = ("pyproject.toml", "README.md", "inventory_pipeline", "migrations", *SHIPPED)


def repo_files(root: Path) -> dict[str, bytes]:
    files = {name: (root / name).read_bytes() for name in SHIPPED}
    for path in sorted((root / "migrations").glob("*.sql")):
        files[f"migrations/{path.name}"] = path.read_bytes()
    return files


def test_wheel_ships_the_repository_files(repo_root: Path, tmp_path: Path) -> None:
    # Build from a copy: an in-tree build would leave build/ in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        origin = repo_root / name
        if origin.is_dir() and not origin.is_symlink():
            shutil.copytree(
                origin, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(origin, source / name, follow_symlinks=False)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("inventory_pipeline-*.whl")
    assert wheel.name.startswith(f"inventory_pipeline-{__version__}-")  # the one version
    with zipfile.ZipFile(wheel) as archive:
        inside = {name.removeprefix("inventory_pipeline/"): name for name in archive.namelist()}
        shipped = {
            name: archive.read(path)
            for name, path in inside.items()
            if name in SHIPPED or name.startswith("migrations/")
        }
    assert shipped == repo_files(repo_root)


def test_package_reads_its_own_copies(repo_root: Path) -> None:
    from inventory_pipeline.deployment import packaged

    expected = repo_files(repo_root)
    for name in SHIPPED:
        assert packaged(name) == expected[name]
    assert {f"migrations/{m.filename}": m.sql.encode() for m in discover()} == {
        name: data for name, data in expected.items() if name.startswith("migrations/")
    }
