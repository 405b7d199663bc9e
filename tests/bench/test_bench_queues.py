"""The queue comparison runs Procrastinate with its defaults and with a matched pool."""

from __future__ import annotations

import pytest

from bench import queues


def test_queue_comparison_reports_procrastinate_defaults_and_matched_pool(
    server_url: str,
) -> None:
    pytest.importorskip("procrastinate")
    from bench.common import Mode, Size

    figures = {f.name.strip(): f for f in queues.run(server_url, Mode(Size.SMOKE))}
    for ours in ("profile", "stats"):
        for peer in ("defaults", "matched pool"):
            ratio = figures[f"{ours} vs Procrastinate {peer}"]
            assert ratio.value > 0 and ratio.runs == 1
    assert any("pool matched to ours" in name for name in figures)
