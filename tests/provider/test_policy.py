"""Retry policy: capped exponential backoff whose jitter spreads retries without ever
going under the category's start or over the cap."""

from __future__ import annotations

import random

import pytest

from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.recovery.policy import DAY, HOUR, RetryPolicy

POLICY = RetryPolicy()
DRAWS = 2000


@pytest.mark.parametrize(
    ("category", "start"),
    [
        ("transient", 6 * HOUR),
        ("throttled", 6 * HOUR),
        ("not_found", DAY),
        ("configuration", DAY),
        ("invalid_response", DAY),
        ("auth", DAY),  # authentication cooldowns: 24 hours to seven days
    ],
)
def test_jitter_stays_between_start_and_cap(category: str, start: int) -> None:
    rng = random.Random(1)
    for attempt in range(1, 12):
        delays = [POLICY.delay(category, attempt, rng=rng) for _ in range(DRAWS)]  # type: ignore[arg-type]
        assert min(delays) >= start, f"attempt {attempt} went under the start"
        assert max(delays) <= 7 * DAY
        assert len(set(delays)) > DRAWS // 2  # spread, not one synchronized instant
        # Each failure doubles the window until the cap: the least delay of a later
        # attempt is at least the start doubled (attempt - 1) times, halved by jitter.
        assert min(delays) >= min(7 * DAY // 2, start * 2 ** (attempt - 1))


def test_first_attempt_window_is_start_to_twice_start() -> None:
    rng = random.Random(3)
    delays = [POLICY.delay("transient", 1, rng=rng) for _ in range(DRAWS)]
    assert 6 * HOUR <= min(delays) < 6.5 * HOUR and 11.5 * HOUR < max(delays) <= 12 * HOUR


def test_retry_after_only_lengthens() -> None:
    rng = random.Random(2)
    assert POLICY.delay("throttled", 1, retry_after_seconds=1, rng=rng) >= 6 * HOUR
    assert POLICY.delay("throttled", 1, retry_after_seconds=3 * DAY, rng=rng) == 3 * DAY
    assert POLICY.delay("throttled", 1, retry_after_seconds=99 * DAY, rng=rng) == 7 * DAY


def test_probe_backoff_spreads_between_fifteen_minutes_and_six_hours() -> None:
    rng = random.Random(4)
    for failures in range(0, 12):
        delays = [credentials.backoff_seconds(failures, rng) for _ in range(DRAWS)]
        assert min(delays) >= 15 * 60 and max(delays) <= 6 * HOUR
        assert len(set(delays)) > DRAWS // 4, f"no spread after {failures} failures"
