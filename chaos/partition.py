"""The harness on separate hosts, with faults of the network instead of the process.

`python -m chaos --network short|long` runs the same workload, workers, Dagster share
and checks as every chaos run, laid out as hosts (chaos/netns.py): PostgreSQL on a host
of its own; the harness's workers split between two worker hosts, each reaching the
TMDb stand-in on its own loopback; the Dagster deployment of deploy/ (a code server and
the daemon, whose runs the code server starts) on a third. The harness itself (the
workload, the operator, the checks) reaches the database over its Unix socket, so no
fault touches it. Process faults and the server restart are left out: every fault is
the network's, made in the router, which tells neither end anything.

The faults (PLANS), each at a fixed point of the run, one host at a time:
- cut: drop every packet to and from a host, timed to catch it claiming, or one of its
  stats workers holding a claim (computing, or publishing; the holder frozen until the
  cut is in place, so it still holds the claim when the cut begins); 45 s (longer than
  a lease and than the server's bound) or 10 s (longer than a lease only), then heal;
- degrade: lose a share of what a host sends and delay every packet both ways;
- lose: freeze a host's processes and delete its link and namespace for good.

For each fault the run measures (FaultRecord): detection, the time until the server
held no session of the host (its transactions rolled back, its locks released);
takeover, until the host held none of the stats runs and profile requests it held
(another host took them, or the database took them back); finished, until each was done
by whoever; the lapses of its leases the ledger recorded (what `status` shows); rejoin,
after a heal, until the host published or acknowledged again. The bound the checks
apply comes from the product's connection settings (db/connection.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chaos import netns
from chaos.config import DAEMON_ENV, DAEMON_STOPPED_SENSORS
from chaos.daemon import Daemon
from chaos.servers import Server
from inventory_pipeline.db import Connection, DatabaseError, connect, fetch_all, fetch_one
from inventory_pipeline.db.connection import (
    CLIENT_CONNECTION_CHECK_MS,
    IDLE_IN_TRANSACTION_MS,
    KEEPALIVES,
    database_name,
)
from inventory_pipeline.deployment import (
    DAEMON_COMMAND,
    INSTANCE_MIGRATE_COMMAND,
    dagster_storage_url,
    start_dagster,
    stop_dagster,
)
from inventory_pipeline.provider.standin import StandIn

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
WORKER_HOSTS = ("wa", "wb")
DAGSTER_HOST = "dagster"
CODE_SERVER_PORT = 4266

# The server's bound on a silent client, from the product's connection settings: the
# last unanswered keepalive probe (or the TCP user timeout, for data it sent), then at
# most one client-connection check, or the idle-in-transaction timeout, whichever ends
# the session first; plus a margin for a loaded machine.
KEEPALIVE_BOUND_SECONDS = int(KEEPALIVES["keepalives_idle"]) + int(
    KEEPALIVES["keepalives_interval"]
) * int(KEEPALIVES["keepalives_count"])
SERVER_BOUND_SECONDS = (
    min(
        max(KEEPALIVE_BOUND_SECONDS, int(KEEPALIVES["tcp_user_timeout"]) / 1000)
        + CLIENT_CONNECTION_CHECK_MS / 1000,
        max(IDLE_IN_TRANSACTION_MS / 1000, int(KEEPALIVES["tcp_user_timeout"]) / 1000),
    )
    + 10
)
# A cut outlasts the bound, so both ends give up before it heals.
CUT_SECONDS = 45.0
# A short cut: past the chaos leases (3 s), inside the bound, so the host's sessions
# survive it and whatever it sends after the heal meets the fences.
SHORT_CUT_SECONDS = 10.0
DEGRADE_SECONDS = 60.0
DEGRADE_LOSS_PERCENT = 30  # of what the host sends; none of what it receives
DEGRADE_DELAY_SECONDS = 1.0  # each way: 2 s more per round trip
MOMENT_LOOK_SECONDS = 20.0  # how long a cut waits for its moment before cutting anyway
REJOIN_SECONDS = 90.0
IN_FLIGHT_SECONDS = 0.5
STATS_WORKERS = "'^chaos[.](stats|drainer)[.][0-9]+$'"


@dataclass(frozen=True)
class Fault:
    kind: str  # cut, degrade, lose
    host: str
    at: float  # fraction of the run's operations
    seconds: float = 0.0  # until the heal (cut, degrade)
    # When to strike: "claiming" (a claim statement of the host's running on the server),
    # "computing" or "publishing" (a stats claim of the host's in that phase), or "any".
    moment: str = "any"


PLANS: dict[str, tuple[Fault, ...]] = {
    # CI: one partition of one worker host, one heal; the workload goes on for a while
    # after the heal (a cut strikes by 8 + 20 s, heals 45 s later), so the host has work
    # to come back to.
    "short": (Fault("cut", "wa", 0.1, CUT_SECONDS, "computing"),),
    # One after the other over a run of PLAN_SECONDS["long"], so one host at a time is
    # faulty and the others can take its work over.
    "long": (
        Fault("cut", "wa", 0.03, CUT_SECONDS, "claiming"),
        Fault("cut", "wb", 0.2, SHORT_CUT_SECONDS, "publishing"),
        Fault("cut", "wa", 0.27, CUT_SECONDS, "computing"),
        Fault("cut", DAGSTER_HOST, 0.45, CUT_SECONDS),
        Fault("degrade", "wa", 0.63, DEGRADE_SECONDS),
        Fault("lose", "wb", 0.85),
    ),
}
# The run length each plan needs (the default of --seconds).
PLAN_SECONDS = {"short": 80.0, "long": 420.0}


@dataclass
class FaultRecord:
    fault: Fault
    started: float = 0.0  # epoch seconds
    ended: float = 0.0
    moment: str = "-"  # what the host was doing when it struck
    held: int = 0  # stats runs and profile requests the host held once it struck
    held_runs: int = 0  # of which stats runs
    detection: float | None = None  # until the server held no session of the host
    takeover: float | None = None  # until the host held none of them any more
    finished: float | None = None  # until each of them was done (by whoever)
    lapses: int = 0  # the ledger's lapses of the host's stats leases during the window
    rejoin: float | None = None  # after the heal, until the host completed work again
    sessions_at_start: int = 0
    error: str | None = None  # the harness's own failure while injecting it
    left_held: int = 0  # live stats leases of the host when the fault's window ended
    unfinished: list[str] = field(default_factory=list)  # held work not taken over, why

    def line(self) -> str:
        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f} s"

        f = self.fault
        length = f" for {f.seconds:.0f} s" if f.seconds else ""
        return (
            f"{f.kind} {f.host}{length} ({self.moment}; {self.sessions_at_start} sessions,"
            f" {self.held_runs} stats runs and {self.held - self.held_runs} profile requests"
            f" held): detection {seconds(self.detection)},"
            f" takeover {seconds(self.takeover)}, finished {seconds(self.finished)},"
            f" rejoin {seconds(self.rejoin)}; {self.lapses} lapses recorded"
        )


class NetworkServer(Server):
    """A cluster on a host of its own: the harness's URLs use its Unix socket, the
    hosts' URLs its address (`remote`)."""

    def __init__(self, cluster: netns.ClusterHost) -> None:
        self.cluster = cluster
        super().__init__(cluster.local_url(), restartable=False)

    def remote(self, url: str) -> str:
        return self.cluster.url(database_name(url))

    def stop(self) -> None:
        self.cluster.stop()


