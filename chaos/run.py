"""One harness run: a scratch database, a TMDb stand-in, worker processes (and, when
asked, the real Dagster daemon), the seeded workload with kills, pauses, session
terminations and server restarts, quiescence, a full stats rebuild, and the checks.

Replay: the operations, their order and the fault schedule are a pure function of the
seed and the run length (the op count), so `python -m chaos --seed N --seconds S`
repeats a failing run's inputs exactly. What the OS scheduler does between processes is
not replayable; that is the point of running many seeds.
"""

from __future__ import annotations

import functools
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from chaos import invariants, oracle, replacements, stats_oracle
from chaos.config import (
    ACK_RATE_WINDOW_SECONDS,
    ADMISSION_MARGIN,
    ADMISSION_RATE,
    API_KEY,
    AUTH_BACKLOG_AT,
    BACKLOG_AT,
    BOMB_AT,
    CANCEL_AT,
    CLAIM_KILL_CHANCE,
    CLAIM_KILL_LOOKS,
    COMPRESS_AT,
    DAEMON_FIRST_ACK_SECONDS,
    DIRTY_DRAIN_MARGIN,
    EMPTY_USER_AT,
    EXPECTED_SQLSTATE_CLASSES,
    EXPECTED_SQLSTATES,
    EXPECTED_WITHOUT_SQLSTATE,
    FAULTS_OWED_AT,
    KILL_CHANCE,
    LATE_AUTH_RELEASE_SECONDS,
    LIBRARY_HOLD_AT,
    MAX_DIRTY_SECONDS,
    MAX_QUIESCE_SECONDS,
    MAX_RECLAIM_SHARE,
    MAX_STORM_REQUESTS,
    MAX_TERMINAL_FAILURES,
    MAX_UNPLANNED_EXITS,
    MAX_WORKER_ERRORS_PER_MINUTE,
    MERGE_AT,
    MERGES_AT_ONCE,
    OPS_PER_SECOND,
    PAUSE_CHANCE,
    PAUSE_SECONDS,
    PUBLICATION_LOCK_WAIT_AT,
    REBUILD_AT,
    RESTART_AT,
    SQUEEZE_AT,
    SQUEEZED_COMPUTE_BUDGET_MS,
    STATS_SETTINGS,
    STORM_AT,
    TERMINATE_CHANCE,
    WAKEUP_RELEASE_LIMIT,
    WAKEUP_SPACING_SECONDS,
    WAKEUP_WARMUP_SECONDS,
    WORKERS,
    WRONG_KEY,
)
from chaos.daemon import Daemon, dagster_divergences
from chaos.partition import WORKER_HOSTS, DeployedDagster, Site, fault_divergences, remote
from chaos.servers import Server
from chaos.worker import ROLES, application_name
from chaos.workload import BOMB, FAULTS, Workload, drop_writer_role
from inventory_pipeline.cli import lease_lines
from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    connect,
    execute,
    fetch_all,
    fetch_one,
)
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.db.migrator import migrate
from inventory_pipeline.leases import service as leases
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.standin import StandIn, encoded
from inventory_pipeline.stats import runbook, service
from tests.factories import tables_containing

ROOT = Path(__file__).resolve().parents[1]
# `role: Type [SQLSTATE]: message`, the SQLSTATE only when the server sent one.
ERROR_LINE = re.compile(r"^(?P<role>[a-z]+): (?P<type>\w+)(?: \[(?P<code>[0-9A-Z]{5})\])?: ")
DEADLOCK = "40P01"


def _expected(line: str) -> bool:
    """A worker's error line naming an error it recovers from, judged by SQLSTATE (or,
    without one, by type); anything else (a deadlock, a constraint or SQL error, a
    traceback of a crash) is not."""
    match = ERROR_LINE.match(line)
    if match is None:
        return False
    code = match["code"]
    if code is not None:
        return code in EXPECTED_SQLSTATES or code.startswith(EXPECTED_SQLSTATE_CLASSES)
    return match["type"] in EXPECTED_WITHOUT_SQLSTATE


def judge_errors(lines: Counter[str]) -> list[str]:
    """Worker error lines that fail the run: deadlocks first, then anything unexpected."""
    out = [f"deadlock in a worker: {line}" for line in lines if f"[{DEADLOCK}]" in line]
    out += [
        f"worker error: {line}"
        for line in lines
        if f"[{DEADLOCK}]" not in line and not _expected(line)
    ]
    return out


@dataclass
class Worker:
    role: str
    log: Path
    process: subprocess.Popen[bytes] | None = None
    pause: threading.Timer | None = None  # set while stopped: the timer that resumes it
    host: str | None = None  # its host, on separate hosts (chaos/partition.py)


