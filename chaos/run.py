"""One harness run: a scratch database, a TMDb stand-in, worker processes, the seeded
workload with kills and pauses, quiescence, a full stats rebuild, and the checks.

Replay: the operations, their order and the kill/pause schedule are a pure function of
the seed and the run length (the op count), so `python -m chaos --seed N --seconds S`
repeats a failing run's inputs exactly. What the OS scheduler does between processes is
not replayable; that is the point of running many seeds.
"""

from __future__ import annotations

import os
import random
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

from chaos import invariants
from chaos.config import API_KEY, LEASE_SECONDS, STATS_SETTINGS, WRONG_KEY
from chaos.worker import ROLES
from chaos.workload import Workload
from inventory_pipeline.db import Connection, DatabaseError, connect, execute, fetch_one
from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
from inventory_pipeline.db.migrator import migrate
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.stats import processors
from tests.factories import tables_containing

ROOT = Path(__file__).resolve().parents[1]
WORKERS = {"planner": 2, "refresher": 2, "observer": 2, "prober": 1, "stats": 2, "maintainer": 1}
OPS_PER_SECOND = 8
KILL_CHANCE = 0.04  # per operation
PAUSE_CHANCE = 0.012
PAUSE_SECONDS = LEASE_SECONDS + 1.5  # outlives the lease
QUIESCE_SECONDS = 150
# Errors a worker may meet under chaos and recover from; anything else is a divergence.
EXPECTED_ERRORS = ("DatabaseError", "DatabaseUnavailable", "LockNotAvailable", "AdmissionTimeout")


def _expected(line: str) -> bool:
    """A worker's `role: Type: message` line naming an error it recovers from; anything
    else (a traceback of a crash at start-up, say) is not."""
    parts = line.split(": ", 2)
    return len(parts) == 3 and parts[1] in EXPECTED_ERRORS


@dataclass
class Worker:
    role: str
    log: Path
    process: subprocess.Popen[bytes] | None = None
    pause: threading.Timer | None = None  # set while stopped: the timer that resumes it


@dataclass
class Report:
    seed: int
    seconds: float
    operations: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    runs: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    pauses: Counter[str] = field(default_factory=Counter)
    audit: dict[str, int] = field(default_factory=dict)
    worker_errors: Counter[str] = field(default_factory=Counter)
    quiesce_seconds: float = 0.0
    divergences: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"seed {self.seed}, {self.seconds:.0f} s of chaos,"
            f" replay: python -m chaos --seed {self.seed} --seconds {self.seconds:g}",
            f"runs (worker processes started): {self.runs}",
            f"kills: {sum(self.kills.values())} {dict(sorted(self.kills.items()))}",
            f"pauses past the lease: {sum(self.pauses.values())}"
            f" {dict(sorted(self.pauses.items()))}",
            f"operations: {sum(self.operations.values())} {dict(sorted(self.operations.items()))}",
            f"refused by the database: {sum(self.refused.values())}"
            f" {dict(sorted(self.refused.items()))}",
            f"audit: {self.audit}",
            f"quiescence after {self.quiesce_seconds:.1f} s",
        ]
        for line, count in self.worker_errors.most_common(8):
            out.append(f"worker error x{count}: {line}")
        out.append(f"divergences: {len(self.divergences)}")
        out.extend(f"  {d}" for d in self.divergences)
        return out


