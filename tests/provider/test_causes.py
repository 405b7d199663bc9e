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
        ("status", {"status": 503}, "transient", "HTTP 5xx"),
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
