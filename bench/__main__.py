"""`python -m bench [--smoke] [--only NAME ...]`: run the benchmarks, print figures.

Every figure is a ratio measured in the same run against a baseline. `--smoke` runs
tiny sizes to prove the benchmarks still work (CI); figures from it mean nothing.
Exits non-zero only when a benchmark cannot run.
"""

from __future__ import annotations

import argparse
import sys

from bench import (
    change_capture,
    observation,
    orchestration,
    profile_generation,
    queues,
    stats,
)
from bench.common import Figure, server_url

BENCHES = {
    "change_capture": change_capture.run,
    "profile_generation": profile_generation.run,
    "queues": queues.run,
    "orchestration": orchestration.run,
    "observation": observation.run,
    "stats": stats.run,
}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, figures not judged")
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHES), help="run only these")
    args = parser.parse_args()
    names = args.only or list(BENCHES)
    with server_url() as admin_url:
        for name in names:
            print(f"== {name} ==", flush=True)
            figures: list[Figure] = BENCHES[name](admin_url, args.smoke)
            for figure in figures:
                print(figure.line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