@dataclass
class Site:
    """The hosts of a run and its fault plan; `close()` removes them."""

    plan_name: str
    plan: tuple[Fault, ...]
    network: netns.Network = field(default_factory=netns.Network)
    hosts: dict[str, netns.Host] = field(default_factory=dict)
    server: NetworkServer | None = None
    provider_urls: dict[str, str] = field(default_factory=dict)
    records: list[FaultRecord] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def create(cls, plan: str, bindir: Path) -> Site:
        site = cls(plan, PLANS[plan])
        try:
            pg = site.network.add_host("pg")
            for name in (*WORKER_HOSTS, DAGSTER_HOST):
                site.hosts[name] = site.network.add_host(name)
            site.server = NetworkServer(netns.ClusterHost(site.network, pg, bindir))
        except BaseException:
            site.close()
            raise
        return site

    def serve(self, standin: StandIn) -> None:
        """The stand-in's state on every host's own loopback."""
        for name, host in self.hosts.items():
            self.provider_urls[name] = netns.inside(host, standin.also_listen)

    def host_of(self, index: int) -> str:
        return WORKER_HOSTS[index % len(WORKER_HOSTS)]

    def place(self, host: str, argv: list[str]) -> list[str]:
        return self.network.command(self.hosts[host], argv)

    def lost(self, host: str) -> bool:
        return self.hosts[host].lost

    def finish(self) -> list[FaultRecord]:
        """Wait for every fault to end (healed, and the host back at work)."""
        for thread in self.threads:
            thread.join()
        return self.records

    def close(self) -> None:
        try:
            if self.server is not None:
                self.server.stop()
        finally:
            self.network.close()

    # The faults

    def due(self, op: int, total: int) -> list[Fault]:
        return [f for f in self.plan if int(total * f.at) == op]

    def inject(self, fault: Fault, local_url: str, pids: Sequence[int]) -> FaultRecord:
        """Start `fault` in a thread of its own (the workload goes on); its record
        fills in as it runs."""
        record = FaultRecord(fault)
        self.records.append(record)
        thread = threading.Thread(
            target=self._run_fault, args=(record, local_url, list(pids)), daemon=True
        )
        self.threads.append(thread)
        thread.start()
        return record

    def _run_fault(self, record: FaultRecord, url: str, pids: list[int]) -> None:
        fault, host = record.fault, self.hosts[record.fault.host]
        try:
            with connect(url, application_name="chaos.harness") as conn:
                record.moment, frozen = _await_moment(conn, fault.moment, pids)
                try:
                    record.started = time.time()
                    if fault.kind == "cut":
                        self.network.cut(host)
                    elif fault.kind == "degrade":
                        self.network.degrade(host, DEGRADE_LOSS_PERCENT, DEGRADE_DELAY_SECONDS)
                    else:
                        self.network.lose(host)
                finally:
                    if fault.kind != "lose":  # a lost host's processes stay frozen
                        _thaw(frozen)
                # What the host holds once nothing it sent before the fault can still
                # land (a commit in flight as it struck is the host's own finish).
                time.sleep(IN_FLIGHT_SECONDS)
                held = _held(conn, pids)
                record.held, record.held_runs = len(held), len(held.runs)
                record.sessions_at_start = _sessions(conn, host.address)
                window = fault.seconds or SERVER_BOUND_SECONDS + 30
                while time.time() - record.started < window:
                    now = time.time() - record.started
                    if record.detection is None and _sessions(conn, host.address) == 0:
                        record.detection = now
                    if record.takeover is None and _taken_over(conn, held, pids):
                        record.takeover = now
                    if record.finished is None and _finished(conn, held):
                        record.finished = now
                    time.sleep(0.25)
                record.lapses = _lapses(conn, pids, held, record.started)
                if fault.kind != "degrade":
                    record.left_held = _still_held(conn, pids)
                if record.takeover is None and len(held):
                    record.unfinished = _unfinished(conn, held)
                if fault.kind != "lose":
                    self.network.heal(host)
                record.ended = time.time()
                if fault.kind != "lose":
                    record.rejoin = _await_rejoin(conn, pids, record.ended)
        except Exception as exc:  # the run reports it; the host must not stay cut
            record.error = f"{type(exc).__name__}: {exc}"
            if fault.kind != "lose" and not host.lost:
                self.network.heal(host)


