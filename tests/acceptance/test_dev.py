"""`dev` behaves like a server (real subprocesses, real signals): SIGINT, SIGTERM and
SIGHUP stop every process it started and the embedded PostgreSQL; a killed `dev` is
recovered by the next one; one `dev` per data folder and Dagster instance; a busy port
is refused before anything starts."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from chaos.servers import free_port
from inventory_pipeline import cli
from inventory_pipeline.db import connect
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.deployment import Deployment, dagster_storage_url, prepare_dagster_home
from inventory_pipeline.settings import Settings
from inventory_pipeline.supervisor import Children, StopSignals

pytestmark = pytest.mark.daemon

ANNOUNCED = "Dagster UI at"


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INVENTORY_", "DAGSTER_"))}
    env.update(extra)
    return env


class Dev:
    """One `inventory-pipeline dev` in a subprocess, its output in a file."""

    def __init__(self, data_dir: Path, port: int, log: Path) -> None:
        self.data_dir, self.port, self.log = data_dir, port, log
        self.seen: list[psutil.Process] = []  # for the clean-up after a failed test
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "inventory_pipeline.cli", "dev", "--port", str(port)],
                env=environment(INVENTORY_DATA_DIR=str(data_dir)),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_announced(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while ANNOUNCED not in self.output():
            assert self.proc.poll() is None, self.output()[-3000:]
            assert time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(0.3)
        self.tree()

    def tree(self) -> list[psutil.Process]:
        """Every process this `dev` started (daemon, webserver, their code servers)."""
        found = psutil.Process(self.proc.pid).children(recursive=True)
        self.seen += found
        return found

    def postgres(self) -> psutil.Process:
        pid = int((self.data_dir / "pgdata" / "postmaster.pid").read_text().split()[0])
        return psutil.Process(pid)

    def stop(self, signum: int, timeout: float = 60) -> int:
        self.proc.send_signal(signum)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(processes: list[psutil.Process], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(map(alive, processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, " ".join(p.cmdline())[:120]) for p in processes if alive(p)]
    assert left == [], left


@pytest.fixture
def devs(tmp_path: Path) -> Iterator[list[Dev]]:
    """The `dev`s a test started; whatever a failing test leaves running is killed."""
    started: list[Dev] = []
    yield started
    leftovers: list[psutil.Process] = []
    for dev in started:
        if dev.proc.poll() is None:
            dev.tree()
        leftovers += dev.seen
        dev.kill()
    for postmaster in tmp_path.glob("*/pgdata/postmaster.pid"):
        with contextlib.suppress(psutil.Error, ValueError, OSError):
            leftovers.append(psutil.Process(int(postmaster.read_text().split()[0])))
    for process in leftovers:
        with contextlib.suppress(psutil.Error):
            process.kill()


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_signal_stops_the_whole_tree(signum: int, tmp_path: Path, devs: list[Dev]) -> None:
    data = tmp_path / "data"
    dev = Dev(data, free_port(), tmp_path / "dev.log")
    devs.append(dev)
    dev.wait_announced()
    postgres = dev.postgres()
    assert len(dev.tree()) >= 2 and alive(postgres)  # daemon, webserver (+ code servers)
    # The daemon logs warnings and errors only: its INFO line for every sensor
    # evaluation made the terminal unreadable (`dev --verbose` keeps it).
    # It says how to reach the embedded database.
    [line] = [x for x in dev.output().splitlines() if "embedded PostgreSQL: " in x]
    psql = subprocess.run(
        [*shlex.split(line.split("embedded PostgreSQL: ", 1)[1]), "-Atc", "SELECT 42"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert psql.stdout.strip() == "42", psql.stderr
    [daemon] = [p for p in dev.tree() if "dagster._daemon" in p.cmdline()]
    assert "--log-level warning" in " ".join(daemon.cmdline())

    # A second `dev` on the same data folder (another port), or on the same Dagster
    # instance from another data folder, is refused with one line.
    for env, what in [
        ({"INVENTORY_DATA_DIR": str(data)}, "data folder"),
        (
            {
                "INVENTORY_DATA_DIR": str(tmp_path / "other"),
                "DAGSTER_HOME": str(data / "dagster_home"),
            },
            "Dagster instance",
        ),
    ]:
        second = subprocess.run(
            [sys.executable, "-m", "inventory_pipeline.cli", "dev", "--port", str(free_port())],
            env=environment(**env),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"is running on the {what}" in lines[0], second.stderr
        assert f"(pid {dev.proc.pid})" in lines[0]
        assert ANNOUNCED not in second.stdout
    assert not (tmp_path / "other" / "pgdata").exists()

    tree = dev.tree()  # with the code servers spawned meanwhile
    assert dev.stop(signum) == 0, dev.output()[-3000:]
    assert_all_gone([*tree, postgres])
    assert f"{signal.Signals(signum).name} received: stopped" in dev.output()


def test_killed_dev_is_recovered_by_the_next(tmp_path: Path, devs: list[Dev]) -> None:
    data, port = tmp_path / "data", free_port()
    first = Dev(data, port, tmp_path / "first.log")
    devs.append(first)
    first.wait_announced()
    orphans = first.tree()
    first.kill()  # SIGKILL: no clean-up ran; the webserver still holds the port
    assert any(map(alive, orphans))

    second = Dev(data, port, tmp_path / "second.log")
    devs.append(second)
    second.wait_announced()
    assert "stopped the Dagster processes a killed `dev` left running" in second.output()
    assert_all_gone(orphans, timeout=1)
    tree, postgres = second.tree(), second.postgres()
    assert second.stop(signal.SIGINT) == 0, second.output()[-3000:]  # Ctrl-C
    assert_all_gone([*tree, postgres])


def test_busy_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "inventory_pipeline.cli", "dev", "--port", str(port)],
            env=environment(INVENTORY_DATA_DIR=str(tmp_path)),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"inventory-pipeline: error: port {port} on 127.0.0.1 is in use (another Dagster UI?); "
        "choose another with --port"
    ]
    assert ANNOUNCED not in result.stdout
    assert not (tmp_path / "pgdata").exists()  # no server was started


class _Started(Exception):
    """Raised by the recording children once both Dagster processes were started."""


def test_dagster_storage_is_migrated_once_before_its_processes_start(
    server_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon and the webserver both create an empty storage's schema when they
    start; started side by side on a new storage they collide ("type job_ticks already
    exists") and `dev` exits. So the schema must exist before the first of them starts."""
    name = f"dagster_dev_{os.getpid()}_{time.monotonic_ns() % 10**9}"
    with connect(server_url) as admin:
        create_database(admin, name)
    storage = url_with_database(server_url, name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    prepare_dagster_home(Settings.from_env({}), {"DAGSTER_HOME": str(home)})
    tables_at_start: dict[str, int] = {}

    class Recording(Children):
        def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
            with connect(storage) as conn:
                row = conn.execute(
                    "SELECT count(*) AS n FROM pg_tables WHERE schemaname = 'public' "
                    "AND tablename IN ('runs', 'job_ticks', 'event_logs')"
                ).fetchone()
            tables_at_start[name] = int(row["n"]) if row else 0
            if len(tables_at_start) == 2:
                raise _Started

    args = cli._parser().parse_args(["dev", "--port", str(free_port())])
    try:
        with pytest.raises(_Started):
            cli._run_dagster(
                args,
                home,
                Deployment(server_url, dagster_storage_url(storage), None),
                Recording(home, StopSignals()),
            )
    finally:
        with connect(server_url) as admin:
            drop_database(admin, name)
    assert tables_at_start == {"daemon": 3, "webserver": 3}
