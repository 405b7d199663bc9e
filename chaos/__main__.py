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
from pathlib import Path

from chaos.run import run
from chaos.servers import EmbeddedChaosServer, PrivateCluster, Server


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos")
    parser.add_argument("--seed", type=int, help="the first seed (default: random)")
    parser.add_argument("--seconds", type=float, default=60.0, help="chaos per run")
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
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    configured = os.environ.get("INVENTORY_TEST_DATABASE_URL")
    server: Server
    if args.server == "private":
        server = PrivateCluster(args.pg_bin)
    elif args.server == "auto" and configured:
        server = Server(configured, restartable=args.restart_shared)
    else:
        server = EmbeddedChaosServer()
    failed = []
    try:
        for n in range(args.runs):
            report = run(server, seed + n, args.seconds, daemon=not args.no_daemon)
            print("\n".join(report.lines()), flush=True)
            if report.divergences:
                failed.append(seed + n)
    finally:
        server.stop()
    if failed:
        print(f"diverged: seeds {failed}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
