"""A database client for the partition tests, run on a host of its own.

`hold URL`: lock row 1 of `held` in a transaction, then run a statement that sleeps
3 s and returns 100 MB (the test cuts the link meanwhile, so the server is left
sending into a silent network with the lock held). `call URL`: connect, print
"connected", wait for a line on stdin, run one statement and print how it ended.
Both use the product's `connect`, so they carry its connection settings.
"""

from __future__ import annotations

import sys
import time

from inventory_pipeline.db import DatabaseError, connect, fetch_one, transaction

HOLD = (
    "WITH pause AS (SELECT pg_sleep(3)) "
    "SELECT repeat('x', 1000) AS filler FROM pause, generate_series(1, 100000)"
)


def main(argv: list[str]) -> int:
    mode, url = argv
    conn = connect(url, application_name=f"partition.{mode}")
    if mode == "hold":
        with transaction(conn):
            fetch_one(conn, "SELECT id FROM held WHERE id = 1 FOR UPDATE")
            print("locked", flush=True)
            conn.execute(HOLD).fetchall()
        return 0
    print("connected", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    try:
        fetch_one(conn, "SELECT 1 AS one")
    except DatabaseError as exc:
        print(f"{type(exc).__name__} after {time.monotonic() - started:.1f} s", flush=True)
        return 1
    print(f"answered after {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
