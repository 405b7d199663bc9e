"""Retry policy: capped exponential backoff with equal jitter.

Transient failures (and throttling) start at six hours; missing identities and
configuration, authentication or response problems start at one day; both cap at
seven days. Failed attempt n waits a random time in [w / 2, w] with
w = min(cap, 2 * start * 2^(n - 1)): the first failure waits between the start and twice
the start, each further failure doubles the window, and no draw is ever under the start
or over the cap (full jitter, drawing from zero, would retry minutes after a failure).
A valid Retry-After can only lengthen a delay.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from inventory_pipeline.provider.models import Category

HOUR = 3600
DAY = 24 * HOUR


def equal_jitter(start: int, cap: int, failures: int, rng: random.Random | None = None) -> int:
    """Seconds to wait after `failures` consecutive failures (1 = the first): uniform in
    the upper half of a window that starts at twice `start` and doubles per failure up
    to `cap`; never under `start`, never over `cap`."""
    window = min(cap, 2 * start * 2 ** max(failures - 1, 0))
    low = max(start, window / 2)
    return int((rng or random).uniform(low, max(low, window)))


@dataclass(frozen=True)
class RetryPolicy:
    transient_base_seconds: int = 6 * HOUR
    slow_base_seconds: int = DAY
    cap_seconds: int = 7 * DAY
    # An absolute lower bound under every delay: the starts already keep real delays
    # above it; shortened clocks (the chaos harness) set it explicitly.
    floor_seconds: int = 300
    refresh_seconds: int = 30 * DAY  # periodic re-observation after a success
    # An attempt a transient database error interrupted (its answer could not be saved)
    # is due again this much later, with no attempt counted: no run sends it again at once
    # (docs/provider-recovery.md#database-errors).
    interrupted_seconds: int = 60

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
        start = min(self.base(category), self.cap_seconds)
        delay = max(self.floor_seconds, equal_jitter(start, self.cap_seconds, attempt, rng))
        if retry_after_seconds is not None:
            delay = max(delay, min(retry_after_seconds, self.cap_seconds))
        return delay