@dataclass
class Report:
    seed: int
    seconds: float
    daemon: bool = False
    operations: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    unexpected_refusals: Counter[str] = field(default_factory=Counter)
    unsupported: Counter[str] = field(default_factory=Counter)
    runs: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    pauses: Counter[str] = field(default_factory=Counter)
    terminations: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    exits: Counter[str] = field(default_factory=Counter)
    audit: dict[str, int] = field(default_factory=dict)
    worker_errors: Counter[str] = field(default_factory=Counter)
    quiesce_seconds: float = 0.0
    waited: dict[str, float] = field(default_factory=dict)  # kind -> last outstanding at
    dirty_seconds: float = 0.0
    dirty_peak: int = 0  # the most active libraries dirty at once
    ack_rate: float = 0.0  # the best acknowledgements per second over a window
    storms: list[int] = field(default_factory=list)
    arrivals: Counter[int] = field(default_factory=Counter)  # at the stand-in, per second
    dagster_runs: Counter[str] = field(default_factory=Counter)
    dagster_first: float | None = None  # seconds until Dagster first acknowledged and published
    dagster_share: dict[str, int] = field(default_factory=dict)  # what Dagster's runs did
    dagster_failed: list[str] = field(default_factory=list)  # its failed runs, with errors
    # Stats workers killed (SIGKILL or terminated) while they held a live claim, by
    # whether the kill caught them inside a transaction.
    claim_kills: Counter[str] = field(default_factory=Counter)
    # Stage calls the harness cancelled, by stage; publications that waited on a held
    # state row, by how they ended.
    cancels: Counter[str] = field(default_factory=Counter)
    lock_waits: Counter[str] = field(default_factory=Counter)
    # Libraries a sync program held past an observation's completion, by how the held
    # claim ended; interrupted observations given back (the audit's count); answers the
    # stand-in sent gzip-coded.
    library_holds: Counter[str] = field(default_factory=Counter)
    interrupted: int = 0
    compressed: int = 0
    bombs: int = 0
    squeezes: int = 0
    edits_during_compute: int = 0
    exhausted_retried: int = 0  # by the runbook while settling
    merges: Counter[str] = field(default_factory=Counter)  # by variant
    reviewed: Counter[str] = field(default_factory=Counter)  # operator decisions
    replacements: dict[str, object] = field(default_factory=dict)
    network: str | None = None  # the fault plan, on separate hosts
    network_faults: list[str] = field(default_factory=list)  # each fault's timings
    operator_view: list[str] = field(default_factory=list)  # status's lapsed leases
    divergences: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        def counted(c: Counter[str]) -> str:
            return f"{sum(c.values())} {dict(sorted(c.items()))}"

        out = [
            f"seed {self.seed}, {self.seconds:.0f} s of chaos,"
            f" replay: python -m chaos --seed {self.seed} --seconds {self.seconds:g}"
            + ("" if self.daemon else " --no-daemon")
            + (f" --network {self.network}" if self.network else ""),
            f"runs (worker processes started): {self.runs}",
            f"kills: {counted(self.kills)}",
            f"pauses past the lease: {counted(self.pauses)}",
            f"sessions terminated: {counted(self.terminations)}",
            f"server restarts: {self.restarts}",
            f"workers that exited on their own: {counted(self.exits)}",
            f"operations: {counted(self.operations)}",
            f"refused by the database: {counted(self.refused)}",
            f"stats: claim holders killed {counted(self.claim_kills)}, budget squeezes"
            f" {self.squeezes}, large-account edits aimed at a computing run"
            f" {self.edits_during_compute}, exhausted jobs retried by the runbook while"
            f" settling {self.exhausted_retried}, stage calls cancelled"
            f" {counted(self.cancels)}, publications waiting on a held state row"
            f" {counted(self.lock_waits)}",
            f"libraries held past an observation's completion: {counted(self.library_holds)},"
            f" interrupted observations given back {self.interrupted}; answers gzip-coded"
            f" {self.compressed}; bombs sent {self.bombs}",
            f"audit: {self.audit}",
            f"merges injected: {counted(self.merges)}; operator decisions:"
            f" {counted(self.reviewed)}; replacements: {self.replacements}",
            f"throttle storms, requests that reached the stand-in: {self.storms}",
            f"longest an active library stayed dirty unacknowledged: {self.dirty_seconds:.1f} s"
            f" (at most {self.dirty_peak} dirty at once, acknowledged at up to"
            f" {self.ack_rate:.1f}/s)",
            f"quiescence after {self.quiesce_seconds:.1f} s (last outstanding: "
            + (", ".join(f"{k} at {v:.0f} s" for k, v in sorted(self.waited.items())) or "-")
            + ")",
        ]
        if self.daemon:
            first = "never" if self.dagster_first is None else f"{self.dagster_first:.0f} s"
            out.append(
                f"Dagster: first acknowledgement and stats publication after {first}"
                " (before the chaos)"
            )
            out.append(f"Dagster runs: {dict(sorted(self.dagster_runs.items()))}")
            out.append(f"Dagster share: {self.dagster_share}")
            out.extend(f"Dagster run failed: {line}" for line in self.dagster_failed)
        for line, count in self.unsupported.most_common(3):
            out.append(f"refused by the server by design x{count}: {line}")
        for line, count in self.unexpected_refusals.most_common(8):
            out.append(f"unexpected refusal x{count}: {line}")
        for line, count in self.worker_errors.most_common(8):
            out.append(f"worker error x{count}: {line}")
        out.extend(f"network fault: {line}" for line in self.network_faults)
        out.extend(f"status: {line}" for line in self.operator_view)
        out.append(f"divergences: {len(self.divergences)}")
        out.extend(f"  {d}" for d in self.divergences)
        return out


