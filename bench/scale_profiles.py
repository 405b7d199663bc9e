"""Profile capability at 1k, 10k and 100k libraries (issue goals S1-S5).

Part B of the scale work fills this module; until then it measures nothing. It runs in
every mode at the sizes `mode.pick(smoke=..., default=..., scale=...)` selects: tiny under
`--smoke` (CI), the top sizes only under `--scale`.
"""

from __future__ import annotations

from bench.common import Figure, Mode


def run(admin_url: str, mode: Mode) -> list[Figure]:
    """Figures for the profile capability at the sizes `mode` selects."""
    return []
