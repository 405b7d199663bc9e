"""Retry-After (RFC 9110 section 10.2.3) as bounded, sanitized timing evidence.

Accepts delay-seconds and the three HTTP-date forms (IMF-fixdate, obsolete RFC 850
and asctime); a date without a zone is UTC; a past date clamps to zero. Negative,
fractional and garbage values are rejected; a delay of any length, and a date however
far, is capped. Parsing never
raises: anything unusable is None. Only the resulting number of seconds is kept.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

MAX_RETRY_AFTER_SECONDS = 7 * 24 * 3600
_DELAY = re.compile(r"^[0-9]+$")
_DELAY_DIGITS = 12  # more digits than this is over any cap: not converted
_FORMATS = (
    "%a, %d %b %Y %H:%M:%S GMT",  # IMF-fixdate
    "%A, %d-%b-%y %H:%M:%S GMT",  # obsolete RFC 850
    "%a %b %d %H:%M:%S %Y",  # asctime
    "%a %b  %d %H:%M:%S %Y",  # asctime, single-digit day padded with a space
)
_MAX_HEADER_LENGTH = 64


def parse_retry_after(
    value: str | None,
    now: datetime | None = None,
    cap_seconds: int = MAX_RETRY_AFTER_SECONDS,
) -> int | None:
    """Seconds to wait, capped at `cap_seconds`, or None when the value is unusable."""
    try:
        if value is None:
            return None
        text = value.strip()
        if text.isascii() and _DELAY.match(text):
            return cap_seconds if len(text) > _DELAY_DIGITS else min(int(text), cap_seconds)
        if not text or len(text) > _MAX_HEADER_LENGTH or not text.isascii():
            return None
        if text[0] in "+-" or text.replace(".", "", 1).isdigit():
            return None  # signed or fractional delay-seconds are not valid
        moment = _parse_date(text)
        if moment is None:
            return None
        current = now or datetime.now(UTC)
        if current.tzinfo is None:
            current = current.replace(tzinfo=UTC)
        seconds = (moment - current).total_seconds()
        return min(max(int(seconds), 0), cap_seconds)
    except (ValueError, OverflowError, TypeError, AttributeError):
        return None


def _parse_date(text: str) -> datetime | None:
    for fmt in _FORMATS:
        try:
            parsed = datetime.strptime(text, fmt)
        except ValueError:
            continue
        if fmt.startswith("%A, %d-%b-%y") and parsed.year < 1970:
            parsed = parsed.replace(year=parsed.year + 100)
        return parsed.replace(tzinfo=UTC)  # HTTP dates are GMT; naive dates are UTC
    return None