class DirtyClock(threading.Thread):
    """Samples, once a second, which active libraries are dirty, and keeps the longest
    time one stayed active and dirty without an acknowledgement (see `dirty_since`) and
    the most dirty at once."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.since: dict[int, tuple[int, float]] = {}
        self.longest = 0.0
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        conn: Connection | None = None
        while not self.done.wait(1.0):
            try:
                if conn is None or conn.closed:
                    conn = connect(self.url, application_name="chaos.harness")
                rows = fetch_all(
                    conn,
                    "SELECT s.library_id, s.acknowledged_revision FROM library_inventory_state s"
                    " JOIN libraries l ON l.id = s.library_id"
                    " JOIN media_servers m ON m.id = l.server_id"
                    " WHERE l.active AND m.active AND s.revision > s.acknowledged_revision",
                )
            except DatabaseError:
                continue  # a restart: the episode goes on
            now = time.monotonic()
            dirty = {int(r["library_id"]): int(r["acknowledged_revision"]) for r in rows}
            self.since = dirty_since(self.since, dirty, now)
            self.longest = max([self.longest, *(now - t for _, t in self.since.values())])
            self.peak = max(self.peak, len(rows))
        if conn is not None:
            conn.close()

    def stop(self) -> float:
        self.done.set()
        self.join(timeout=5)
        return self.longest


def dirty_since(
    since: dict[int, tuple[int, float]], dirty: dict[int, int], now: float
) -> dict[int, tuple[int, float]]:
    """Each dirty library (id: its acknowledged revision) with that revision and the
    moment its wait began: the wait goes on while the library stays dirty with the same
    acknowledged revision, and starts over when it was clean, inactive or acknowledged
    since the last sample. A library whose every acknowledgement is overtaken by a newer
    change (observations landing on it one by one) is making progress; one never
    acknowledged is not."""
    out = {}
    for library, acknowledged in dirty.items():
        before = since.get(library)
        same = before is not None and before[0] == acknowledged
        out[library] = before if before is not None and same else (acknowledged, now)
    return out


class FreshnessWatch(threading.Thread):
    """Samples, once a second, whether the product calls any user's stats current while
    a range of theirs is owed, and whether users it calls current read what their facts
    say (a few drawn each time); late authentication cases; records kept by the id of an
    item that no longer exists (a later truncate would hide them from the final check).
    Keeps every such observation."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.rng = random.Random(1)
        self.seen: dict[str, None] = {}  # in the order first seen
        self.done = threading.Event()
        # Late authentication cases (invariants.LATE_AUTH_CASES) by when first sampled.
        self.late_auth: dict[tuple[int, object, object], float] = {}

    def run(self) -> None:
        conn: Connection | None = None
        while not self.done.wait(1.0):
            try:
                if conn is None or conn.closed:
                    conn = connect(self.url, application_name="chaos.harness")
                self.seen.update(dict.fromkeys(invariants.current_while_owed(conn)))
                self.seen.update(dict.fromkeys(stats_oracle.check_current(conn, self.rng)))
                self.seen.update(dict.fromkeys(self._late_auth(conn)))
                self.seen.update(dict.fromkeys(invariants.item_records_have_items(conn)))
            except DatabaseError:
                continue  # a restart: sample again in a second
        if conn is not None:
            conn.close()

    def _late_auth(self, conn: Connection) -> list[str]:
        """A late authentication case the release would pass by, or one still waiting
        one release cycle (two batch spacings and a second) after it was first sampled."""
        now = time.monotonic()
        cases = invariants.late_auth_cases(conn)
        self.late_auth = {case: self.late_auth.get(case, now) for case, _ in cases}
        out = [
            f"item {case[0]}: authentication case of an older key's request, failed after"
            " the current key was verified, is not releasable"
            for case, releasable in cases
            if not releasable
        ]
        return out + [
            f"item {case[0]}: authentication case of an older key's request not released"
            " within one release cycle"
            for case, first in self.late_auth.items()
            if now - first > LATE_AUTH_RELEASE_SECONDS
        ]

    def stop(self) -> list[str]:
        self.done.set()
        self.join(timeout=5)
        return list(self.seen)


