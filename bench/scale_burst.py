"""S2: a burst that dirties every library, commit -> all acknowledged, under the real
daemon (the sensor launching runs, `dagster-daemon` with the queued coordinator and
this repo's dagster.yaml), at 1k and 10k libraries, and 100k under `--scale`.

Each library holds 10-100 items (a fixed spread, 55 on average), observed against the
provider before (a deployment in its steady state: no item is due for observation, so
the observation runs do not share the two cores with the drain). The population is
loaded and acknowledged before the daemon starts; once the daemon has a partition for
every library, one statement changes one item of every library and commits: the
burst. A poller samples the acknowledged count every 0.5 s until every library is
acknowledged. The figures are libraries/s over the whole drain (commit -> all
acknowledged) and over its middle (10 % -> 90 % acknowledged, the sustained rate), and
where the time went from Dagster's own storage: runs, their mean duration and the
time between launch and start, and the event writes per library.

The CPU figures read /proc: the server's share is only the bench's own on the embedded
server (the default); on a shared server it counts every session's backends.

`python -m bench.scale_burst [--smoke | --scale] [--sizes N ...] [--reps N] [--window S]
[--items N] [--cost N]` runs it alone (`--items 100`: 100 items in every library, 10M
items at 100k).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import Figure, Mode, Size, over_runs, plot, scratch_database, server_url
from bench.orchestration import daemon
from inventory_pipeline.db import Connection, DatabaseError, connect, execute, fetch_all, fetch_one
from inventory_pipeline.db.connection import database_name
from inventory_pipeline.defs.profile_ranges import PARTITIONS_NAME, partition_of

GOAL = 100.0  # libraries/s sustained at 100k

LOAD = """
INSERT INTO media_servers (id, name, kind) VALUES (1, 'bench', 'plex');
INSERT INTO libraries (id, server_id, name, media_kind)
SELECT g, 1, 'library ' || g, 'movie' FROM generate_series(1, %(libraries)s) g;
"""
# 10-100 items per library, 55 on average, loaded in slices of libraries so that no
# statement holds millions of rows.
ITEMS = """
INSERT INTO media_server_items (library_id, title, rating, genres, primary_studio,
                                original_language, provider, provider_kind, provider_id,
                                observed_at, observation_successes, observation_due_at)
SELECT l, 'Title ' || g, (mod(g * 7 + l, 100)) / 10.0,
       CASE mod(g, 3) WHEN 0 THEN ARRAY['Drama'] WHEN 1 THEN ARRAY['Comedy', 'Drama']
            ELSE ARRAY['Horror'] END,
       'Studio ' || mod(g + l, 7), CASE WHEN mod(g, 5) = 0 THEN 'fr' ELSE 'en' END,
       'tmdb', 'movie', (l::bigint * 1000 + g)::text,
       now(), 1, now() + interval '30 days'
FROM generate_series(%(first)s::int, %(last)s::int) l,
     LATERAL generate_series(1, COALESCE(%(items)s::int, 10 + mod(l * 37, 91))) g
"""
ACKNOWLEDGE_ALL = """
UPDATE library_inventory_state
SET acknowledged_revision = revision, dirty_since = NULL, acknowledged_at = now()
"""
# The burst: one item of every library changes, in one commit.
BURST = """
UPDATE media_server_items i SET rating = mod(i.rating * 10 + 1, 100) / 10.0
FROM (SELECT min(id) AS id FROM media_server_items GROUP BY library_id) first
WHERE i.id = first.id
"""
ACKNOWLEDGED = """
SELECT count(*) FILTER (WHERE acknowledged_revision >= revision) AS done, count(*) AS total
FROM library_inventory_state
"""
PARTITIONS = "SELECT count(*) AS n FROM dynamic_partitions WHERE partitions_def_name = %s"
RUNS = """
SELECT count(*) AS runs,
       avg(end_time - start_time) AS run_seconds,
       avg(start_time - extract(epoch FROM create_timestamp)) AS launch_to_start