@dataclass(frozen=True)
class Held:
    """What a host's workers held when a fault struck (live leases): stats runs they had
    claimed, and profile requests with the lease token they held."""

    runs: tuple[int, ...] = ()
    requests: tuple[tuple[int, str], ...] = ()

    def __len__(self) -> int:
        return len(self.runs) + len(self.requests)


# A stats claim of the host's, live, in a phase, and whether its worker is in a
# transaction (the moment a cut waits for).
LIVE_CLAIMS = (
    "SELECT r.id, r.phase, r.lock_owner, bool_or(a.xact_start IS NOT NULL) AS in_transaction"
    " FROM user_stats_projection_runs r LEFT JOIN pg_stat_activity a"
    "   ON r.lock_owner = 'chaos-' || substring(a.application_name FROM '[.]([0-9]+)$')"
    f"  AND a.application_name ~ {STATS_WORKERS}"
    " WHERE r.phase IN ('claimed', 'computed') AND r.lease_until > now()"
    " AND r.lock_owner = ANY(%(owners)s) GROUP BY r.id, r.phase, r.lock_owner"
)
# The caught claim, still its holder's in its phase with a second of lease left once the
# frozen holder's last words have landed.
STILL_CAUGHT = (
    "SELECT 1 FROM user_stats_projection_runs WHERE id = %(id)s AND phase = %(phase)s"
    " AND lock_owner = %(owner)s AND lease_until > now() + interval '1 second'"
)
# What the host holds: its stats claims and its profile requests' leases (run out or not:
# until another host or the database takes them, they are its).
HELD_RUNS = (
    "SELECT id FROM user_stats_projection_runs"
    " WHERE phase IN ('claimed', 'computed') AND lock_owner = ANY(%(owners)s)"
)
HELD_REQUESTS = (
    "SELECT DISTINCT r.id, r.lease_token::text AS token FROM profile_refresh_requests r"
    " JOIN chaos_profile_claims c ON c.request_id = r.id AND c.lease_token = r.lease_token"
    " WHERE r.status = 'running' AND c.actor LIKE ANY(%(like)s)"
)
# A claim statement of the host's running on the server (stats, profile, observation
# or probe claims all name their claim).
CLAIMING = (
    "SELECT pid FROM pg_stat_activity WHERE state = 'active' AND application_name LIKE"
    " ANY(%(like)s) AND query ILIKE '%%claim%%' LIMIT 1"
)
# How many of the held are still the host's: a run still claimed or computed under its
# lock owner, a request still running under its lease token.
STILL_THE_HOSTS = (
    "SELECT (SELECT count(*) FROM user_stats_projection_runs"
    "   WHERE id = ANY(%(runs)s) AND phase IN ('claimed', 'computed')"
    "   AND lock_owner = ANY(%(owners)s))"
    " + (SELECT count(*) FROM profile_refresh_requests r"
    "   JOIN unnest(%(request_ids)s::bigint[], %(tokens)s::uuid[]) AS h(id, token)"
    "   ON h.id = r.id WHERE r.status = 'running' AND r.lease_token = h.token) AS n"
)