class Harness:
    def __init__(
        self,
        url: str,
        standin: StandIn,
        logs: Path,
        report: Report,
        server: Server,
        site: Site | None = None,
    ) -> None:
        self.url = url
        self.standin = standin
        self.report = report
        self.server = server
        self.site = site
        if site is None:
            self.workers = [
                Worker(role, logs / f"{role}-{n}.log")
                for role in ROLES
                for n in range(WORKERS[role])
            ]
        else:  # every role on every worker host, so each host's work can be taken over
            self.workers = [
                Worker(role, logs / f"{role}-{n}.log", host=site.host_of(n))
                for role in ROLES
                for n in range(max(WORKERS[role], len(WORKER_HOSTS)))
            ]
        self.lock = threading.Lock()
        self.faults: list[tuple[str, float, float]] = []  # kind, start, end (epoch s)
        # The operator's decisions while settling: a stream of their own, replayable.
        self.review_rng = random.Random(f"{report.seed}-review")

    def start(self, worker: Worker) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "chaos.worker", worker.role]
        if self.site is None or worker.host is None:
            command += [self.url, self.standin.url]
        else:
            command = self.site.place(
                worker.host,
                [*command, remote(self.site, self.url), self.site.provider_urls[worker.host]],
            )
        with worker.log.open("ab") as log:
            worker.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        self.report.runs += 1

    def restart_exited(self) -> None:
        """A worker that exited on its own crashed: count it and start it again."""
        with self.lock:
            for worker in self.workers:
                if (
                    worker.host is not None
                    and self.site is not None
                    and self.site.lost(worker.host)
                ):
                    continue  # a host lost for good starts nothing again
                if worker.process is not None and worker.process.poll() is not None:
                    self.report.exits[worker.role] += 1
                    self.start(worker)

    def kill(self, worker: Worker) -> None:
        with self.lock:
            if worker.pause is not None:  # a stopped worker dies too
                worker.pause.cancel()
                worker.pause = None
            assert worker.process is not None
            os.kill(worker.process.pid, signal.SIGKILL)
            worker.process.wait()
            self.report.kills[worker.role] += 1
            self.start(worker)

    def pause(self, worker: Worker) -> None:
        """SIGSTOP past the lease; a timer resumes it on its own clock, whatever the
        workload is doing (a writer may be waiting on a lock the stopped worker holds)."""
        with self.lock:
            assert worker.process is not None
            if worker.pause is not None:  # already stopped: the pause grows
                worker.pause.cancel()
            os.kill(worker.process.pid, signal.SIGSTOP)
            worker.pause = threading.Timer(PAUSE_SECONDS, self.resume, (worker,))
            worker.pause.start()
            self.report.pauses[worker.role] += 1

    def resume(self, worker: Worker) -> None:
        with self.lock:
            if worker.pause is None:
                return
            worker.pause.cancel()
            worker.pause = None
            assert worker.process is not None
            os.kill(worker.process.pid, signal.SIGCONT)

    def resume_all(self) -> None:
        for worker in self.workers:
            self.resume(worker)

    def terminate(self, conn: Connection, worker: Worker) -> None:
        """pg_terminate_backend of the worker's session: the server ends it (57P01) in
        whatever it was doing; the worker reconnects."""
        assert worker.process is not None
        name = application_name(worker.role, worker.process.pid)
        row = fetch_one(
            conn,
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS n FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = %s",
            (name,),
        )
        if row is not None and row["n"]:
            self.report.terminations[worker.role] += 1

    def kill_claim_holder(self, conn: Connection, sigkill: bool) -> None:
        """SIGKILL (or terminate the session of) a stats worker that holds a live claim,
        inside a transaction if one is caught there within a few looks: the claim must
        be recovered (its lease runs out, a batch run resumes under its token) and never
        published by anyone else."""
        holder = None
        for _ in range(CLAIM_KILL_LOOKS):
            holder = fetch_one(conn, invariants.CLAIM_HOLDERS)
            if holder is None or holder["in_transaction"]:
                break
            time.sleep(0.003)
        if holder is None:
            return
        worker = next(
            (
                w
                for w in self.workers
                if w.process is not None and w.process.pid == holder["worker_pid"]
            ),
            None,
        )
        if worker is None:
            return
        where = "in a transaction" if holder["in_transaction"] else "between transactions"
        if sigkill:
            self.kill(worker)
            self.report.claim_kills[f"SIGKILL {where}"] += 1
        else:
            self.terminate(conn, worker)
            self.report.claim_kills[f"terminated {where}"] += 1

    def restart_server(self) -> None:
        started = time.time()
        self.server.restart()
        self.faults.append(("restart", started, time.time()))
        self.report.restarts += 1

    def record_faults(self, conn: Connection) -> None:
        """Into the audit trail, a second wider on each side (clients notice late)."""
        for kind, started, ended in self.faults:
            execute(
                conn,
                "INSERT INTO chaos_faults (kind, started_at, ended_at)"
                " VALUES (%s, to_timestamp(%s), to_timestamp(%s))",
                (kind, started - 1.0, ended + 1.0),
            )

    def pids_on(self, host: str) -> list[int]:
        return [w.process.pid for w in self.workers if w.host == host and w.process is not None]

    def stop(self) -> None:
        self.resume_all()
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                os.kill(worker.process.pid, signal.SIGKILL)
                os.kill(worker.process.pid, signal.SIGCONT)  # frozen on a lost host
                worker.process.wait()

    def errors(self) -> Counter[str]:
        lines: Counter[str] = Counter()
        for worker in self.workers:
            if worker.log.exists():
                lines.update(x for x in worker.log.read_text().splitlines() if x.strip())
        return lines


def _prepare(conn: Connection) -> None:
    migrate(conn)
    execute(conn, (Path(__file__).with_name("audit.sql")).read_text())
    assignments = ", ".join(f"{column} = %({column})s" for column in STATS_SETTINGS)
    execute(conn, f"UPDATE stats_projection_worker_settings SET {assignments}", STATS_SETTINGS)
    admission.set_rate(conn, ADMISSION_RATE)


def _quiesce(
    conn: Connection, timeout: float, harness: Harness, waited: dict[str, float] | None = None
) -> tuple[float, dict[str, int]]:
    """Wait until no work is outstanding (twice in a row, a second apart). `waited`
    receives, per kind of work, how long into the wait it was last outstanding."""
    started = time.monotonic()
    calm = 0
    left: dict[str, int] = {}
    while time.monotonic() - started < timeout:
        harness.restart_exited()
        harness.report.exhausted_retried += retry_exhausted(conn)
        harness.report.reviewed.update(replacements.review(conn, harness.review_rng))
        left = {**invariants.outstanding(conn), **replacements.outstanding(conn)}
        if waited is not None:
            waited.update({k: time.monotonic() - started for k, v in left.items() if v})
        calm = calm + 1 if not any(left.values()) else 0
        if calm >= 2:
            return time.monotonic() - started, {}
        time.sleep(1.0)
    return time.monotonic() - started, {k: v for k, v in left.items() if v}


def retry_exhausted(conn: Connection) -> int:
    """The runbook, as an operator follows it once the budgets are restored: retry the
    exhausted jobs of every user whose stats say they are stale. A user the product
    calls current is left alone, so a range it dropped without saying so stays for the
    checks to find."""
    retried = 0
    for row in fetch_all(
        conn,
        "SELECT id FROM user_exercise_stats_refresh_jobs"
        " WHERE status = 'failed' AND stats_user_is_stale(user_id) ORDER BY id",
    ):
        try:
            runbook.retry(conn, int(row["id"]))
        except runbook.RunbookError:
            continue  # retried already
        retried += 1
    return retried


