"""`python -m chaos [--seed N] [--seconds S] [--runs K]`: the convergence harness.

Runs against a scratch database on INVENTORY_TEST_DATABASE_URL's server, or on an
embedded PostgreSQL. Prints runs, kills, operations and divergences; exits 1 when any
run diverged, naming the seed that replays it.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
from pathlib import Path

from chaos.run import run
from inventory_pipeline.db.connection import url_with_database


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos")
    parser.add_argument("--seed", type=int, help="the first seed (default: random)")
    parser.add_argument("--seconds", type=float, default=60.0, help="chaos per run")
    parser.add_argument("--runs", type=int, default=1, help="consecutive seeds to run")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    configured = os.environ.get("INVENTORY_TEST_DATABASE_URL")
    server = None
    folder = None
    if configured:
        admin_url = url_with_database(configured, "postgres")
    else:
        from inventory_pipeline.db.embedded import EmbeddedServer

        folder = Path(tempfile.mkdtemp(prefix="inventory-chaos-pg-"))
        server = EmbeddedServer(folder / "pgdata")
        server.start()
        admin_url = server.url("postgres")
    failed = []
    try:
        for n in range(args.runs):
            report = run(admin_url, seed + n, args.seconds)
            print("\n".join(report.lines()), flush=True)
            if report.divergences:
                failed.append(seed + n)
    finally:
        if server is not None:
            server.stop()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    if failed:
        print(f"diverged: seeds {failed}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