def _owners(pids: list[int]) -> list[str]:
    return [f"chaos-{pid}" for pid in pids]


def _await_moment(conn: Connection, moment: str, pids: list[int]) -> tuple[str, int | None]:
    """Wait (a bounded time) until the host runs a claim statement ("claiming"), or one
    of its stats workers holds a live claim in the wanted phase: "computing" (claimed,
    not yet computed) or "publishing" (computed, not yet published). Returns what was
    caught and, for a phase, the holder's pid, frozen (SIGSTOP) so the fault strikes
    while it still holds the claim: it is caught only once its last words have landed
    and the claim is still its own. The caller thaws it once the fault is in place."""
    if moment == "any":
        return "any moment", None
    phase = {"computing": "claimed", "publishing": "computed"}.get(moment)
    deadline = time.monotonic() + MOMENT_LOOK_SECONDS
    while time.monotonic() < deadline:
        if moment == "claiming":
            if fetch_one(conn, CLAIMING, {"like": [f"chaos.%.{pid}" for pid in pids]}):
                return "claiming, in a transaction", None
        else:
            runs = fetch_all(conn, LIVE_CLAIMS, {"owners": _owners(pids)})
            for run in (r for r in runs if r["phase"] == phase):
                holder = int(str(run["lock_owner"]).removeprefix("chaos-"))
                try:
                    os.kill(holder, signal.SIGSTOP)
                except ProcessLookupError:
                    continue
                try:
                    time.sleep(IN_FLIGHT_SECONDS)
                    caught = {"id": run["id"], "phase": phase, "owner": run["lock_owner"]}
                    still = fetch_one(conn, STILL_CAUGHT, caught) is not None
                except BaseException:
                    _thaw(holder)
                    raise
                if not still:
                    _thaw(holder)  # it finished meanwhile, or lost the claim
                    continue
                where = "in a transaction" if run["in_transaction"] else "between them"
                return f"{moment}, {where}", holder
        time.sleep(0.005)
    return f"no claim {moment} caught in {MOMENT_LOOK_SECONDS:.0f} s", None