FROM runs WHERE pipeline_name = 'library_profile_refresh' AND start_time IS NOT NULL
"""
EVENTS = """
SELECT dagster_event_type AS kind, count(*) AS n FROM event_logs
WHERE dagster_event_type IN ('ASSET_MATERIALIZATION', 'ASSET_CHECK_EVALUATION')
GROUP BY 1
"""


def load(url: str, libraries: int, items: int | None = None) -> None:
    """`libraries` of 10-100 items (55 on average), or of `items` each."""
    with connect(url) as conn:
        execute(conn, LOAD.replace("%(libraries)s", str(int(libraries))))
        step = 5000
        for first in range(1, libraries + 1, step):
            last = min(libraries, first + step - 1)
            execute(conn, ITEMS, {"first": first, "last": last, "items": items})
        execute(conn, "SELECT fold_inventory_changes()")  # the load's changes
        execute(conn, ACKNOWLEDGE_ALL)
        execute(conn, "VACUUM ANALYZE")


def wait_for_partitions(storage_url: str, libraries: int, limit: float) -> None:
    """Until the daemon has a partition for every range that holds one of the libraries."""
    wanted = len({partition_of(i) for i in range(1, libraries + 1)})
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with connect(storage_url) as dagster_db:
                row = fetch_one(dagster_db, PARTITIONS, (PARTITIONS_NAME,))
        except DatabaseError:  # the daemon has not created its tables yet
            row = None
        if row is not None and row["n"] >= wanted:
            return
        time.sleep(1)
    raise RuntimeError(f"the daemon did not add {wanted} partitions within {limit:.0f} s")


def rate_between(samples: list[tuple[float, int]], total: int, lo: float, hi: float) -> float:
    """Libraries/s between the first samples at `lo` and `hi` of the population."""
    start = next((t, n) for t, n in samples if n >= lo * total)
    end = next((t, n) for t, n in samples if n >= hi * total)
    return (end[1] - start[1]) / max(end[0] - start[0], 1e-9)


def window_rate(samples: list[tuple[float, int]]) -> float:
    """Libraries/s from the first acknowledgement to the end of a drain followed only for
    a window."""
    first = next(((t, n) for t, n in samples if n > 0), samples[-1])
    return (samples[-1][1] - first[1]) / max(samples[-1][0] - first[0], 1e-9)


def burst(
    admin_url: str,
    libraries: int,
    limit: float,
    window: float | None = None,
    items: int | None = None,
) -> dict[str, Any]:
    """One burst: the drain's progress samples and Dagster's account of it. With a
    `window`, the drain is followed for that many seconds only (the rates are then
    over the window, and `seconds` is None)."""
    with scratch_database(admin_url) as url:
        started = time.monotonic()
        load(url, libraries, items)
        loaded = time.monotonic() - started
        with daemon(admin_url, url, {}) as storage_url, connect(url) as conn:
            wait_for_partitions(storage_url, libraries, limit=max(600.0, libraries / 50))
            time.sleep(6)  # one more sensor tick on the idle population
            # The storage database's name is in the environment of this daemon's
            # processes only (the URL's last segment is "pgdata" on an embedded server).
            marker = database_name(storage_url)
            cpu_before = (_session_cpu(marker), _server_cpu(conn))
            execute(conn, BURST)
            start = time.monotonic()
            samples: list[tuple[float, int]] = [(0.0, 0)]
            while True:
                execute(conn, "SELECT fold_inventory_changes()")
                row = fetch_one(conn, ACKNOWLEDGED)
                assert row is not None
                elapsed = time.monotonic() - start
                samples.append((elapsed, int(row["done"])))
                if row["done"] >= row["total"]:
                    break
                if window is not None and elapsed >= window:
                    break
                if elapsed > limit:
                    raise RuntimeError(
                        f"burst of {libraries}: {row['done']} of {row['total']}"
                        f" acknowledged after {limit:.0f} s"
                    )
                time.sleep(0.5)
            cpu_after = _session_cpu(marker)
            server_after = _server_cpu(conn)
            with connect(storage_url) as dagster_db:
                runs = fetch_one(dagster_db, RUNS)
                events = {r["kind"]: int(r["n"]) for r in fetch_all(dagster_db, EVENTS)}
    drained = samples[-1][1] >= libraries
    return {
        "libraries": libraries,
        "loaded": loaded,
        "seconds": samples[-1][0] if drained else None,
        "acknowledged": samples[-1][1],
        "followed": samples[-1][0],
        "samples": samples,
        "sustained": (
            rate_between(samples, libraries, 0.1, 0.9) if drained else window_rate(samples)
        ),
        "runs": int(runs["runs"]) if runs else 0,
        "run_seconds": float(runs["run_seconds"] or 0) if runs else 0.0,
        "launch_to_start": float(runs["launch_to_start"] or 0) if runs else 0.0,
        "events": events,
        "cpu_ms": {
            kind: round(cpu / libraries * 1000, 1)
            for kind, cpu in _cpu_by_category(cpu_before[0], cpu_after).items()
        },
        "server_cpu_ms": (
            (server_after - cpu_before[1]) / libraries * 1000
            if server_after is not None and cpu_before[1] is not None
            else math.nan
        ),
        "load": os.getloadavg()[0],
    }


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _server_cpu(conn: Connection) -> float | None:
    """CPU seconds of the server so far: the postmaster, the backends it reaped and the
    ones still running (from /proc; None when the server is not on this machine or not
    readable). On the bench's own server every backend is the bench's."""
    try:
        row = fetch_one(conn, "SELECT split_part(pg_read_file('postmaster.pid'), E'\\n', 1) AS pid")
        postmaster = int(row["pid"])  # type: ignore[index]
        # After the command name: state, ppid, ...; utime, stime, cutime, cstime are the
        # 12th to 15th of these.
        ticks = sum(int(x) for x in _stat(postmaster)[11:15])
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == postmaster:
                continue
            try:
                fields = _stat(int(entry.name))
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == postmaster:
                ticks += int(fields[11]) + int(fields[12])
    except (DatabaseError, OSError, TypeError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def _category(cmdline: bytes) -> str:
    # The default launcher starts each run from the code server as a spawned process.
    if b"multiprocessing" in cmdline or b"execute_run" in cmdline:
        return "run workers"
    if b"api" in cmdline and b"grpc" in cmdline:
        return "code servers"
    return "daemon"


# Whose children a process's reaped-children CPU (cutime + cstime) belongs to: the code
# servers spawn and reap the run workers, the daemon its code servers.
_CHILDREN_OF = {"code servers": "run workers", "daemon": "code servers"}


def _session_cpu(marker: str) -> dict[tuple[int, str], float]:
    """Per process whose environment holds `marker` (the daemon, its code servers and
    run workers): CPU seconds so far by kind, its own and, under its children's kind,
    that of the children it has reaped — a run worker that exited between two samples
    is counted in its code server's, so nothing is lost at the end of a drain."""
    found: dict[tuple[int, str], float] = {}
    needle = marker.encode()
    hz = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            cmdline = (entry / "cmdline").read_bytes()
            fields = _stat(int(entry.name))
        except OSError:
            continue
        pid, kind = int(entry.name), _category(cmdline)
        found[(pid, kind)] = (int(fields[11]) + int(fields[12])) / hz
        reaped = (int(fields[13]) + int(fields[14])) / hz
        if kind in _CHILDREN_OF:
            found[(pid, _CHILDREN_OF[kind])] = reaped
    return found


