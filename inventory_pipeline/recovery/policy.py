"""Retry policy (seed 003): capped exponential backoff with full jitter.

Transient failures (and throttling) start at six hours; missing identities and
configuration, authentication or response problems start at one day; both cap at
seven days. A valid Retry-After can only lengthen a delay. The floor keeps full jitter
from ever producing an immediate retry.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from inventory_pipeline.provider.models import Category

HOUR = 3600
DAY = 24 * HOUR


@dataclass(frozen=True)
class RetryPolicy:
    transient_base_seconds: int = 6 * HOUR
    slow_base_seconds: int = DAY
    cap_seconds: int = 7 * DAY
    floor_seconds: int = 300  # one lease length: never an immediate retry
    refresh_seconds: int = 30 * DAY  # periodic re-observation after a success

    def base(self, category: Category) -> int:
        if category in ("transient", "throttled"):
            return self.transient_base_seconds
        return self.slow_base_seconds

    def delay(
        self,
        category: Category,
        attempt: int,
        retry_after_seconds: int | None = None,
        rng: random.Random | None = None,
    ) -> int:
        """Seconds until the next eligible attempt after failed attempt number `attempt`."""
        ceiling = min(self.cap_seconds, self.base(category) * 2 ** max(attempt - 1, 0))
        jittered = (rng or random).uniform(0, ceiling)
        delay = max(self.floor_seconds, int(jittered))
        if retry_after_seconds is not None:
            delay = max(delay, min(retry_after_seconds, self.cap_seconds))
        return delay