def _thaw(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _held(conn: Connection, pids: list[int]) -> Held:
    runs = fetch_all(conn, HELD_RUNS, {"owners": _owners(pids)})
    requests = fetch_all(conn, HELD_REQUESTS, {"like": [f"chaos.%.{pid}" for pid in pids]})
    return Held(tuple(r["id"] for r in runs), tuple((r["id"], r["token"]) for r in requests))


def _taken_over(conn: Connection, held: Held, pids: list[int]) -> bool:
    """Does the host hold none of what it held any more (another host took it, or the
    database took it back)? It cannot finish anything itself while it is cut off."""
    if not len(held):
        return False
    row = fetch_one(
        conn,
        STILL_THE_HOSTS,
        {
            "runs": list(held.runs),
            "owners": _owners(pids),
            "request_ids": [request for request, _ in held.requests],
            "tokens": [token for _, token in held.requests],
        },
    )
    return row is not None and int(row["n"]) == 0


def _finished(conn: Connection, held: Held) -> bool:
    """Is every held run past its claim (published, failed, superseded: by whoever) and
    every held request ended?"""
    if not len(held):
        return False
    row = fetch_one(
        conn,
        "SELECT (SELECT count(*) FROM user_stats_projection_runs"
        "   WHERE id = ANY(%(runs)s) AND phase IN ('claimed', 'computed'))"
        " + (SELECT count(*) FROM profile_refresh_requests"
        "   WHERE id = ANY(%(requests)s) AND status IN ('pending', 'running')) AS n",
        {"runs": list(held.runs), "requests": [request for request, _ in held.requests]},
    )
    return row is not None and int(row["n"]) == 0


def _lapses(conn: Connection, pids: list[int], held: Held, since: float) -> int:
    """Lapses the ledger recorded since `since` (what `inventory-pipeline status` lists)
    of the host's leases: its stats workers' claims (by lock owner) and the profile
    requests it held (by lease token)."""
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM lapsed_leases WHERE taken_at >= to_timestamp(%(since)s)"
        " AND ((kind = 'stats run' AND holder = ANY(%(owners)s))"
        "   OR (kind = 'profile request' AND holder = ANY(%(tokens)s)))",
        {
            "owners": _owners(pids),
            "tokens": [f"token {token[:8]}" for _, token in held.requests],
            "since": since,
        },
    )
    return int(row["n"]) if row else 0


def _unfinished(conn: Connection, held: Held) -> list[str]:
    """Each held run as it stands, for a report."""
    rows = fetch_all(
        conn,
        "SELECT id, user_id, phase, lock_owner, attempts, lease_until, retry_not_before"
        " FROM user_stats_projection_runs WHERE id = ANY(%s)",
        (list(held.runs),),
    )
    return [f"run {r}" for r in rows]


