"""`python -m bench` as CI runs it: a smoke run leaves the published pictures alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]


def _bench(server_url: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "INVENTORY_BENCH_DATABASE_URL": server_url,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])
        ),
    }
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_smoke_run_draws_its_pictures_outside_bench_plots(
    server_url: str, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    done = _bench(server_url, tmp_path, "--smoke", "--only", "profile_generation")
    assert done.returncode == 0, done.stderr
    assert "profile generation vs bare projection read" in done.stdout
    assert not (tmp_path / "bench").exists()


def test_a_smoke_run_draws_where_it_is_told(server_url: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    chosen = tmp_path / "pictures"
    done = _bench(
        server_url, tmp_path, "--smoke", "--only", "profile_generation", "--plots", str(chosen)
    )
    assert done.returncode == 0, done.stderr
    assert (chosen / "profile-generation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
