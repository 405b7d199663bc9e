"""Retry policy: capped exponential backoff with full jitter, never immediate."""

from __future__ import annotations

import random

import pytest

from inventory_pipeline.recovery.policy import DAY, HOUR, RetryPolicy

POLICY = RetryPolicy()


@pytest.mark.parametrize(
    ("category", "base"),
    [
        ("transient", 6 * HOUR),
        ("throttled", 6 * HOUR),
        ("not_found", DAY),
        ("configuration", DAY),
        ("invalid_response", DAY),
        ("auth", DAY),
    ],
)
def test_ceiling_doubles_from_base_and_caps_at_seven_days(category: str, base: int) -> None:
    rng = random.Random(1)
    for attempt in range(1, 12):
        ceiling = min(7 * DAY, base * 2 ** (attempt - 1))
        delays = [POLICY.delay(category, attempt, rng=rng) for _ in range(200)]  # type: ignore[arg-type]
        assert all(POLICY.floor_seconds <= d <= ceiling for d in delays)
        assert max(delays) > ceiling * 0.8  # full jitter reaches the ceiling


def test_retry_after_only_lengthens() -> None:
    rng = random.Random(2)
    assert POLICY.delay("throttled", 1, retry_after_seconds=1, rng=rng) >= POLICY.floor_seconds
    assert POLICY.delay("throttled", 1, retry_after_seconds=3 * DAY, rng=rng) == 3 * DAY
    assert POLICY.delay("throttled", 1, retry_after_seconds=99 * DAY, rng=rng) == 7 * DAY
