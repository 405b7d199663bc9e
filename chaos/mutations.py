"""`python -m chaos.mutations [GUARD ...] [--sample N] [--chaos-seconds S] [--list]`:
remove each guard the product's correctness rests on, one at a time, and see whether
anything notices.

Each guard of `chaos.guards.GUARDS` is removed in a scratch copy of the repository (its
exact text replaced, the copy's package imported ahead of any installed one); then the
guard's deterministic tests run, and with --chaos-seconds a short chaos run on a
private cluster. A guard is caught when a test fails or the run diverges. First the
unmutated copy must pass the same tests: a test that fails without a mutation proves
nothing. A shadowed guard (another guard makes it have no effect of its own) runs too,
but is not scored: its removal must go unnoticed, or it is not shadowed. Prints one line
per guard and the score, caught / scored; exits 1 when a scored guard was not caught or
a shadowed one was.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from chaos.guards import GUARDS, Guard

REPO = Path(__file__).resolve().parents[1]
COPIED: tuple[str, ...] = ("pyproject.toml", "inventory_pipeline", "migrations", "chaos")
COPIED += ("tests", "bench", "dagster.yaml", "workspace.yaml")


@dataclass(frozen=True)
class Verdict:
    guard: Guard
    failed_test: str | None  # the first test that failed ("" when none could be named)
    chaos_diverged: bool | None  # None: no chaos run
    seconds: float

    @property
    def caught(self) -> bool:
        return self.failed_test is not None or bool(self.chaos_diverged)


def scratch_copy(into: Path) -> Path:
    """The repository's files as a fresh tree (no caches, no virtualenv, no .git)."""
    root = into / "repo"
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache")
    for name in COPIED:
        origin = REPO / name
        if origin.is_dir() and not origin.is_symlink():
            shutil.copytree(origin, root / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(origin, root / name, follow_symlinks=False)
    return root


def remove(root: Path, guard: Guard) -> None:
    """Replace the guard's text (and its further places), each exactly once in its file."""
    for where, old, new in guard.edits:
        path = root / where
        text = path.read_text("utf-8")
        found = text.count(old)
        if found != 1:
            raise SystemExit(f"{guard.name}: a text occurs {found} times in {where}")
        path.write_text(text.replace(old, new), "utf-8")


def environment(root: Path) -> dict[str, str]:
    """The copy's package ahead of the installed (editable) one."""
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}


def failing_test(root: Path, tests: Sequence[str]) -> str | None:
    """The first of `tests` that fails in the copy (None: all pass)."""
    # Its own --basetemp: pytest prunes a user's older temporary folders, which would
    # pull tmp_path from under a concurrent session (CI's passes).
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    command += [f"--basetemp={root.parent / 'pytest'}", *tests]
    result = subprocess.run(command, cwd=root, env=environment(root), capture_output=True)
    if result.returncode == 0:
        return None
    failed = [line for line in result.stdout.decode().splitlines() if line.startswith("FAILED ")]
    return failed[0].split()[1] if failed else ""


def chaos_diverges(root: Path, seconds: float, seed: int) -> bool:
    command = [sys.executable, "-m", "chaos", "--server", "private", "--no-daemon"]
    command += ["--seconds", str(seconds), "--seed", str(seed)]
    result = subprocess.run(command, cwd=root, env=environment(root), capture_output=True)
    return result.returncode != 0


def control(guards: Sequence[Guard], chaos_seconds: float = 0.0, seed: int = 0) -> None:
    """The unmutated copy passes every test the guards name, and the chaos run the
    mutated copies get (a run that fails on its own, say a fault not exercised in a
    short run, would score every guard as caught)."""
    tests = sorted({t for g in guards for t in g.tests})
    with tempfile.TemporaryDirectory(prefix="inventory-mutation-") as tmp:
        root = scratch_copy(Path(tmp))
        failed = failing_test(root, tests) if tests else None
        if failed is not None:
            raise SystemExit(f"the unmutated copy fails the guards' tests: {failed or tests}")
        if chaos_seconds > 0 and chaos_diverges(root, chaos_seconds, seed):
            raise SystemExit(
                f"the unmutated copy diverges under chaos (seed {seed}, {chaos_seconds:g} s)"
            )


def judge(guard: Guard, chaos_seconds: float, seed: int) -> Verdict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="inventory-mutation-") as tmp:
        root = scratch_copy(Path(tmp))
        remove(root, guard)
        failed = failing_test(root, guard.tests) if guard.tests else None
        diverged = chaos_diverges(root, chaos_seconds, seed) if chaos_seconds > 0 else None
    return Verdict(guard, failed, diverged, time.monotonic() - started)


def sample(guards: Sequence[Guard], size: int, key: str) -> list[Guard]:
    """`size` guards chosen by `key` (CI passes the commit): each commit rotates."""
    start = int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(guards)
    return [guards[(start + n) % len(guards)] for n in range(min(size, len(guards)))]


def line(verdict: Verdict) -> str:
    guard = verdict.guard
    chaos = {None: "", True: ", chaos diverged", False: ", chaos converged"}
    found = "caught" if verdict.caught else "NOT CAUGHT"
    if guard.shadowed_by is not None:
        found = f"{'caught' if verdict.caught else 'not caught'}, shadowed by {guard.shadowed_by}"
    tests = "tests passed" if verdict.failed_test is None else f"failed {verdict.failed_test}"
    return (
        f"{guard.name}: {found} ({tests}{chaos[verdict.chaos_diverged]};"
        f" {verdict.seconds:.0f} s) - {guard.path}: {guard.protects}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.mutations")
    parser.add_argument("guards", nargs="*", help="guard names (default: every guard)")
    parser.add_argument("--sample", type=int, help="only this many guards, rotated by --key")
    parser.add_argument("--key", default="", help="what rotates the sample (CI: the commit)")
    parser.add_argument("--chaos-seconds", type=float, default=0.0, help="0: no chaos run")
    parser.add_argument("--seed", type=int, default=4242, help="the chaos run's seed")
    parser.add_argument("--list", action="store_true", help="list the guards and stop")
    args = parser.parse_args(argv)
    known = {g.name: g for g in GUARDS}
    unknown = [name for name in args.guards if name not in known]
    if unknown:
        parser.error(f"unknown guards: {', '.join(unknown)} (see --list)")
    chosen = [known[name] for name in args.guards] or list(GUARDS)
    if args.list:
        for guard in GUARDS:
            shadow = f" [shadowed: {guard.shadowed_by}]" if guard.shadowed_by else ""
            print(f"{guard.name}: {guard.path}: {guard.protects}{shadow}")
        return 0
    if args.sample is not None:
        chosen = sample([g for g in chosen if g.shadowed_by is None], args.sample, args.key)
    control(chosen, args.chaos_seconds, args.seed)
    verdicts = []
    for guard in chosen:
        verdict = judge(guard, args.chaos_seconds, args.seed)
        verdicts.append(verdict)
        print(line(verdict), flush=True)
    scored = [v for v in verdicts if v.guard.shadowed_by is None]
    caught = sum(v.caught for v in scored)
    # A shadowed guard's removal must change nothing; if it is caught, it is not shadowed.
    wrong = [v.guard.name for v in verdicts if v.guard.shadowed_by is not None and v.caught]
    print(f"score: {caught}/{len(scored)} guards caught", flush=True)
    if wrong:
        print(f"caught although listed as shadowed (score them): {', '.join(wrong)}")
    return 0 if caught == len(scored) and not wrong else 1


if __name__ == "__main__":
    raise SystemExit(main())