def _cpu_by_category(
    before: dict[tuple[int, str], float], after: dict[tuple[int, str], float]
) -> dict[str, float]:
    """CPU seconds each kind of Dagster process spent between two samples. A process
    that exited meanwhile is in its parent's reaped total at `after`, whole, so what it
    had spent by `before` is taken off again."""
    spent: dict[str, float] = {}
    for (_, kind), cpu in after.items():
        spent[kind] = spent.get(kind, 0.0) + cpu
    for (_, kind), cpu in before.items():
        spent[kind] = spent.get(kind, 0.0) - cpu
    return spent


def cost(admin_url: str, libraries: int) -> dict[str, float]:
    """CPU per library of the refresh run, in process on a Dagster instance with
    postgres storage: the run's own CPU and the server's (its backends are reaped
    before the reading), for the profile path alone (service.refresh, no Dagster) and
    for the whole op (plus its Dagster events). CPU is what two shared cores run out
    of; unlike wall time it hardly moves with the other work on the machine."""
    import dagster as dg

    from inventory_pipeline.db.connection import create_database, drop_database, url_with_database
    from inventory_pipeline.defs import profile_ranges as ranges
    from inventory_pipeline.defs import profiles as profile_defs
    from inventory_pipeline.defs.resources import InventoryDatabase
    from inventory_pipeline.deployment import dagster_storage_url
    from inventory_pipeline.profiles import service

    result: dict[str, float] = {}
    name = f"inventory_bench_dagster_{uuid.uuid4().hex[:8]}"
    with connect(admin_url) as admin:
        create_database(admin, name)
    try:
        storage = {
            "postgres": {"postgres_url": dagster_storage_url(url_with_database(admin_url, name))}
        }
        with (
            scratch_database(admin_url) as url,
            dg.instance_for_test(overrides={"storage": storage}) as instance,
        ):
            load(url, libraries)
            instance.add_dynamic_partitions(
                ranges.PARTITIONS_NAME,
                sorted({ranges.partition_of(i) for i in range(1, libraries + 1)}),
            )
            db = InventoryDatabase(url=url, run_claims=libraries)
            for label in ("profile path alone", "refresh op with its Dagster events"):
                with connect(url) as conn:
                    execute(conn, BURST)
                    while service.plan(conn, db.policy()).planned:
                        pass
                with connect(admin_url) as admin:
                    server_before = _server_cpu(admin)
                cpu, wall = time.process_time(), time.perf_counter()
                if label == "profile path alone":
                    with connect(url) as conn:
                        done = len(service.refresh(conn, db.policy(), libraries).completions)
                else:
                    run = profile_defs.library_profile_refresh.execute_in_process(
                        instance=instance, resources={"inventory_db": db}
                    )
                    done = int(run.output_for_node("refresh_claimed_profiles"))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                with connect(admin_url) as admin:
                    server_after = _server_cpu(admin)
                server = (
                    server_after - server_before
                    if server_before is not None and server_after is not None
                    else math.nan
                )
                result[f"{label}: run CPU ms/library"] = cpu / done * 1000
                result[f"{label}: server CPU ms/library"] = server / done * 1000
                result[f"{label}: wall ms/library"] = wall / done * 1000
    finally:
        with connect(admin_url) as admin:
            drop_database(admin, name)
    return result


