"""Stats capability at 1k, 10k and 100k users (issue goals S6-S8).

Part C of the scale work fills this module; until then it measures nothing. It runs in
every mode at the sizes `mode.pick(smoke=..., default=..., scale=...)` selects: tiny under
`--smoke` (CI), the top sizes only under `--scale`.
"""

from __future__ import annotations

from bench.common import Figure, Mode


def run(admin_url: str, mode: Mode) -> list[Figure]:
    """Figures for the stats capability at the sizes `mode` selects."""
    return []