class Harness:
    def __init__(self, url: str, standin: StandIn, logs: Path, report: Report) -> None:
        self.url = url
        self.standin = standin
        self.report = report
        self.workers = [
            Worker(role, logs / f"{role}-{n}.log") for role in ROLES for n in range(WORKERS[role])
        ]
        self.lock = threading.Lock()

    def start(self, worker: Worker) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with worker.log.open("ab") as log:
            worker.process = subprocess.Popen(
                [sys.executable, "-m", "chaos.worker", worker.role, self.url, self.standin.url],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        self.report.runs += 1

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

    def stop(self) -> None:
        self.resume_all()
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                os.kill(worker.process.pid, signal.SIGKILL)
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
    admission.set_rate(conn, 500.0)


def _quiesce(conn: Connection, timeout: float, harness: Harness) -> tuple[float, dict[str, int]]:
    """Wait until no work is outstanding (twice in a row, a second apart)."""
    started = time.monotonic()
    calm = 0
    left: dict[str, int] = {}
    while time.monotonic() - started < timeout:
        for worker in harness.workers:  # a worker that exited on its own is restarted
            if worker.process is not None and worker.process.poll() is not None:
                harness.start(worker)
        left = invariants.outstanding(conn)
        calm = calm + 1 if not any(left.values()) else 0
        if calm >= 2:
            return time.monotonic() - started, {}
        time.sleep(1.0)
    return time.monotonic() - started, {k: v for k, v in left.items() if v}


def _audit(conn: Connection) -> dict[str, int]:
    row = fetch_one(
        conn,
        "SELECT (SELECT count(*) FROM chaos_profile_claims) AS profile_claims,"
        " (SELECT count(*) FROM chaos_profile_acks) AS profile_acks,"
        " (SELECT count(*) - count(DISTINCT request_id) FROM chaos_profile_claims)"
        "   AS profile_reclaims,"
        " (SELECT count(*) FROM chaos_profile_claims c WHERE NOT EXISTS (SELECT 1"
        "   FROM chaos_profile_acks a WHERE a.lease_token = c.lease_token)) AS profile_claims_lost,"
        " (SELECT count(*) FROM chaos_stats_publications) AS stats_publications,"
        " (SELECT count(*) FROM user_stats_projection_runs WHERE error = 'lease expired')"
        "   AS stats_runs_expired,"
        " (SELECT count(*) FROM chaos_item_claims) AS item_claims,"
        " (SELECT count(*) FROM chaos_item_completions) AS item_completions",
    )
    return {} if row is None else {k: int(v) for k, v in row.items()}


def run(
    admin_url: str,
    seed: int,
    seconds: float,
    log: Callable[[str], None] = print,
) -> Report:
    report = Report(seed=seed, seconds=seconds)
    database = f"inventory_chaos_{uuid.uuid4().hex[:10]}"
    with connect(admin_url) as admin:
        create_database(admin, database)
    url = url_with_database(admin_url, database)
    try:
        with (
            connect(url) as conn,
            StandIn(api_key=API_KEY, missing_every=17) as standin,
            tempfile.TemporaryDirectory(prefix="inventory-chaos-") as logs,
        ):
            _prepare(conn)
            today = fetch_one(conn, "SELECT stats_clock_date() AS d")
            assert today is not None
            workload = Workload(conn, standin, random.Random(seed), today["d"])
            workload.setup()
            harness = Harness(url, standin, Path(logs), report)
            try:
                _chaos(harness, workload, random.Random(f"{seed}-schedule"), seconds, log)
                report.operations, report.refused = workload.done, workload.refused
                workload.settle()
                report.quiesce_seconds, left = _quiesce(conn, QUIESCE_SECONDS, harness)
                report.divergences += [f"still outstanding: {k} {v}" for k, v in left.items()]
                if "observation leases" in left:
                    report.divergences += invariants.describe_leases(conn)
                report.divergences += _rebuild_and_compare(conn, harness)
            finally:
                harness.stop()
            report.worker_errors = harness.errors()
            report.audit = _audit(conn)
            report.divergences += invariants.profiles_converged(conn)
            report.divergences += invariants.stats_versions(conn)
            report.divergences += invariants.no_lost_claim_acknowledged(conn)
            report.divergences += invariants.nothing_stuck(conn)
            report.divergences += [
                f"worker error: {line}" for line in report.worker_errors if not _expected(line)
            ]
            for secret, what in ((API_KEY, "the TMDb key"), (WRONG_KEY, "a rejected key")):
                report.divergences += [
                    f"{what} found in table {table}" for table in tables_containing(conn, secret)
                ]
                if any(secret in line for line in report.worker_errors):
                    report.divergences.append(f"{what} found in a worker's log")
    finally:
        with connect(admin_url) as admin:
            drop_database(admin, database)
    return report


def _chaos(
    harness: Harness,
    workload: Workload,
    schedule: random.Random,
    seconds: float,
    log: Callable[[str], None],
) -> None:
    for worker in harness.workers:
        harness.start(worker)
    total = max(1, int(seconds * OPS_PER_SECOND))
    started = time.monotonic()
    for op in range(total):
        workload.step()
        roll = schedule.random()
        target = schedule.choice(harness.workers)
        if roll < KILL_CHANCE:
            harness.kill(target)
        elif roll < KILL_CHANCE + PAUSE_CHANCE:
            harness.pause(target)
        if op % (OPS_PER_SECOND * 10) == 0 and op:
            log(f"  {op}/{total} operations, {sum(harness.report.kills.values())} kills")
        delay = started + (op + 1) / OPS_PER_SECOND - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    harness.resume_all()


def _rebuild_and_compare(conn: Connection, harness: Harness) -> list[str]:
    """Projections and PR snapshots against a full-history recomputation through the
    queue: request a rebuild of every user, let the workers publish it, compare."""
    try:
        incremental = invariants.projections(conn)
    except DatabaseError as exc:
        return [f"PR overview unreadable after quiescence: {exc}"]
    processors.request_rebuild(conn, None)
    _, left = _quiesce(conn, QUIESCE_SECONDS, harness)
    if left:
        return [f"rebuild did not finish: {left}"]
    return invariants.projections_equal(incremental, invariants.projections(conn))