def _still_held(conn: Connection, pids: list[int]) -> int:
    """Live stats leases (claims, and the slots they fill under the cap) of the host's
    workers."""
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM user_stats_projection_runs"
        " WHERE lease_until > now() AND lock_owner = ANY(%(owners)s)",
        {"owners": _owners(pids)},
    )
    return int(row["n"]) if row else 0


def _sessions(conn: Connection, address: str) -> int:
    row = fetch_one(
        conn,
        "SELECT count(*) AS n FROM pg_stat_activity WHERE client_addr = %s::inet",
        (address,),
    )
    return int(row["n"]) if row else 0


# Whose work shows that a host works again: its workers' (by process id), or for the
# Dagster host its runs' (every session that is not the harness's).
BY_HOST = "actor LIKE ANY(%(like)s)"
BY_DAGSTER = "actor NOT LIKE 'chaos.%%'"


def _await_rejoin(conn: Connection, pids: list[int], since: float) -> float | None:
    """Seconds after `since` until the host published stats or acknowledged a profile
    request (its processes reconnect after the heal; Dagster's sensors launch runs)."""
    started = time.time()
    by = BY_HOST if pids else BY_DAGSTER
    while time.time() - started < REJOIN_SECONDS:
        row = fetch_one(
            conn,
            "SELECT (SELECT count(*) FROM chaos_stats_publications WHERE published_at >="
            f" to_timestamp(%(since)s) AND {by})"
            " + (SELECT count(*) FROM chaos_profile_acks WHERE acked_at >="
            f" to_timestamp(%(since)s) AND {by}) AS n",
            {"since": since, "like": [f"chaos.%.{pid}" for pid in pids]},
        )
        if row is not None and row["n"]:
            return time.time() - since
        time.sleep(0.5)
    return None


def fault_divergences(records: list[FaultRecord], planned: int) -> list[str]:
    """A planned fault that never struck. A host cut off for longer than the server's
    bound, or lost: its sessions not ended within the bound, what it held not taken over
    while it was gone, stats leases of its still live at the window's end. A healed
    worker host that never worked again. (A cut shorter than the bound heals before the
    server ends the host's sessions: what it holds in an open transaction stays its own
    until then, and what it sends after the heal meets the fences: the run's checks.)"""
    out = []
    struck = sum(1 for r in records if r.started)
    if len(records) != planned or struck != planned:
        out.append(f"{planned} network faults planned, {struck} struck")
    for record in records:
        f, line = record.fault, record.line()
        if record.error is not None:
            out.append(f"{f.kind} {f.host}: the harness failed injecting it: {record.error}")
        outlasts_bound = f.kind == "lose" or (f.kind == "cut" and f.seconds > SERVER_BOUND_SECONDS)
        if outlasts_bound and (record.detection is None or record.detection > SERVER_BOUND_SECONDS):
            out.append(
                f"{f.kind} {f.host}: the server still held its sessions after"
                f" {SERVER_BOUND_SECONDS:.0f} s ({line})"
            )
        if outlasts_bound and record.held and record.takeover is None:
            out.append(f"{f.kind} {f.host}: what it held was not taken over ({line})")
            out.extend(f"  {unfinished}" for unfinished in record.unfinished)
        if outlasts_bound and record.left_held:
            out.append(
                f"{f.kind} {f.host}: {record.left_held} stats leases of its still live at the"
                f" window's end ({line})"
            )
        if f.kind != "lose" and record.rejoin is None:
            out.append(f"{f.kind} {f.host}: never worked again after the heal ({line})")
    return out


