"""Retry-After parsing (RFC 9110): every accepted form, and the bad ones rejected."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from inventory_pipeline.provider.retry_after import MAX_RETRY_AFTER_SECONDS, parse_retry_after

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("120", 120),
        ("0", 0),
        (" 30 ", 30),
        ("Mon, 30 Nov 2026 12:02:00 GMT", 120),  # IMF-fixdate
        ("Monday, 30-Nov-26 12:01:00 GMT", 60),  # obsolete RFC 850
        ("Mon Nov 30 12:00:45 2026", 45),  # asctime (no zone: UTC)
        ("Mon Nov  2 12:00:00 2026", 0),  # asctime, padded day, in the past: clamps to 0
        ("Sun, 29 Nov 2026 12:00:00 GMT", 0),  # past date clamps to zero
        ("99999999999", MAX_RETRY_AFTER_SECONDS),  # absurdly large is capped
        ("1" * 13, MAX_RETRY_AFTER_SECONDS),  # however many digits
        pytest.param("9" * 10_000, MAX_RETRY_AFTER_SECONDS, id="10,000 digits"),
        ("Fri, 31 Dec 9999 23:59:59 GMT", MAX_RETRY_AFTER_SECONDS),
    ],
)
def test_accepted(value: str, seconds: int) -> None:
    assert parse_retry_after(value, NOW) == seconds


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "-5",
        "+5",
        "1.5",
        ".5",
        "soon",
        "12abc",
        "Mon, 32 Nov 2026 12:00:00 GMT",
        "Mon, 30 Nov 2026 25:00:00 GMT",
        "30 Nov 2026",
        "x" * 10_000,
        "\uff11\uff12\uff10",  # non-ASCII (fullwidth) digits
        "Mon, 30 Nov 2026 12:02:00 PST",
    ],
)
def test_rejected(value: str | None) -> None:
    assert parse_retry_after(value, NOW) is None


def test_naive_now_is_utc() -> None:
    naive = NOW.replace(tzinfo=None)
    assert parse_retry_after("Mon, 30 Nov 2026 12:00:10 GMT", naive) == 10
