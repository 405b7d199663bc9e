"""CI: the wheel carries the repository's files byte for byte (the migrations, the
instance file, every SQL file of the package), installs into a fresh venv and works
from a folder outside the repository: `status` refuses an unmigrated database, `migrate`
and `status` succeed (on the embedded default and on the PostgreSQL server given as
argument), and a short `dev` serves its UI and stops cleanly on Ctrl-C, its embedded
server with it. The wheel is built once, here; the test suite checks only that the
package reads its own copies (tests/acceptance/test_wheel.py).

Usage: python .ci/wheel_smoke.py postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the harness's port picks (chaos is not in the wheel)
from chaos.servers import free_port  # noqa: E402 (after the path above)

SOURCES = ("pyproject.toml", "README.md", "inventory_pipeline", "migrations")
SOURCES += ("dagster.yaml", "workspace.yaml")


def step(text: str, started: float) -> float:
    now = time.monotonic()
    print(f"wheel smoke: {text} ({now - started:.1f} s)", flush=True)
    return now


def check(args: list[str], cwd: Path, env: dict[str, str], code: int = 0) -> str:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != code:
        sys.exit(f"{args} exited {result.returncode}, expected {code}:\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def repository_files() -> dict[str, bytes]:
    """What the wheel must carry, by its path inside the package: the migrations (the
    package's `migrations` is a link to the repository's), the instance file, and every
    SQL file of the package (queries and schema files)."""
    package = REPO / "inventory_pipeline"
    files = {"dagster.yaml": (REPO / "dagster.yaml").read_bytes()}
    for path in sorted((REPO / "migrations").glob("*.sql")):
        files[f"migrations/{path.name}"] = path.read_bytes()
    for path in sorted(package.rglob("*.sql")):
        relative = path.relative_to(package).as_posix()
        if not relative.startswith("migrations/"):
            files[relative] = path.read_bytes()
    return files


def check_shipped(wheel: Path) -> None:
    from inventory_pipeline import __version__

    if not wheel.name.startswith(f"inventory_pipeline-{__version__}-"):
        sys.exit(f"the wheel {wheel.name} does not carry the package's version {__version__}")
    expected = repository_files()
    with zipfile.ZipFile(wheel) as archive:
        inside = {name.removeprefix("inventory_pipeline/"): name for name in archive.namelist()}
        shipped = {name: archive.read(inside[name]) for name in expected if name in inside}
    if shipped != expected:
        differ = sorted(n for n in expected if shipped.get(n) != expected[n])
        sys.exit(f"the wheel lacks or alters {len(differ)} file(s): {', '.join(differ[:10])}")


def main(server_url: str) -> None:
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="inventory-wheel-"))
    try:
        source = tmp / "source"
        source.mkdir()
        for name in SOURCES:  # build from a copy: an in-tree build leaves build/ behind
            origin = REPO / name
            if origin.is_dir() and not origin.is_symlink():
                ignore = shutil.ignore_patterns("__pycache__")
                shutil.copytree(origin, source / name, symlinks=True, ignore=ignore)
            else:
                shutil.copy2(origin, source / name, follow_symlinks=False)
        pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp), "."]
        check(pip, source, dict(os.environ))
        (wheel,) = tmp.glob("inventory_pipeline-*.whl")
        check_shipped(wheel)
        started = step(f"built {wheel.name}, its files the repository's", started)

        venv = tmp / "venv"
        check([sys.executable, "-m", "venv", str(venv)], tmp, dict(os.environ))
        # No bytecode compiled at install: what runs compiles on import, as in any venv.
        pip_install = [str(venv / "bin" / "pip"), "install", "-q", "--no-compile", str(wheel)]
        check(pip_install, tmp, dict(os.environ))
        started = step("installed into a fresh venv", started)

        elsewhere = tmp / "elsewhere"
        elsewhere.mkdir()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("INVENTORY_", "DAGSTER_", "PYTHON"))
        }
        cli = str(venv / "bin" / "inventory-pipeline")
        where = check(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import inventory_pipeline; print(inventory_pipeline.__file__)",
            ],
            elsewhere,
            env,
        )
        assert where.startswith(str(venv)), where

        # The embedded default, in ./.inventory_pipeline of a folder that is not the repo.
        assert "run `inventory-pipeline migrate`" in check([cli, "status"], elsewhere, env, 1)
        check([cli, "migrate"], elsewhere, env)
        assert "dirty libraries" in check([cli, "status"], elsewhere, env)
        started = step("migrate and status on the embedded PostgreSQL", started)

        # A configured server.
        name = f"inventory_wheel_{uuid.uuid4().hex[:8]}"
        admin = (
            ["-h", "127.0.0.1", "-p", "5432", "-U", "postgres"] if "127.0.0.1" in server_url else []
        )
        subprocess.run(["createdb", *admin, name], check=True)
        try:
            url = server_url.rsplit("/", 1)[0] + "/" + name
            server_env = {**env, "INVENTORY_DATABASE_URL": url}
            check([cli, "migrate"], elsewhere, server_env)
            assert "dirty libraries" in check([cli, "status"], elsewhere, server_env)
        finally:
            for database in (name, f"{name}_dagster"):
                subprocess.run(["dropdb", *admin, "--if-exists", database], check=True)
        started = step("migrate and status on the configured server", started)

        port = free_port()  # below the ephemeral range `dev`'s code servers draw from
        log = tmp / "dev.log"
        with log.open("wb") as out:
            dev = subprocess.Popen(
                [cli, "dev", "--demo", "--port", str(port)],
                cwd=elsewhere,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 180
            while "Dagster UI at" not in log.read_text(errors="replace"):
                if dev.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"dev did not serve:\n{log.read_text(errors='replace')[-3000:]}")
                time.sleep(0.5)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as r:
                assert r.status == 200
            started = step("dev --demo serves its UI", started)
            dev.send_signal(signal.SIGINT)
            assert dev.wait(60) == 0, log.read_text(errors="replace")[-3000:]
        finally:
            if dev.poll() is None:
                dev.kill()
        assert not (elsewhere / ".inventory_pipeline" / "pgdata" / "postmaster.pid").exists()
        step("dev stopped cleanly on Ctrl-C, its PostgreSQL with it", started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1])
