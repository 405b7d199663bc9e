"""`dev` as a server: one instance per data folder and Dagster instance, the port
checked before anything starts, and every process it started stopped on SIGINT,
SIGTERM or SIGHUP (a closed terminal).

Dagster's daemon and webserver each run in a process group of their own (the code
servers and runs they spawn join it), so stopping one means stopping its group. The
groups are recorded in the Dagster home; a `dev` that was killed outright (SIGKILL)
leaves them running, and the next `dev` on that home stops them before it starts.
The instance locks are `flock`s: the kernel releases them when their holder dies, so
a lock never outlives its process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import IO

import psutil

LOCK_FILE = "inventory-pipeline-dev.lock"
GROUPS_FILE = "inventory-pipeline-dev.groups.json"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SupervisorError(Exception):
    """`dev` cannot start or keep running."""


class Stopping(BaseException):
    """A stop signal arrived: unwind, stopping everything on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """While installed, SIGINT, SIGTERM and SIGHUP raise `Stopping` once; a second
    signal while stopping is ignored, so the clean-up it interrupted runs to its end.
    Inside `deferred()` a signal waits for the block to end (a child started but not
    yet recorded would otherwise escape the stop)."""

    def __init__(self) -> None:
        self.stopping = False
        self._pending: int | None = None
        self._deferring = 0

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stopping:
            return
        if self._deferring:
            self._pending = signum
            return
        self.stopping = True
        raise Stopping(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def unwinding(self) -> None:
        """From now on signals are ignored: the caller is already stopping."""
        self.stopping = True

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring and self._pending is not None and not self.stopping:
                self.stopping = True
                raise Stopping(self._pending)


@contextlib.contextmanager
def exclusive(folder: Path, what: str) -> Iterator[None]:
    """Hold `folder`'s dev lock, or refuse with one line naming the holder."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    handle: IO[str] = path.open("a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise SupervisorError(
                f"another `inventory-pipeline dev` (pid {holder}) is running on the {what} "
                f"{folder}; stop it first"
            ) from None
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on, before anything starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise SupervisorError(f"cannot use webserver address {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the webserver does
        try:
            probe.bind(address)
        except OSError:
            raise SupervisorError(
                f"port {port} on {host} is in use (another Dagster UI?); choose another with --port"
            ) from None


def _group_members(pgid: int) -> list[psutil.Process]:
    """The live members of a process group (an exited child not yet reaped is not)."""
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
    return members


def _is_dagster(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return any("dagster" in part for part in process.cmdline())
    return False


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def stop_groups(pgids: list[int], timeout: float = 20.0) -> None:
    """SIGTERM every group at once, SIGKILL what is left after `timeout`, and return
    once no member of any group is alive."""
    for pgid in pgids:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_group_members(pgid) for pgid in pgids):
        time.sleep(0.2)
    for pgid in pgids:
        _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_group_members(pgid) for pgid in pgids):
        time.sleep(0.1)


class Children:
    """Dagster processes started by this `dev`, each leading its own process group,
    recorded in the Dagster home until they are stopped."""

    def __init__(self, home: Path, signals: StopSignals) -> None:
        self._record = home / GROUPS_FILE
        self._signals = signals
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def recover(self) -> int:
        """Stop the Dagster groups a killed `dev` on this home left running (call with
        the home's lock held); returns how many groups were stopped."""
        try:
            recorded = [int(pgid) for pgid in json.loads(self._record.read_text())]
        except (OSError, ValueError, TypeError):
            recorded = []
        left = [pgid for pgid in recorded if any(map(_is_dagster, _group_members(pgid)))]
        if left:
            stop_groups(left)
        self._record.unlink(missing_ok=True)
        return len(left)

    def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        with self._signals.deferred():  # started means recorded, whatever arrives
            self.procs[name] = subprocess.Popen(command, env=env, start_new_session=True)
            self._record.write_text(json.dumps([proc.pid for proc in self.procs.values()]))

    def run(self, name: str, command: list[str], env: dict[str, str], timeout: float) -> None:
        """Run `command` to its end as a recorded group (a stop signal stops it too);
        raise with the last line it printed when it fails or outlives `timeout`."""
        with self._signals.deferred():
            proc = subprocess.Popen(
                command,
                env=env,
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            self.procs[name] = proc
            self._record.write_text(json.dumps([p.pid for p in self.procs.values()]))
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_groups([proc.pid])
            raise SupervisorError(f"{name} did not finish within {timeout:.0f} s") from None
        finally:
            if proc.poll() is not None:
                del self.procs[name]
                self._record.write_text(json.dumps([p.pid for p in self.procs.values()]))
        if proc.returncode != 0:
            lines = output.decode(errors="replace").strip().splitlines() or ["(no output)"]
            raise SupervisorError(f"{name} exited with code {proc.returncode}: {lines[-1]}")

    def exited(self) -> tuple[str, int] | None:
        """The first child that exited, with its exit code."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def stop(self) -> None:
        stop_groups([proc.pid for proc in self.procs.values()])
        for proc in self.procs.values():
            proc.wait()
        self._record.unlink(missing_ok=True)
        self.procs.clear()


def _listens_on(pid: int, port: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(
            conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
            for conn in psutil.Process(pid).net_connections(kind="inet")
        )
    return False


def wait_for_webserver(
    url: str, port: int, proc: subprocess.Popen[bytes], timeout: float = 120.0
) -> None:
    """Return once `proc` itself listens on `port` and the UI answers there (another
    instance's webserver on that port does not count)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SupervisorError(f"the Dagster webserver exited with code {proc.returncode}")
        if _listens_on(proc.pid, port):
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/server_info", timeout=2) as response:
                    if response.status == 200:
                        return
        time.sleep(0.5)
    raise SupervisorError(f"the Dagster webserver did not answer at {url} within {timeout:.0f} s")