# At 100k a drain at today's rate takes longer than a bench run may: it is followed for
# this many seconds (INVENTORY_BENCH_S2_WINDOW overrides; 0 follows it to the end).
WINDOW_100K = float(os.environ.get("INVENTORY_BENCH_S2_WINDOW", "600"))


def run(admin_url: str, mode: Mode) -> list[Figure]:
    sizes = mode.pick(smoke=[50], default=[1000, 10000], scale=[1000, 10000, 100000])
    figures: list[Figure] = []
    curve: list[tuple[float, float]] = []
    progress: dict[str, list[tuple[float, float]]] = {}
    for libraries in sizes:
        reps = 1 if mode.smoke or libraries >= 100000 else 5 if libraries <= 1000 else 3
        window = (WINDOW_100K or None) if libraries >= 100000 else None
        results = [
            burst(admin_url, libraries, limit=max(600.0, libraries / 5), window=window)
            for _ in range(reps)
        ]
        judged = libraries >= 100000 and not mode.smoke
        drained = [r for r in results if r["seconds"] is not None]
        if drained:
            overall = libraries / statistics.median(r["seconds"] for r in drained)
            figures.append(
                over_runs(
                    f"S2 burst of {libraries} libraries: commit -> all acknowledged",
                    [r["seconds"] for r in drained],
                    " s",
                    f"{overall:.1f} lib/s overall",
                )
            )
        what = (
            "sustained (10% -> 90% acknowledged)"
            if len(drained) == len(results)
            else f"over the first {results[0]['followed']:.0f} s"
            f" ({results[0]['acknowledged']} acknowledged)"
        )
        sustained = [r["sustained"] for r in results]
        figures.append(
            over_runs(
                f"S2 {libraries} libraries: libraries/s {what}",
                sustained,
                " lib/s",
                f"goal >= {GOAL:.0f} lib/s at 100k",
                (lambda v: v >= GOAL) if judged else None,
            )
        )
        last = results[-1]
        cpu = dict(last["cpu_ms"])
        cpu["server"] = last["server_cpu_ms"]
        total = sum(v for v in cpu.values() if not math.isnan(v))
        figures.append(
            Figure(
                f"S2 {libraries} libraries: CPU per library acknowledged (last repetition)",
                total,
                " ms",
                f"two cores give at most {2000 / total:.0f} lib/s at this cost"
                if total > 0
                else "no CPU measured",
                note=", ".join(f"{k} {v:.1f} ms" for k, v in cpu.items())
                + f"; load average {last['load']:.1f}",
            )
        )
        events = last["events"]
        figures.append(
            Figure(
                f"S2 {libraries} libraries: refresh runs (last repetition)",
                last["runs"],
                " runs",
                "Dagster's account",
                note=(
                    f"mean run {last['run_seconds']:.1f} s, launch -> start"
                    f" {last['launch_to_start']:.1f} s;"
                    f" {events.get('ASSET_MATERIALIZATION', 0)} materializations,"
                    f" {events.get('ASSET_CHECK_EVALUATION', 0)} check evaluations"
                ),
            )
        )
        curve.append((float(libraries), statistics.median(sustained)))
        progress[f"{libraries} libraries"] = [(t, n / libraries * 100) for t, n in last["samples"]]
    if len(curve) > 1:
        plot(
            mode.plots / "s2_burst_rate.png",
            "S2: burst drain rate under the daemon (median)",
            "libraries dirtied in one commit",
            "libraries acknowledged per second",
            {"measured": curve, "goal": [(curve[0][0], GOAL), (curve[-1][0], GOAL)]},
            log_x=True,
        )
        plot(
            mode.plots / "s2_burst_progress.png",
            "S2: share acknowledged after the burst's commit (last repetition)",
            "seconds after the commit",
            "% of libraries acknowledged",
            progress,
        )
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_burst")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--smoke", action="store_true")
    sizes.add_argument("--scale", action="store_true")
    parser.add_argument("--sizes", type=int, nargs="*", help="only these library counts")
    parser.add_argument("--reps", type=int, default=1, help="repetitions with --sizes")
    parser.add_argument("--cost", type=int, help="CPU per library over this many libraries")
    parser.add_argument("--window", type=float, help="follow each drain this many seconds")
    parser.add_argument("--items", type=int, help="items per library (default: 10-100)")
    args = parser.parse_args()
    mode = Mode(size=Size.SMOKE if args.smoke else Size.SCALE if args.scale else Size.DEFAULT)
    with server_url() as admin_url:
        if args.cost:
            for key, value in cost(admin_url, args.cost).items():
                print(f"{key}: {value:.1f}", flush=True)
            return 0
        if args.sizes:
            for libraries in args.sizes:
                for _ in range(args.reps):
                    r = burst(
                        admin_url,
                        libraries,
                        limit=max(600.0, libraries / 5),
                        window=args.window,
                        items=args.items,
                    )
                    r.pop("samples")
                    print(r, flush=True)
            return 0
        for figure in run(admin_url, mode):
            print(figure.line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