def _audit(conn: Connection) -> dict[str, int]:
    row = fetch_one(
        conn,
        "SELECT (SELECT count(*) FROM chaos_profile_claims) AS profile_claims,"
        " (SELECT count(*) FROM chaos_profile_acks) AS profile_acks,"
        " (SELECT count(*) FROM chaos_profile_acks WHERE actor NOT LIKE 'chaos.%')"
        "   AS profile_acks_by_dagster,"
        " (SELECT count(*) - count(DISTINCT request_id) FROM chaos_profile_claims)"
        "   AS profile_reclaims,"
        " (SELECT count(*) FROM chaos_profile_lapses WHERE ended_at >= lease_expires_at)"
        "   AS profile_leases_expired,"
        " (SELECT count(*) FROM chaos_profile_lapses WHERE to_status = 'failed')"
        "   AS profile_terminal_failures,"
        " (SELECT count(*) FROM chaos_stats_publications) AS stats_publications,"
        " (SELECT count(*) FROM chaos_stats_publications WHERE mode = 'batched')"
        "   AS stats_batched_publications,"
        " (SELECT count(DISTINCT worker_pid) FROM chaos_stats_publications)"
        "   AS stats_publishing_processes,"
        " (SELECT count(*) FROM chaos_stats_job_failures) AS stats_exhausted_jobs,"
        " (SELECT count(*) FROM (SELECT run_id FROM chaos_stats_steps GROUP BY run_id"
        "   HAVING count(DISTINCT backend_pid) > 1) r) AS stats_runs_stepped_by_several,"
        " (SELECT count(*) FROM user_stats_projection_runs WHERE error = 'lease expired')"
        "   AS stats_runs_expired,"
        " (SELECT count(*) FROM chaos_item_claims) AS item_claims,"
        " (SELECT count(*) FROM chaos_item_completions) AS item_completions,"
        " (SELECT count(*) FROM chaos_verifications) AS verifications,"
        " (SELECT count(*) FROM chaos_wakeup_releases) AS wakeup_releases,"
        " (SELECT count(DISTINCT batch) FROM chaos_wakeup_releases) AS wakeup_batches",
    )
    return {} if row is None else {k: int(v) for k, v in row.items()}


def dirty_bound(report: Report) -> float:
    """The longest an active library may stay dirty unacknowledged: the flat bound, or on
    a machine that acknowledges slower, three times the time the largest dirty set takes
    to drain at the run's best measured rate (config.DIRTY_DRAIN_MARGIN says why)."""
    if report.ack_rate <= 0:
        return MAX_DIRTY_SECONDS
    return max(MAX_DIRTY_SECONDS, DIRTY_DRAIN_MARGIN * report.dirty_peak / report.ack_rate)


def best_ack_rate(conn: Connection) -> float:
    """The most acknowledgements per second the run made over any window."""
    row = fetch_one(
        conn,
        "SELECT coalesce(max(n), 0) AS n FROM (SELECT count(*) OVER (ORDER BY acked_at"
        " RANGE BETWEEN make_interval(secs => %(window)s) PRECEDING AND CURRENT ROW) AS n"
        " FROM chaos_profile_acks) w",
        {"window": ACK_RATE_WINDOW_SECONDS},
    )
    return 0.0 if row is None else int(row["n"]) / ACK_RATE_WINDOW_SECONDS


def admission_rate(arrivals: Counter[int]) -> list[str]:
    """Requests that reached the stand-in in one wall-clock second, beyond what the
    admission rate (with its margin) lets through across every process."""
    limit = ADMISSION_RATE * ADMISSION_MARGIN
    return [
        f"{n} requests reached the provider in one second (admission rate {ADMISSION_RATE}/s)"
        for second, n in sorted(arrivals.items())
        if n > limit
    ]


def bounds(report: Report) -> list[str]:
    """The progress bounds of config.py, each a divergence when exceeded."""
    out = []
    audit = report.audit
    if report.dirty_seconds > dirty_bound(report):
        out.append(
            f"an active library stayed dirty unacknowledged {report.dirty_seconds:.0f} s (bound"
            f" {dirty_bound(report):.0f} s: {report.dirty_peak} dirty at most, acknowledged"
            f" at up to {report.ack_rate:.1f}/s)"
        )
    exits = sum(report.exits.values())
    if exits > MAX_UNPLANNED_EXITS:
        out.append(f"{exits} workers exited on their own (bound {MAX_UNPLANNED_EXITS})")
    minutes = max(1.0, (report.seconds + report.quiesce_seconds) / 60)
    errors = sum(report.worker_errors.values())
    if errors > MAX_WORKER_ERRORS_PER_MINUTE * minutes:
        out.append(
            f"{errors} worker errors in {minutes:.1f} min"
            f" (bound {MAX_WORKER_ERRORS_PER_MINUTE}/min)"
        )
    claims = audit.get("profile_claims", 0)
    reclaims = audit.get("profile_reclaims", 0)
    if claims and reclaims / claims > MAX_RECLAIM_SHARE:
        out.append(
            f"{reclaims} of {claims} profile claims were re-claims (bound {MAX_RECLAIM_SHARE:.0%})"
        )
    failed = audit.get("profile_terminal_failures", 0)
    if failed > MAX_TERMINAL_FAILURES:
        out.append(
            f"{failed} requests failed for good and waited for the circuit"
            f" (bound {MAX_TERMINAL_FAILURES})"
        )
    out += [
        f"throttle storm {n}: {count} requests reached the stand-in while it answered 429"
        f" (bound {MAX_STORM_REQUESTS})"
        for n, count in enumerate(report.storms, 1)
        if count > MAX_STORM_REQUESTS
    ]
    return out


