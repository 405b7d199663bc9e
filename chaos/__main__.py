"""`python -m chaos [--seed N] [--seconds S] [--runs K] [--server ...] [--no-daemon]`:
the convergence harness.

Runs on a scratch database of INVENTORY_TEST_DATABASE_URL's server (restarted only
with --restart-shared), or on an embedded PostgreSQL, or on a private cluster it
initializes (--server private). Prints runs, faults, operations, bounds and
divergences; exits 1 when any run diverged, naming the seeds that replay it.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
from pathlib import Path

from chaos import netns
from chaos.partition import PLAN_SECONDS, PLANS, Site
from chaos.run import run
from chaos.servers import EmbeddedChaosServer, PrivateCluster, Server


def _exit_on_terminate(signum: int, frame: object) -> None:
    """A SIGTERM (`timeout`, a CI runner's cancel) unwinds like Ctrl-C, so the run's
    workers, daemon, cluster and namespaces are stopped rather than orphaned; a second
    one does not cut that cleanup short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main() -> int:
    signal.signal(signal.SIGTERM, _exit_on_terminate)
    parser = argparse.ArgumentParser(prog="python -m chaos")
    parser.add_argument("--seed", type=int, help="the first seed (default: random)")
    parser.add_argument(
        "--seconds", type=float, help="chaos per run (default 60; --network: as its plan needs)"
    )
    parser.add_argument("--runs", type=int, default=1, help="consecutive seeds to run")
    parser.add_argument(
        "--server",
        choices=("auto", "embedded", "private"),
        default="auto",
        help="auto: INVENTORY_TEST_DATABASE_URL if set, else embedded; private: a cluster"
        " initialized from --pg-bin on a free port of 127.0.0.1",
    )
    parser.add_argument(
        "--pg-bin", type=Path, default=Path("/usr/lib/postgresql/15/bin"), help="for private"
    )
    parser.add_argument(
        "--restart-shared",
        action="store_true",
        help="let the restart fault restart INVENTORY_TEST_DATABASE_URL's server (only when"
        " nothing else uses it)",
    )
    parser.add_argument(
        "--no-daemon", action="store_true", help="leave the Dagster daemon out (faster)"
    )
    parser.add_argument(
        "--network",
        choices=sorted(PLANS),
        help="on separate hosts (network namespaces, as root) under network faults instead"
        " of process faults: short (one cut and heal) or long (chaos/partition.py)",
    )
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    seconds = args.seconds or (PLAN_SECONDS[args.network] if args.network else 60.0)
    configured = os.environ.get("INVENTORY_TEST_DATABASE_URL")
    server: Server
    site: Site | None = None
    if args.network:
        why = netns.available()
        bindir = args.pg_bin if args.pg_bin.exists() else netns.postgres_bindir()
        if why is not None or bindir is None:
            print(f"--network: {why or 'no PostgreSQL binaries under /usr/lib/postgresql'}")
            return 2
        site = Site.create(args.network, bindir)
        assert site.server is not None
        server = site.server
    elif args.server == "private":
        server = PrivateCluster(args.pg_bin)
    elif args.server == "auto" and configured:
        server = Server(configured, restartable=args.restart_shared)
    else:
        server = EmbeddedChaosServer()
    failed = []
    try:
        for n in range(args.runs):
            report = run(server, seed + n, seconds, daemon=not args.no_daemon, site=site)
            print("\n".join(report.lines()), flush=True)
            if report.divergences:
                failed.append(seed + n)
    finally:
        if site is not None:
            site.close()  # the server with it
        else:
            server.stop()
    if failed:
        print(f"diverged: seeds {failed}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
