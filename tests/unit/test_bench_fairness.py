"""The benchmarks' judging rules (no database): the limiter on a sliding one-second
window, unacknowledged changes as failures, medians with their spread, sizes per mode.

Each rule's module is imported in its test, so that a missing rule fails that test alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest


def test_busiest_window_slides_across_calendar_seconds() -> None:
    from bench.observation import busiest_window

    # 30 arrivals in [0.5, 1.0) and 30 in [1.0, 1.5): 30 per calendar second, 60 within
    # one sliding second. A limit of 40/s is exceeded and must be seen as exceeded.
    arrivals = [0.5 + i / 60 for i in range(60)]
    assert busiest_window(arrivals) == 60


def test_busiest_window_counts_a_window_of_one_second_only() -> None:
    from bench.observation import busiest_window

    assert busiest_window([0.0, 1.0, 2.0]) == 1
    assert busiest_window([0.0, 0.999, 1.998]) == 2
    assert busiest_window([]) == 0


def test_unacknowledged_change_is_a_failure_not_a_dropped_sample() -> None:
    from bench.freshness import lag_figures

    lags = [1.0] * 18 + [math.inf] * 2
    figures = {f.name: f for f in lag_figures("inventory", [lags], {0.5: 10, 0.95: 20}, "", True)}
    p95 = figures["inventory p95 (20 changes)"]
    assert math.isinf(p95.value) and p95.met is False
    failed = next(f for name, f in figures.items() if "never acknowledged" in name)
    assert failed.value == 2 and failed.met is False
    assert figures["inventory p50 (20 changes)"].value == 1.0


def test_all_acknowledged_meets_the_goals() -> None:
    from bench.freshness import STATS_GOALS, lag_figures

    figures = lag_figures("stats", [[0.2, 0.3, 0.4], [0.1, 0.2]], STATS_GOALS, "", True)
    assert all(f.met is not False for f in figures)
    assert figures[0].runs == 2


def test_over_runs_reports_median_and_spread() -> None:
    from bench.common import Figure, over_runs

    figure = over_runs("ratio", [1.4, 0.9, 1.1, 1.3, 1.0], "x", "goal >= 1.0x", lambda r: r >= 1)
    assert (figure.value, figure.low, figure.high, figure.runs) == (1.1, 0.9, 1.4, 5)
    assert figure.met is True
    assert "min-max 0.90-1.40, median of 5" in figure.shown()
    assert Figure("one", 2.0, "x", "").shown() == "2.00x"


def test_mode_picks_sizes() -> None:
    from bench.common import Mode, Size

    assert Mode(Size.SMOKE).pick(1, 2, 3) == 1
    assert Mode().pick(1, 2, 3) == 2
    assert Mode(Size.SCALE).pick(1, 2, 3) == 3
    assert Mode(Size.SCALE).pick(1, 2) == 2


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench.common import plot

    path = plot(
        tmp_path / "nested" / "curve.png",
        "tick time",
        "libraries",
        "seconds",
        {"idle": [(1e3, 0.1), (1e4, 0.2), (1e5, 0.4)], "backlog": [(1e3, 0.2), (1e5, 2.1)]},
        log_x=True,
    )
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_queue_sides_rotate_so_each_goes_first_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """In each shape of workers every side goes first once, and the shapes alternate
    which runs first."""
    from bench import queues

    order: list[tuple[bool, str]] = []

    def side(name: str) -> Callable[[str, int, bool], tuple[int, float]]:
        def measure(url: str, n: int, processes: bool) -> tuple[int, float]:
            order.append((processes, name))
            return n, 1.0

        return measure

    monkeypatch.setattr(queues, "SIDES", {name: side(name) for name in queues.SIDES})
    sides = len(queues.SIDES)
    measured = queues.rates("unused", 3, sides)
    assert set(measured) == {(shape, name) for shape in queues.SHAPES for name in queues.SIDES}
    assert all(len(rates) == sides for rates in measured.values())
    blocks = [order[i * sides : (i + 1) * sides] for i in range(len(order) // sides)]
    for shape in queues.SHAPES:
        firsts = [block[0][1] for block in blocks if block[0][0] == shape]
        assert sorted(firsts) == sorted(queues.SIDES)
    assert [blocks[2 * rep][0][0] for rep in range(sides)] == [
        queues.SHAPES[rep % 2] for rep in range(sides)
    ]