def run(
    server: Server | str,
    seed: int,
    seconds: float,
    log: Callable[[str], None] = print,
    daemon: bool = False,
    site: Site | None = None,
) -> Report:
    """One seeded run on `server` (a maintenance URL: a server the harness may not
    restart). With `daemon`, the real Dagster daemon takes part. With `site`, on
    separate hosts under its network faults instead of process faults
    (chaos/partition.py); `server` is then the site's."""
    if isinstance(server, str):
        server = Server(server, restartable=False)
    admin_url = server.admin_url
    report = Report(seed=seed, seconds=seconds, daemon=daemon)
    if site is not None:
        report.network = site.plan_name
    database = f"inventory_chaos_{uuid.uuid4().hex[:10]}"
    with connect(admin_url) as admin:
        create_database(admin, database)
    url = url_with_database(admin_url, database)
    dagster: Daemon | None = None
    try:
        with (
            StandIn(api_key=API_KEY, missing_every=17) as standin,
            tempfile.TemporaryDirectory(prefix="inventory-chaos-") as logs,
        ):
            with connect(url) as conn:
                _prepare(conn)
            today_row = None
            workload_conn = connect(url, application_name="chaos.workload")
            today_row = fetch_one(workload_conn, "SELECT stats_clock_date() AS d")
            assert today_row is not None
            workload = Workload(
                workload_conn,
                standin,
                random.Random(seed),
                today_row["d"],
                reconnect=lambda: connect(url, application_name="chaos.workload"),
            )
            workload.setup()
            for fault, options in FAULTS:  # each bomb coded once, before the chaos
                if fault == "encoded":
                    encoded(options["encoding"], options["size"], None)
            if site is not None:
                site.serve(standin)
            harness = Harness(url, standin, Path(logs), report, server, site)
            if daemon and site is not None:
                dagster = DeployedDagster(site, admin_url, url, standin.url, Path(logs))
                dagster.start()
                report.dagster_first = dagster.first_acknowledgement(url, DAEMON_FIRST_ACK_SECONDS)
            elif daemon:
                dagster = Daemon(admin_url, url, standin.url, Path(logs))
                dagster.start()
                report.dagster_first = dagster.first_acknowledgement(url, DAEMON_FIRST_ACK_SECONDS)
            clock = DirtyClock(url)
            clock.start()
            freshness = FreshnessWatch(url)
            freshness.start()
            try:
                _chaos(harness, workload, random.Random(f"{seed}-schedule"), seconds, log)
                workload.settle()
                report.operations, report.refused = workload.done, workload.refused
                report.unexpected_refusals = workload.unexpected
                report.unsupported = workload.unsupported
                report.squeezes = workload.squeezes
                report.cancels, report.lock_waits = workload.cancels, workload.lock_waits
                report.library_holds = workload.library_holds
                report.compressed = standin.state.compressed
                report.bombs = standin.state.encoded
                report.merges = workload.merges
                report.reviewed.update(workload.reviewed)
                report.edits_during_compute = workload.edits_during_compute
                report.arrivals = standin.state.per_second()
                report.storms = [
                    sum(1 for t in list(standin.state.arrivals) if start <= t <= end)
                    for start, end in workload.storms
                ]
                with connect(url, application_name="chaos.harness") as conn:
                    report.quiesce_seconds, left = _quiesce(
                        conn, MAX_QUIESCE_SECONDS, harness, report.waited
                    )
                    if not left and workload.merges_owed:
                        # The chaos kept the provider from observing enough records to
                        # merge: the owed merges now, with every record observed, and
                        # quiescence again, so every run exercises the corroboration gate.
                        workload.apply("owed_merge_tries", workload.merge_owed)
                        more, left = _quiesce(conn, MAX_QUIESCE_SECONDS, harness)
                        report.quiesce_seconds += more
                    report.divergences += [
                        f"not quiescent after {MAX_QUIESCE_SECONDS} s: {k} {v}"
                        for k, v in left.items()
                    ]
                    if "expired observation leases" in left:
                        report.divergences += invariants.describe_leases(conn)
                    report.dirty_seconds = clock.stop()
                    report.dirty_peak = clock.peak
                    if left:  # the rebuild would only wait as long again
                        report.divergences.append("stats rebuild not compared: not quiescent")
                    else:
                        report.divergences += _rebuild_and_compare(conn, harness)
            finally:
                clock.stop()
                report.divergences += freshness.stop()
                harness.stop()
                workload.conn.close()
                if dagster is not None:
                    report.dagster_runs = dagster.runs()
                    report.dagster_share = dagster.share(url)
                    report.dagster_failed = dagster.failed_runs()
                    if not dagster.alive():
                        report.divergences.append(
                            "the Dagster daemon exited: " + dagster.tail(400).replace("\n", " | ")
                        )
                    dagster.stop()
                    dagster = None
            report.worker_errors = harness.errors()
            with connect(url, application_name="chaos.harness") as conn:
                harness.record_faults(conn)
                report.audit = _audit(conn)
                report.ack_rate = best_ack_rate(conn)
                report.replacements = replacements.summary(conn)
                report.divergences += _checks(conn, report, harness)
                if site is not None:  # what `inventory-pipeline status` shows the operator
                    report.operator_view = lease_lines(leases.overview(conn, latest=3))
    finally:
        if dagster is not None:
            dagster.stop()
        with connect(admin_url) as admin:
            drop_database(admin, database)
            drop_writer_role(admin, database)
    return report