class DeployedDagster(Daemon):
    """The Dagster deployment of deploy/ on a host of its own: a code server (which
    starts the runs, DefaultRunLauncher) and the daemon reaching it through
    deploy/workspace.yaml, each with a DAGSTER_HOME holding deploy/dagster.yaml. Its
    processes reach PostgreSQL over the host's link; the harness reads the storage over
    the Unix socket (`Daemon`'s readers)."""

    def __init__(
        self, site: Site, admin_url: str, app_url: str, standin_url: str, folder: Path
    ) -> None:
        super().__init__(admin_url, app_url, standin_url, folder)
        assert site.server is not None
        self.site = site
        self.host = site.hosts[DAGSTER_HOST]
        base = {k: v for k, v in os.environ.items() if not k.startswith(("INVENTORY_", "DAGSTER_"))}
        storage = dagster_storage_url(site.server.remote(self.storage_url))
        self.code_env = {
            **base,
            "PYTHONPATH": str(ROOT),
            "DAGSTER_HOME": self._home("code_server"),
            "INVENTORY_DATABASE_URL": site.server.remote(app_url),
            "INVENTORY_DAGSTER_STORAGE_URL": storage,
            "INVENTORY_TMDB_BASE_URL": site.provider_urls[DAGSTER_HOST],
            **DAEMON_ENV,
        }
        self.control_env = {
            **base,
            "INVENTORY_DAGSTER_STORAGE_URL": storage,
            "INVENTORY_CODE_SERVER_HOST": "127.0.0.1",
            "INVENTORY_CODE_SERVER_PORT": str(CODE_SERVER_PORT),
        }
        self.code_server: subprocess.Popen[bytes] | None = None

    def _home(self, name: str) -> str:
        home = self.home / name
        home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(DEPLOY / "dagster.yaml", home / "dagster.yaml")
        return str(home)

    def _there(self, argv: Sequence[str]) -> list[str]:
        return self.site.network.command(self.host, list(argv))

    def start(self) -> None:
        from inventory_pipeline.db.connection import create_database

        with connect(self.admin_url) as admin:
            create_database(admin, self.database)
        workspace = ["-w", str(DEPLOY / "workspace.yaml")]
        with self.log.open("ab") as log:
            self.code_server = start_dagster(
                self._there(
                    [
                        sys.executable,
                        "-m",
                        "dagster",
                        "code-server",
                        "start",
                        "-m",
                        "inventory_pipeline.definitions",
                        "-h",
                        "127.0.0.1",
                        "-p",
                        str(CODE_SERVER_PORT),
                        "--location-name",
                        "inventory_pipeline",
                        "--use-python-environment-entry-point",
                    ]
                ),
                self.code_env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        control = {**self.control_env, "DAGSTER_HOME": self._home("deploy")}
        self._step([*INSTANCE_MIGRATE_COMMAND], control)
        for name in DAEMON_STOPPED_SENSORS:  # the code server answers once loaded
            deadline = time.monotonic() + 120
            while (
                self._step(
                    ["-m", "dagster", "sensor", "stop", name, *workspace],
                    control,
                    check=time.monotonic() > deadline,
                )
                != 0
            ):
                time.sleep(2)
        with self.log.open("ab") as log:
            self.process = start_dagster(
                self._there([*DAEMON_COMMAND, "run", *workspace]),
                {**self.control_env, "DAGSTER_HOME": self._home("daemon")},
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _step(self, argv: list[str], env: dict[str, str], check: bool = True) -> int:
        command = argv if argv[0] == sys.executable else [sys.executable, *argv]
        done = subprocess.run(
            self._there(command),
            env=env,
            cwd=ROOT,
            capture_output=True,
            timeout=180,
            check=False,
        )
        if done.returncode != 0 and check:
            raise RuntimeError(f"{' '.join(argv[:4])}: {done.stderr.decode()[-400:]}")
        return done.returncode

    def alive(self) -> bool:
        if self.site.hosts[DAGSTER_HOST].lost:
            return True
        return super().alive() and self.code_server is not None and self.code_server.poll() is None

    def stop(self) -> None:
        if self.code_server is not None:
            stop_dagster(self.code_server)
            self.code_server = None
        try:
            super().stop()
        except DatabaseError:
            pass


def remote(site: Site, url: str) -> str:
    assert site.server is not None
    return site.server.remote(url)


__all__ = [
    "PLANS",
    "PLAN_SECONDS",
    "DeployedDagster",
    "Fault",
    "FaultRecord",
    "NetworkServer",
    "Site",
    "fault_divergences",
    "remote",
]
