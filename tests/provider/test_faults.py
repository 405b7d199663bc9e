"""Provider faults over real loopback HTTP: every fault of the list yields the
right category and bounded Retry-After evidence from the client, and, through the
observation service, exactly one request per attempt and one bounded due retry."""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from inventory_pipeline.db import Connection, fetch_one
from inventory_pipeline.provider.models import Failure
from inventory_pipeline.provider.retry_after import MAX_RETRY_AFTER_SECONDS
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.policy import RetryPolicy
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY

KEY = TMDB_TEST_KEY
AHEAD = timedelta(seconds=120)


def _dates() -> dict[str, str]:
    moment = datetime.now(UTC) + AHEAD
    return {
        "IMF-fixdate": format_datetime(moment, usegmt=True),
        "RFC 850": moment.strftime("%A, %d-%b-%y %H:%M:%S GMT"),
        "asctime": f"{moment:%a %b} {moment.day:2d} {moment:%H:%M:%S %Y}",
    }


@pytest.mark.parametrize(
    ("fault", "options", "category"),
    [
        ("status", {"status": 401}, "auth"),
        ("status", {"status": 502}, "transient"),
        ("cut_json", {}, "invalid_response"),
        ("gzip_bomb", {}, "invalid_response"),
        ("truncate", {}, "transient"),  # hangs up mid-body
    ],
)
def test_more_faults_become_categories(
    standin: StandIn, client: TmdbClient, fault: str, options: dict[str, object], category: str
) -> None:
    standin.set_fault(fault, **options)
    result = client.fetch("movie", 11, KEY)
    assert isinstance(result, Failure) and result.category == category
    assert len(standin.state.arrivals) == 1  # one request: the client never loops


@pytest.mark.parametrize("form", ["IMF-fixdate", "RFC 850", "asctime"])
def test_retry_after_dates_over_http(standin: StandIn, client: TmdbClient, form: str) -> None:
    standin.set_fault("throttle", retry_after=_dates()[form])
    result = client.fetch("movie", 11, KEY)
    assert isinstance(result, Failure) and result.category == "throttled"
    assert result.retry_after_seconds is not None
    assert AHEAD.total_seconds() - 5 <= result.retry_after_seconds <= AHEAD.total_seconds()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5", 5),
        ("-5", None),
        ("99999999999", MAX_RETRY_AFTER_SECONDS),
        ("1e9", None),
        ("Thu, 01 Jan 1970 00:00:00 GMT", 0),  # a past date: retry now, no negative wait
        ("soon", None),
        pytest.param("9" * 200, MAX_RETRY_AFTER_SECONDS, id="200 digits: capped"),
    ],
)
def test_retry_after_values_over_http(
    standin: StandIn, client: TmdbClient, value: str, seconds: int | None
) -> None:
    standin.set_fault("throttle", retry_after=value)
    assert client.fetch("movie", 11, KEY) == Failure("throttled", seconds)


def test_connect_timeout_is_transient() -> None:
    """A listener whose accept queue is full drops SYNs: the connect times out."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        fillers = []
        try:
            for _ in range(3):
                filler = socket.socket()
                filler.setblocking(False)
                filler.connect_ex(address)
                fillers.append(filler)
            with TmdbClient(f"http://127.0.0.1:{address[1]}", timeout_seconds=0.5) as c:
                assert c.fetch("movie", 1, KEY) == Failure("transient")
        finally:
            for filler in fillers:
                filler.close()


FAULTS = [
    ("status", {"status": 401}, "auth"),
    ("status", {"status": 404}, "not_found"),
    ("status", {"status": 500}, "transient"),
    ("throttle", {"retry_after": "7200"}, "throttled"),
    ("throttle", {"retry_after": "-1"}, "throttled"),
    ("throttle", {"retry_after": "99999999999"}, "throttled"),
    ("garbage", {}, "invalid_response"),
    ("cut_json", {}, "invalid_response"),
    ("oversize", {}, "invalid_response"),
    ("gzip_bomb", {}, "invalid_response"),
    ("truncate", {}, "transient"),
    ("close", {}, "transient"),
    ("slow", {"delay": 1.5}, "transient"),
    ("drip", {"delay": 0.2}, "transient"),
]
POLICY = RetryPolicy()


@pytest.mark.parametrize(("fault", "options", "category"), FAULTS)
def test_each_fault_is_one_attempt_and_one_bounded_retry(
    conn: Connection,
    standin: StandIn,
    client: TmdbClient,
    fault: str,
    options: dict[str, object],
    category: str,
) -> None:
    f.provider_key(conn, KEY)
    item = f.tmdb_item(conn, f.library(conn), 11)
    standin.set_fault(fault, **options)
    [claim] = recovery.claim(conn, 10)
    settings = recovery.provider_settings(conn)
    result = recovery.observe_claim(conn, claim, client, settings, POLICY)
    assert (result.outcome, result.category, result.transition) == ("failed", category, "opened")
    assert len(standin.state.arrivals) == 1
    row = fetch_one(
        conn,
        "SELECT observation_lease_token AS lease,"
        " extract(epoch FROM observation_due_at - now()) AS wait"
        " FROM media_server_items WHERE id = %s",
        (item,),
    )
    assert row is not None and row["lease"] is None
    assert POLICY.base(category) - 1 <= row["wait"] <= POLICY.cap_seconds  # type: ignore[arg-type]
    if options.get("retry_after") == "7200":
        assert row["wait"] >= 7200 - 1  # a valid Retry-After only lengthens the delay
    assert recovery.claim(conn, 10) == []  # not due again: no retry loop