def _checks(conn: Connection, report: Report, harness: Harness) -> list[str]:
    out = invariants.profiles_converged(conn)
    out += oracle.check(conn)
    out += invariants.stats_versions(conn)
    out += invariants.stats_generations(conn)
    out += invariants.no_lost_claim_acknowledged(conn)
    out += invariants.no_attempt_burned_unworked(conn)
    out += invariants.wakeups(conn, WAKEUP_RELEASE_LIMIT, WAKEUP_SPACING_SECONDS)
    out += invariants.nothing_stuck(conn)
    interrupted, report.interrupted = invariants.interruptions(conn)
    out += interrupted
    out += invariants.recorded_errors(conn)
    out += invariants.stats_leases(conn)
    out += invariants.release_rules(conn)
    out += invariants.inactive_claims(conn)
    out += admission_rate(report.arrivals)
    out += invariants.malformed_identities(conn)
    out += invariants.item_records_have_items(conn)
    out += replacements.checks(conn)
    out += judge_errors(report.worker_errors)
    out += [f"write refused: {line}" for line in report.unexpected_refusals]
    if report.daemon:
        out += dagster_divergences(report.dagster_share, report.dagster_failed, harness.faults)
    if harness.site is not None:
        out += fault_divergences(harness.site.records, len(harness.site.plan))
    out += bounds(report)
    out += unexercised(report, harness.server.restartable)
    for secret, what in ((API_KEY, "the TMDb key"), (WRONG_KEY, "a rejected key")):
        out += [f"{what} found in table {table}" for table in tables_containing(conn, secret)]
        if any(secret in line for line in report.worker_errors):
            out.append(f"{what} found in a worker's log")
    return out


def _chaos(
    harness: Harness,
    workload: Workload,
    schedule: random.Random,
    seconds: float,
    log: Callable[[str], None],
) -> None:
    for worker in harness.workers:
        harness.start(worker)
    _first_wakeups(harness.url, WAKEUP_WARMUP_SECONDS)
    total = max(1, int(seconds * OPS_PER_SECOND))
    restarts = {int(total * at) for at in RESTART_AT} if harness.server.restartable else set()
    backlog, storm = int(total * BACKLOG_AT), int(total * STORM_AT)
    auth_backlog = int(total * AUTH_BACKLOG_AT)
    squeeze, rebuild = int(total * SQUEEZE_AT), int(total * REBUILD_AT)
    lock_waits = {int(total * at) for at in PUBLICATION_LOCK_WAIT_AT}
    library_holds = {int(total * at) for at in LIBRARY_HOLD_AT}
    compress, bomb = int(total * COMPRESS_AT), int(total * BOMB_AT)
    cancel = int(total * CANCEL_AT)
    empty_user = int(total * EMPTY_USER_AT)
    merge_batches = {int(total * at) for at in MERGE_AT}
    owed_at = int(total * FAULTS_OWED_AT)
    owed: set[str] = set()
    owed_rng = random.Random(f"{harness.report.seed}-owed")
    started = time.monotonic()
    admin = connect(harness.url, application_name="chaos.harness")
    try:
        for op in range(total):
            if op == backlog:
                workload.apply("backlog", workload.backlog)
            if op == storm:
                workload.apply("throttle_storm", workload.throttle_storm)
            if op == auth_backlog:
                workload.apply("auth_backlog", workload.auth_backlog)
            if op == squeeze:
                workload.apply(
                    "squeeze_budget",
                    lambda: workload.squeeze_budget(SQUEEZED_COMPUTE_BUDGET_MS),
                )
            if op in lock_waits:
                # Cancelled at the first fixed point, out of its budget at the second.
                workload.apply(
                    "publication_lock_wait",
                    functools.partial(workload.publication_lock_wait, op == min(lock_waits)),
                )
            if op in library_holds:
                workload.apply("hold_library", workload.hold_library)
            if op == compress:
                workload.apply("compress", lambda: workload.keep_fault("compress", {}))
            if op == bomb:
                workload.apply("bomb", lambda: workload.keep_fault("encoded", BOMB))
            if op == cancel:
                workload.apply("cancel_stage", workload.cancel_stage)
            if op == rebuild:
                workload.apply("rebuild_everyone", workload.rebuild_everyone)
            if op == empty_user:
                workload.apply("empty_user", workload.empty_user)
            if op in merge_batches:
                workload.owe_merges(MERGES_AT_ONCE)
            if workload.merges_owed and op % OPS_PER_SECOND == 0:  # a try a second
                workload.apply("owed_merge_tries", workload.merge_owed)
            workload.step()
            roll = schedule.random()
            target = schedule.choice(harness.workers)
            claim_kill = schedule.random()
            faults: list[tuple[str, Worker, bool]] = []  # kind, target, SIGKILL a holder
            if claim_kill < CLAIM_KILL_CHANCE:
                faults.append(("claim-holder kill", target, claim_kill < CLAIM_KILL_CHANCE / 2))
            kind = drawn(roll)
            if kind is not None:
                faults.append((kind, target, False))
            # A fault not drawn by now is owed: tried on every operation until it fired
            # once, at targets of its own stream (whether a try finds a session or a
            # claim holder is up to the scheduler), so the drawn schedule stays a
            # function of the seed.
            if harness.site is not None:  # the network's faults instead of the processes'
                faults, owed = [], set()
                for fault in harness.site.due(op, total):
                    if fault.moment in ("computing", "publishing"):
                        # Work that holds a claim for a while whoever takes it: every
                        # large account imports a session (its range computes in
                        # batches), so the cut finds its moment on any seed.
                        for user in workload.large_users:
                            workload.apply(
                                "save_large",
                                functools.partial(workload.save_large, user, everything=True),
                            )
                    harness.site.inject(fault, harness.url, harness.pids_on(fault.host))
            elif op == owed_at:
                owed = {k for k in RANDOM_FAULTS if not exercised(harness.report)[k]}
            faults += [
                (k, owed_rng.choice(harness.workers), owed_rng.random() < 0.5) for k in sorted(owed)
            ]
            for kind, victim, sigkill in faults:
                if kind == "kill":
                    harness.kill(victim)
                elif kind == "pause":
                    harness.pause(victim)
                else:
                    try:
                        if admin.closed:
                            admin = connect(harness.url, application_name="chaos.harness")
                        if kind == "termination":
                            harness.terminate(admin, victim)
                        else:
                            harness.kill_claim_holder(admin, sigkill)
                    except DatabaseError:
                        admin.close()  # the server restarting: the next one reconnects
            if owed:
                owed = {k for k in owed if not exercised(harness.report)[k]}
            if op in restarts:
                harness.restart_server()
            harness.restart_exited()
            if op % (OPS_PER_SECOND * 10) == 0 and op:
                log(f"  {op}/{total} operations, {sum(harness.report.kills.values())} kills")
            delay = started + (op + 1) / OPS_PER_SECOND - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    finally:
        admin.close()
    workload.end_storm()
    harness.resume_all()
    if harness.site is not None:
        log("  waiting for the network faults to heal")
        for record in harness.site.finish():
            harness.faults.append((record.fault.kind, record.started, record.ended or time.time()))
            harness.report.network_faults.append(record.line())


