"""The cause of a failed attempt, as the case warning shows it: a fixed label per HTTP
status class or transport failure, never provider text."""

from __future__ import annotations

from typing import Any

import pytest

from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service
from inventory_pipeline.recovery.models import ObservationResult
from tests.conftest import TMDB_TEST_KEY


@pytest.mark.parametrize(
    ("fault", "options", "category", "cause"),
    [
        ("status", {"status": 503}, "transient", "HTTP 503"),
        ("status", {"status": 502}, "transient", "HTTP 5xx"),
        ("status", {"status": 404}, "not_found", "HTTP 404"),
        ("status", {"status": 418}, "invalid_response", "HTTP 4xx"),
        ("throttle", {"retry_after": "5"}, "throttled", "HTTP 429"),
        ("slow", {"delay": 2.0}, "transient", "timeout"),
        ("close", {}, "transient", "connection error"),
        ("garbage", {}, "invalid_response", "HTTP 200, invalid body"),
    ],
)
def test_each_failure_carries_its_cause(
    standin: StandIn,
    client: TmdbClient,
    fault: str,
    options: dict[str, Any],
    category: str,
    cause: str,
) -> None:
    standin.set_fault(fault, **options)
    failure = client.fetch("movie", 11, TMDB_TEST_KEY)
    assert (getattr(failure, "category", None), getattr(failure, "cause", None)) == (
        category,
        cause,
    )


def test_the_case_warning_names_the_cause() -> None:
    opened = ObservationResult(7, "failed", "transient", "opened", cause="HTTP 5xx")
    level, message = service.notice(opened) or ("", "")
    assert level == "warning" and "(transient: HTTP 5xx)" in message
    changed = ObservationResult(
        7, "failed", "throttled", "cause_changed", previous_category="transient", cause="HTTP 429"
    )
    assert "transient -> throttled: HTTP 429" in (service.notice(changed) or ("", ""))[1]


def test_an_item_label_is_one_bounded_escaped_line() -> None:
    """Inventory text is anyone's: a warning or `status` line carries neither its
    control characters nor its length."""
    assert service.item_label("The Matrix", "movie", "603") == '"The Matrix" (tmdb movie "603")'
    label = service.item_label("a\x1b[2J\nb" + "c" * 100, "mo\nvie", "9" * 40)
    assert "\x1b" not in label and "\n" not in label and len(label) < 120
    assert label.startswith('"a [2J b') and '(tmdb "mo vie" "9999' in label
