"""The real CLI in a subprocess: bad input gets one line and a non-zero exit; good input
migrates, loads the demo, refreshes and reports."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from inventory_pipeline.db import connect, execute, fetch_all, fetch_one
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.db.migrator import discover, migrate
from tests.db.test_migrations import copy_migrations


def run(
    args: list[str],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("INVENTORY_", "DAGSTER_"))}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "inventory_pipeline.cli", *args],
        env=full_env,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["status", "--bogus"], {}, "unrecognized arguments: --bogus"),
        (["frobnicate"], {}, "invalid choice"),
        (["status"], {"INVENTORY_DATABASE_URL": "mysql://x/y"}, "must start with postgresql://"),
        (
            ["status"],
            {"INVENTORY_DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/x"},
            "cannot connect to postgresql://u:***@127.0.0.1:1/x",
        ),
        (["dev"], {"DAGSTER_HOME": "/nonexistent/dagster"}, "DAGSTER_HOME /nonexistent/dagster"),
        (["status"], {"INVENTORY_LEASE_SECONDS": "abc"}, "INVENTORY_LEASE_SECONDS must be"),
        (["refresh", "--limit", "0"], {}, "must be a positive whole number, got '0'"),
        (["refresh", "--limit", "1; DROP TABLE libraries"], {}, "must be a positive whole"),
        (["observe", "--limit", "-5"], {}, "must be a positive whole number"),
        (["dev", "--port", "99999"], {}, "must be a TCP port"),
        (["tmdb-key", "--language", "en'); DROP TABLE x; --"], {}, "must look like en or en-US"),
        (
            ["status"],
            {"INVENTORY_DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/x'; DROP DATABASE x"},
            "malformed database URL",
        ),
        (["status"], {"INVENTORY_TMDB_BASE_URL": "http://h/'; --?api_key=s3cret"}, "TMDb"),
        (  # a percent-encoded password holding @ / : stays hidden
            ["status"],
            {"INVENTORY_DATABASE_URL": "postgresql://u:hunter2%40s3cret%2Fw%3Ard@127.0.0.1:1/x"},
            "cannot connect to postgresql://u:***@127.0.0.1:1/x",
        ),
        (  # libpq names the malformed token: here it is the password
            ["migrate"],
            {"INVENTORY_DATABASE_URL": "postgresql://u:hunter2%zzs3cret@127.0.0.1:1/x"},
            "malformed database URL 'postgresql://u:***@127.0.0.1:1/x'",
        ),
    ],
)
def test_bad_input_is_one_line(args: list[str], env: dict[str, str], message: str) -> None:
    result = run(args, env)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr
    assert "s3cret" not in result.stderr


def test_demo_refresh_status_on_a_server(db_url: str, tmp_path: Path) -> None:
    env = {"INVENTORY_DATABASE_URL": db_url, "INVENTORY_DATA_DIR": str(tmp_path)}
    assert run(["migrate"], env).returncode == 0
    loaded = run(["demo"], env)
    assert loaded.returncode == 0 and "11 demo libraries loaded" in loaded.stdout
    assert "nothing loaded" in run(["demo"], env).stdout
    refreshed = run(["refresh"], env)
    assert refreshed.returncode == 0, refreshed.stderr
    assert "published" in refreshed.stdout and "removed" not in refreshed.stdout
    status = run(["status"], env)
    assert "dirty libraries      0" in status.stdout
    # With a URL configured no embedded server was started in the data folder.
    assert not (tmp_path / "pgdata").exists()


def test_tmdb_key_from_stdin_then_observe(db_url: str, tmp_path: Path) -> None:
    from inventory_pipeline.provider.standin import StandIn

    env = {"INVENTORY_DATABASE_URL": db_url, "INVENTORY_DATA_DIR": str(tmp_path)}
    with StandIn(api_key="cli-key-93be", missing_every=17) as standin:
        env["INVENTORY_TMDB_BASE_URL"] = standin.url
        env["INVENTORY_TMDB_RATE"] = "1000"
        assert run(["demo"], env).returncode == 0
        saved = subprocess.run(
            [sys.executable, "-m", "inventory_pipeline.cli", "tmdb-key"],
            input="cli-key-93be\n",
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert saved.returncode == 0 and "cli-key-93be" not in saved.stdout
        observed = run(["observe", "--limit", "2000"], env)
        assert observed.returncode == 0, observed.stderr
        assert "observed" in observed.stdout and "not_found" in observed.stdout
        assert "recovery case" in observed.stderr  # warnings for the new cases
        assert "cli-key-93be" not in observed.stdout + observed.stderr
        status = run(["status"], env)
        assert "TMDb key             active" in status.stdout
        # No authentication case waits for the key, so nothing probed it; said why.
        assert "(unverified: probed only when authentication cases wait for it)" in status.stdout
        assert "open recovery cases" in status.stdout
        # The oldest open cases by title, library and TMDb id.
        assert "  item " in status.stdout and " attempts, next " in status.stdout
        assert "TMDb admission" not in status.stdout
        # A throttling answer pauses admission: the operator sees for how long.
        standin.set_fault("throttle", retry_after="600")
        with connect(db_url) as conn:
            execute(conn, "UPDATE media_server_items SET observation_due_at = now()")
        throttled = run(["observe", "--limit", "50"], env)
        assert throttled.returncode == 0, throttled.stderr
        status = run(["status"], env)
        assert "TMDb admission       paused" in status.stdout


def test_bad_key_input_is_refused(db_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "inventory_pipeline.cli", "tmdb-key"],
        input="two words\n",
        env={**os.environ, "INVENTORY_DATABASE_URL": db_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "inventory-pipeline: error: the TMDb key must be one non-empty line without spaces"
    ]


def test_webserver_binds_to_loopback_by_default() -> None:
    from inventory_pipeline.cli import _parser

    assert _parser().parse_args(["dev"]).host == "127.0.0.1"


def save_key(db_url: str, key: str, *options: str) -> subprocess.CompletedProcess[str]:
    """`tmdb-key` with `key` on standard input; it must succeed."""
    saved = subprocess.run(
        [sys.executable, "-m", "inventory_pipeline.cli", "tmdb-key", *options],
        input=key + "\n",
        env={**os.environ, "INVENTORY_DATABASE_URL": db_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert saved.returncode == 0, saved.stderr
    return saved


def test_hostile_key_is_saved_verbatim(db_url: str) -> None:
    """The key reaches SQL only as a bound parameter: stored exactly, nothing else moved."""
    from inventory_pipeline.db import connect, fetch_one

    hostile = "k');DELETE/**/FROM/**/provider_settings;--\\x27$$"
    saved = save_key(db_url, hostile, "--language", "fr-FR")
    assert hostile not in saved.stdout + saved.stderr
    with connect(db_url) as conn:
        row = fetch_one(conn, "SELECT api_key, language, active FROM provider_settings")
    assert row == {"api_key": hostile, "language": "fr-FR", "active": True}


def test_a_new_key_without_a_language_keeps_the_saved_one(db_url: str) -> None:
    """Rotating the key alone changes the key alone."""
    from inventory_pipeline.db import connect, fetch_one

    save_key(db_url, "first-key", "--language", "fr-FR")
    save_key(db_url, "second-key")
    with connect(db_url) as conn:
        row = fetch_one(conn, "SELECT api_key, language FROM provider_settings")
    assert row == {"api_key": "second-key", "language": "fr-FR"}


@pytest.fixture
def empty_url(server_url: str) -> Iterator[str]:
    """A database nothing has migrated."""
    name = f"inventory_unmigrated_{uuid.uuid4().hex[:10]}"
    with connect(server_url) as admin:
        create_database(admin, name)
    try:
        yield url_with_database(server_url, name)
    finally:
        with connect(server_url) as admin:
            drop_database(admin, name)
            drop_database(admin, f"{name}_dagster")


DATA_COMMANDS = [
    ["status"],
    ["demo"],
    ["refresh"],
    ["observe", "--limit", "1"],
    ["mark-dirty"],
    ["tmdb-key"],
    ["stats", "settings"],
]


def ledger(url: str) -> list[int] | None:
    with connect(url) as conn:
        row = fetch_one(conn, "SELECT to_regclass('schema_migrations') IS NOT NULL AS present")
        if row is None or not row["present"]:
            return None
        return [r["version"] for r in fetch_all(conn, "SELECT version FROM schema_migrations")]


def test_data_commands_never_migrate(empty_url: str, tmp_path: Path) -> None:
    """Only `dev` and `migrate` migrate: the others say so in one line and change nothing,
    on an empty schema and on one a version behind."""
    env = {"INVENTORY_DATABASE_URL": empty_url, "INVENTORY_DATA_DIR": str(tmp_path)}
    for args in DATA_COMMANDS:
        result = run(args, env, stdin="some-key\n")
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert result.stderr.strip().splitlines() == [
            f"inventory-pipeline: error: the database schema is behind ({len(discover())} "
            "migrations pending, from 0001_inventory_system.sql); run `inventory-pipeline migrate`"
        ], args
        assert ledger(empty_url) is None
    with connect(empty_url) as conn:  # one version behind
        migrate(conn, copy_migrations(tmp_path, upto=discover()[-2].version))
    behind = ledger(empty_url)
    result = run(["status"], env)
    assert result.returncode == 1 and "run `inventory-pipeline migrate`" in result.stderr
    assert ledger(empty_url) == behind
    assert run(["migrate"], env).returncode == 0
    assert ledger(empty_url) == [m.version for m in discover()]
    assert run(["status"], env).returncode == 0


def test_data_command_on_a_new_embedded_folder(tmp_path: Path) -> None:
    """With the embedded default a data command starts the server it needs, does not
    migrate, and stops the server again."""
    env = {"INVENTORY_DATA_DIR": str(tmp_path)}
    result = run(["status"], env)
    assert result.returncode == 1
    assert "run `inventory-pipeline migrate`" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    postmaster = tmp_path / "pgdata" / "postmaster.pid"
    assert not postmaster.exists()  # the server was stopped
    assert run(["migrate"], env).returncode == 0
    assert run(["status"], env).returncode == 0
    assert not postmaster.exists()
