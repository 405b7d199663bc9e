"""Change capture cost on a 100k-item sync (docs/profiles.md#change-capture; BENCHMARKS.md).

Same statements, same server, same run, four ways: triggers disabled (baseline), the
project's statement-level capture, a no-op trigger that only declares transition
tables (the mechanism's floor) and a naive row-level trigger. Each measurement starts
from a vacuumed table; the figure is the median over repetitions, as a ratio to the
disabled baseline.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.common import Figure, Mode, median, over_runs, scratch_database, timed
from inventory_pipeline.db import Connection, connect, execute, fetch_one
from inventory_pipeline.db.connection import execute_script
from inventory_pipeline.db.queries import load_queries

Q = load_queries("bench", "variants.sql")
VARIANTS = ("disabled", "statement", "noop", "row")
SCENARIOS = ("insert", "relevant_update", "unchanged_sync")


def _configure(conn: Connection, variant: str) -> None:
    execute_script(conn, Q["drop_variants"])
    execute_script(conn, Q["disable_capture"] if variant != "statement" else Q["enable_capture"])
    if variant == "noop":
        execute_script(conn, Q["install_noop"])
    elif variant == "row":
        execute_script(conn, Q["install_row"])


def _revisions(conn: Connection) -> int:
    row = fetch_one(conn, Q["revisions"])
    assert row is not None
    return int(row["total"])


def _measure(conn: Connection, variant: str, items: int) -> tuple[dict[str, float], int]:
    _configure(conn, variant)
    execute(conn, Q["truncate_items"])
    execute(conn, "VACUUM media_server_items")
    times = {"insert": timed(lambda: execute(conn, Q["sync_insert"], {"items": items}))}
    execute(conn, "VACUUM media_server_items")
    times["relevant_update"] = timed(lambda: execute(conn, Q["sync_relevant_update"]))
    execute(conn, "VACUUM media_server_items")
    before = _revisions(conn)
    times["unchanged_sync"] = timed(lambda: execute(conn, Q["sync_unchanged"]))
    bumps = _revisions(conn) - before
    return times, bumps


def run(admin_url: str, mode: Mode) -> list[Figure]:
    """The goals at the recommended work_mem, then the 4MB default for comparison."""
    smoke = mode.smoke
    figures = measure(admin_url, smoke, "64MB", VARIANTS)
    if not smoke:
        figures += measure(admin_url, smoke, "4MB", ("disabled", "statement"), judged=False)
    return figures


def measure(
    admin_url: str,
    smoke: bool,
    work_mem: str,
    variants: tuple[str, ...],
    judged: bool = True,
) -> list[Figure]:
    items = 2_000 if smoke else 100_000
    reps = 1 if smoke else 5
    samples: dict[str, dict[str, list[float]]] = {v: {s: [] for s in SCENARIOS} for v in variants}
    unchanged_bumps = 0
    with scratch_database(admin_url) as url, connect(url) as conn:
        execute(conn, f"SET work_mem = '{work_mem}'")  # fixed literal, not user input
        execute_script(conn, Q["setup_libraries"])
        for rep in range(reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for variant in order:
                if variant == "row" and rep > 0:
                    continue  # quadratic in rows per library: one sample is plenty
                times, bumps = _measure(conn, variant, items)
                for scenario, seconds in times.items():
                    samples[variant][scenario].append(seconds)
                if variant == "statement":
                    unchanged_bumps += bumps
        _configure(conn, "statement")
    base = {s: median(samples["disabled"][s]) for s in SCENARIOS}

    def ratios(variant: str, scenario: str) -> list[float]:
        """Each run's time against the same run's baseline (runs alternate the order)."""
        return [
            t / b
            for t, b in zip(samples[variant][scenario], samples["disabled"][scenario], strict=False)
        ]

    goals: dict[str, tuple[float, Callable[[float], bool]]] = {
        "insert": (1.15, lambda r: r <= 1.15),
        "relevant_update": (1.35, lambda r: r <= 1.35),
        "unchanged_sync": (1.35, lambda r: r <= 1.35),
    }
    label = f"{items // 1000}k items, work_mem {work_mem}"
    figures = []
    for scenario in SCENARIOS:
        limit, ok = goals[scenario]
        overhead = (median(samples["statement"][scenario]) - base[scenario]) * 1000
        figures.append(
            over_runs(
                f"capture {scenario} vs triggers disabled ({label})",
                ratios("statement", scenario),
                "x",
                f"goal <= {limit}x; baseline {base[scenario] * 1000:.0f} ms,"
                f" capture adds {overhead:.0f} ms (medians)",
                None if smoke or not judged else ok,
            )
        )
        if "noop" not in variants:
            continue
        figures.append(
            over_runs(
                f"  floor: no-op transition-table trigger, {scenario}",
                ratios("noop", scenario),
                "x",
                "for comparison",
            )
        )
        figures.append(
            over_runs(
                f"  naive row-level trigger, {scenario} (first run only)",
                ratios("row", scenario),
                "x",
                "for comparison",
            )
        )
    figures.append(
        Figure(
            f"capture unchanged_sync revision bumps ({label})",
            unchanged_bumps,
            "",
            "goal 0",
            unchanged_bumps == 0,
        )
    )
    return figures
