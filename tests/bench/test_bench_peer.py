"""The stats-against-Procrastinate bench runs both workloads on both sides at tiny size."""

from __future__ import annotations

import pytest

from bench import peer


def test_peer_comparison_reports_both_sides_of_both_workloads(server_url: str) -> None:
    pytest.importorskip("procrastinate")
    from bench.common import Mode, Size

    figures = {f.name.strip(): f for f in peer.run(server_url, Mode(Size.SMOKE))}
    for side in ("ours", "Procrastinate peer"):
        assert figures[f"{side} save -> published p95"].value > 0
        assert figures[f"{side} saves never published within 30 s of the last"].value == 0
    assert figures["ours p95 vs peer p95"].met is None  # smoke figures are not judged
    assert any(name.startswith("rebuild of all 50 users") for name in figures)
    assert figures["ours vs peer (users/s)"].value > 0
    assert any(name.startswith("largest account") for name in figures)