# The faults the schedule draws per operation, and the counters that say each fired.
RANDOM_FAULTS = ("kill", "pause", "termination", "claim-holder kill")


def drawn(roll: float) -> str | None:
    """The process fault one roll of the schedule draws, if any."""
    for kind, upto in (
        ("kill", KILL_CHANCE),
        ("pause", KILL_CHANCE + PAUSE_CHANCE),
        ("termination", KILL_CHANCE + PAUSE_CHANCE + TERMINATE_CHANCE),
    ):
        if roll < upto:
            return kind
    return None


def exercised(report: Report, restartable: bool = False) -> dict[str, int]:
    """How often each enabled fault fired: the drawn ones, and (when `restartable`
    says the server restart is enabled) the fixed points too."""
    out = {
        "kill": sum(report.kills.values()),
        "pause": sum(report.pauses.values()),
        "termination": sum(report.terminations.values()),
        "claim-holder kill": sum(report.claim_kills.values()),
        "throttle storm": len(report.storms),
        "budget squeeze": report.squeezes,
        "stage cancel": sum(report.cancels.values()),
        "publication lock wait": sum(report.lock_waits.values()),
        "interrupted observation": report.interrupted,
        "compressed answer": report.compressed,
        "decompression bomb": report.bombs,
    }
    if restartable:
        out["server restart"] = report.restarts
    return out


def unexercised(report: Report, restartable: bool) -> list[str]:
    """Every enabled fault must have fired: a run that injected none of a kind proves
    nothing about it. On separate hosts the process faults are off and the network's
    are planned (each one's record is checked by `fault_divergences`)."""
    if report.network is not None:
        return []
    return [
        f"fault not exercised: {kind}"
        for kind, count in exercised(report, restartable).items()
        if not count
    ]


def _first_wakeups(url: str, timeout: float) -> None:
    """Before the chaos, the setup's authentication backlog is verified and released in
    two batches (a truncate during the chaos could otherwise wipe it untested); later
    backlogs and key changes are woken under the chaos."""
    started = time.monotonic()
    with connect(url, application_name="chaos.harness") as conn:
        while time.monotonic() - started < timeout:
            row = fetch_one(conn, "SELECT count(DISTINCT batch) AS n FROM chaos_wakeup_releases")
            if row is not None and row["n"] >= 2:
                return
            time.sleep(0.5)


def _rebuild_and_compare(conn: Connection, harness: Harness) -> list[str]:
    """The settled stats: no range owed, and the projections and today's PR overview
    equal to the independent oracle's computation from the sessions; then equal to a
    full-history recomputation through the queue (a rebuild of every user, those whose
    sessions were all deleted included, published by the workers)."""
    out = invariants.owed_ranges(conn)
    out += invariants.nothing_owed(conn)
    out += [f"settled: {line}" for line in stats_oracle.check(conn)]
    try:
        incremental = invariants.projections(conn)
    except DatabaseError as exc:
        return [*out, f"PR overview unreadable after quiescence: {exc}"]
    service.request_rebuild(conn, invariants.stats_users(conn))
    _, left = _quiesce(conn, MAX_QUIESCE_SECONDS, harness)
    if left:
        return [*out, f"rebuild did not finish: {left}"]
    return out + invariants.projections_equal(incremental, invariants.projections(conn))
